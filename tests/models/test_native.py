"""The native forward (models/native.py, kernels/csrc/forward.c) against the PyTorch reference, and the
properties exact speculation rests on: a row's logits bit-identical whatever else shares the block
(block size, other rows, prompt chunks riding along, the number of threads), tree branches bit-identical
to their chains."""
from __future__ import annotations

import pytest
import torch

from native_util import reference_and_native
from specdec import kernels
from specdec.config import ModelConfig
from specdec.models import native
from specdec.quant.linear import Linear, tile_bf16, untile_bf16
from specdec.models.llama import PromptChunk, build_model
from specdec.models.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("native_kernels")  # skips without them; fails under SPECDEC_REQUIRE_KERNELS=1


def config(hidden: int = 64, heads: int = 4, kv: int = 2, layers: int = 2, bias: bool = True) -> ModelConfig:
    return ModelConfig(vocab_size=97, hidden_size=hidden, intermediate_size=96,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       head_dim=hidden // heads, architecture="qwen2", attention_bias=bias)


def pair(quant: str | None = None, **kw) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same random model twice: the PyTorch reference and the native twin."""
    return reference_and_native(config(**kw), quant)


def test_tiles_round_trip_and_products_match_f_linear():
    w = torch.randn(50, 96).bfloat16()  # N not a multiple of 16: a padded last tile
    assert torch.equal(untile_bf16(tile_bf16(w), 50), w)
    lin = Linear(96, 50, bias=True, dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    lin.bias.data.normal_()
    x = torch.randn(11, 96).bfloat16()
    ref = torch.nn.functional.linear(x.float(), w.float(), lin.bias.float())
    assert lin.tile()
    got = lin(x)
    assert (got.float() - ref).abs().max() < 0.05 * ref.abs().max()
    # batch invariance: every row alone gives the same bits as inside the block of 11
    for i in range(11):
        assert torch.equal(lin(x[i:i + 1]), got[i:i + 1])


@pytest.mark.parametrize("n_out", [171, 100])
def test_bf16_products_of_any_block_give_each_row_its_bits_alone(n_out):
    """Blocks of 1-17 rows (register blocks of 8, of 9 for a K=8 verification, their remainders) over
    column tiles grouped 3, 2 and 1 at a thread's end: every row equals its product alone."""
    lin = Linear(160, n_out, bias=False, dtype=torch.bfloat16)
    lin.weight.data.normal_()
    x = torch.randn(17, 160).bfloat16()
    ref = torch.nn.functional.linear(x.float(), lin.weight.float())
    assert lin.tile()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(17)])
    assert (alone.float() - ref).abs().max() < 0.05 * ref.abs().max()
    for m in range(2, 18):
        assert torch.equal(lin(x[:m]), alone[:m]), m


# head size 16 (2 kv heads), and 32 with 3 kv heads: quantization groups within a head (attention
# quantizes its own output), query heads of one kv head split between threads
SHAPES = [dict(hidden=64, heads=4, kv=2), dict(hidden=192, heads=6, kv=3)]


@pytest.mark.parametrize("shape", SHAPES, ids=["hd16", "hd32-kv3"])
@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_native_logits_agree_with_the_reference(quant, shape):
    ref, nat = pair(quant, **shape)
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, 97, (2, 30), generator=g)
    outs = []
    for m in (ref, nat):
        cache = m.new_cache(2, 64)
        with torch.inference_mode():
            m(toks[:, :24], torch.arange(24).expand(2, 24), cache, fused_attention=True)
            outs.append(m(toks[:, 24:], torch.arange(24, 30).expand(2, 6), cache, hidden_layers=(0, -1)))
    a, b = outs
    scale = a.logits.float().abs().max()
    assert (a.logits.float() - b.logits.float()).abs().max() < 0.03 * scale
    assert (a.logits.argmax(-1) == b.logits.argmax(-1)).float().mean() > 0.9
    for i in (0, -1):
        assert (a.hidden[i].float() - b.hidden[i].float()).abs().max() < 0.03 * a.hidden[i].float().abs().max()


def test_skipped_layers_and_hidden_states_follow_the_reference():
    ref, nat = pair(layers=3)
    toks = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    outs = []
    for m in (ref, nat):
        cache = m.new_cache(1, 32)
        with torch.inference_mode():
            outs.append(m(toks, torch.arange(9)[None], cache, skip_layers=frozenset({1}), hidden_layers=(0, 1, 2)))
    a, b = outs
    assert torch.equal(b.hidden[0], b.hidden[1])  # a skipped layer leaves the stream as it was
    assert (a.logits.float() - b.logits.float()).abs().max() < 0.03 * a.logits.float().abs().max()
    assert (a.hidden[1].float() - b.hidden[1].float()).abs().max() < 0.03 * a.hidden[1].float().abs().max()


@pytest.mark.parametrize("shape", SHAPES, ids=["hd16", "hd32-kv3"])
@pytest.mark.parametrize("quant", [None, "int4"])
def test_blocks_of_any_size_score_exactly_like_one_token_steps(quant, shape):
    """Speculation is exact only if a K-token block gives the same logits, bit for bit, as K steps,
    with other rows in the batch or alone."""
    _, m = pair(quant, **shape)
    seqs = torch.randint(0, 97, (3, 80), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        step_cache = m.new_cache(3, 96)
        m(seqs[:, :40], torch.arange(40).expand(3, 40), step_cache, fused_attention=True)
        steps = torch.stack([m(seqs[r:r + 1, t:t + 1], torch.tensor([[t]]), step_cache, rows=torch.tensor([r])).logits[0, 0]
                             for r in range(3) for t in range(40, 80)]).view(3, 40, -1)
        block_cache = m.new_cache(3, 96)
        m(seqs[:, :40], torch.arange(40).expand(3, 40), block_cache, fused_attention=True)
        t = 40
        for k in (1, 2, 5, 9, 7, 16):  # blocks of different sizes, all rows at once (up to 48 rows)
            out = m(seqs[:, t:t + k], torch.arange(t, t + k).expand(3, k), block_cache).logits
            assert torch.equal(out, steps[:, t - 40:t - 40 + k]), (k, t)
            t += k


@pytest.mark.parametrize("shape", SHAPES, ids=["hd16", "hd32-kv3"])
@pytest.mark.parametrize("quant", [None, "int4"])
def test_results_do_not_depend_on_the_number_of_threads(quant, shape):
    _, m = pair(quant, **shape)
    toks = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(7))
    outs, threads = [], torch.get_num_threads()
    try:
        for n in (1, threads, threads + 1):
            torch.set_num_threads(n)
            cache = m.new_cache(2, 32)
            with torch.inference_mode():
                m(toks[:, :12], torch.arange(12).expand(2, 12), cache, fused_attention=True)
                outs.append(m(toks[:, 12:], torch.arange(12, 20).expand(2, 8), cache).logits)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_tree_branches_score_exactly_like_their_chains():
    _, m = pair()
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 97, (37,), generator=g)  # the tree straddles a cache block boundary
    a, b = torch.randint(0, 97, (3,), generator=g), torch.randint(0, 97, (2,), generator=g)
    with torch.inference_mode():
        chains = []
        for branch in (a, b):
            c = m.new_cache(1, 64)
            m(prefix[None], torch.arange(37)[None], c, fused_attention=True)
            n = len(branch)
            chains.append(m(branch[None], torch.arange(37, 37 + n)[None], c).logits[0])
        cache = m.new_cache(1, 64)
        m(prefix[None], torch.arange(37)[None], cache, fused_attention=True)
        nodes = torch.cat([a, b])[None]  # a0 a1 a2 b0 b1 in slots 37..41
        rope = torch.tensor([[37, 38, 39, 37, 38]])
        tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]],
                            dtype=torch.bool)[None]
        out = m(nodes, rope, cache, cache_pos=torch.arange(37, 42)[None], attn_mask=tree).logits[0]
    assert torch.equal(out[:3], chains[0])
    assert torch.equal(out[3:], chains[1])


def _rows_equal(ca, cb, lengths: dict[int, int]) -> bool:
    for row, n in lengths.items():
        ka = ca.read(0, ca.gather_index(torch.tensor([row]), n))
        kb = cb.read(0, cb.gather_index(torch.tensor([row]), n))
        if not all(torch.equal(x, y) for x, y in zip(ka, kb)):
            return False
    return True


@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_a_prompt_chunk_riding_a_step_changes_neither_the_step_nor_its_own_cache(chunk):
    _, m = pair()
    g = torch.Generator().manual_seed(chunk)
    seqs = torch.randint(0, 97, (2, 50), generator=g)
    prompts = {1: torch.randint(0, 97, (1, 40 + chunk), generator=g), 3: torch.randint(0, 97, (1, 40 + chunk), generator=g)}
    rows = torch.tensor([0, 2])
    block, pos = seqs[:, 45:50], torch.arange(45, 50).expand(2, 5)
    results = []
    with torch.inference_mode():
        for ride in (False, True):
            cache = m.new_cache(4, 128)
            m(seqs[:, :45], torch.arange(45).expand(2, 45), cache, rows=rows, fused_attention=True)
            for r, p in prompts.items():
                m(p[:, :40], torch.arange(40)[None], cache, rows=torch.tensor([r]), fused_attention=True)
            if ride:
                chunks = [PromptChunk(r, p[0, 40:].tolist(), 40) for r, p in prompts.items()]
                out = m(block, pos, cache, rows=rows, prompt_chunks=chunks).logits
            else:
                out = m(block, pos, cache, rows=rows).logits
                for r, p in prompts.items():  # the piece alone, as ModelRunner's small-chunk prefill runs it
                    m(p[:, 40:], torch.arange(40, 40 + chunk)[None], cache, rows=torch.tensor([r]),
                      logits_positions="none", fused_attention=True)
            results.append((out, cache))
    (a, ca), (b, cb) = results
    assert torch.equal(a, b)
    assert _rows_equal(ca, cb, {0: 50, 2: 50} | {r: 40 + chunk for r in prompts})


@pytest.mark.parametrize("path", ["reference", "native"])
def test_a_slot_past_the_cache_is_a_clear_error_on_both_paths(path):
    """The one check (KVCache.prepare_writes, through Transformer.prepare) guards the step's slots and
    a prompt chunk's alike, on the reference and on the native forward."""
    m = pair()[0 if path == "reference" else 1]
    cache = m.new_cache(2, 64)
    with torch.inference_mode():
        m(torch.randint(0, 97, (1, 40)), torch.arange(40)[None], cache, rows=torch.tensor([0]))
        with pytest.raises(ValueError, match="position 64 is past the KV cache length 64"):
            m(torch.tensor([[5]]), torch.tensor([[64]]), cache, rows=torch.tensor([0]))
        if path == "native":  # only the native forward takes prompt chunks along
            with pytest.raises(ValueError, match="position 69 is past the KV cache length 64"):
                m(torch.tensor([[5]]), torch.tensor([[40]]), cache, rows=torch.tensor([0]),
                  prompt_chunks=[PromptChunk(1, list(range(10)), 60)])
        out = m(torch.tensor([[5]]), torch.tensor([[40]]), cache, rows=torch.tensor([0])).logits  # still usable
    assert torch.isfinite(out.float()).all()


def test_small_prefill_chunks_write_the_same_cache_with_or_without_hidden_states():
    """A runner with a small prefill chunk prefills the same cache whether the caller asks for hidden
    states (EAGLE's target) or not (plain decoding): both run the chunks on one path."""
    _, m = pair()
    ids = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    caches = []
    for hidden in ((), (0,)):
        r = ModelRunner(m, prefill_chunk=24)
        r.ensure_cache(2, 128)
        r.prefill(1, ids, hidden_layers=hidden)
        caches.append(r.cache)
    assert _rows_equal(caches[0], caches[1], {1: 100})


def test_a_prompt_cut_anywhere_writes_the_same_cache():
    """On the native path a prompt's cache does not depend on where its pieces end: the engine's prefill
    pacer cuts prompts at any token (``EngineCore._prefill_plan``), alone or riding a step."""
    _, m = pair()
    ids = torch.randint(0, 97, (1, 100), generator=torch.Generator().manual_seed(2))
    caches = []
    with torch.inference_mode():
        for cuts in ([0, 32, 64, 96, 100], [0, 1, 8, 9, 40, 41, 77, 100], [0, 100]):
            cache = m.new_cache(2, 128)
            for lo, hi in zip(cuts, cuts[1:]):
                m(ids[:, lo:hi], torch.arange(lo, hi)[None], cache, rows=torch.tensor([1]), logits_positions="none")
            caches.append(cache)
    assert _rows_equal(caches[0], caches[1], {1: 100}) and _rows_equal(caches[0], caches[2], {1: 100})


def test_drafting_heads_run_their_products_natively():
    """``tile_linears`` turns a head's ``torch.nn.Linear`` layers into native products with the same
    results (to bf16 rounding) and rows that do not depend on the batch."""
    head = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 32, bias=False)).to(torch.bfloat16)
    x = torch.randn(5, 64).bfloat16()
    with torch.no_grad():
        want = head(x).float()
        assert native.tile_linears(head) == 2
        assert all(isinstance(m, Linear) and m.tiled is not None for m in (head[0], head[2]))
        got = head(x)
        assert (got.float() - want).abs().max() < 0.05 * want.abs().max()
        assert torch.equal(head(x[2:3]), got[2:3])


def test_native_path_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("SPECDEC_NATIVE", "0")
    m = build_model(config(), dtype=torch.bfloat16, seed=3)
    assert not m.make_native() and m.native is None


@pytest.mark.parametrize("quant", [None, "int4"])
def test_prompts_of_native_models_are_prefilled_in_native_pieces(quant, monkeypatch):
    """Without AMX a one-shot bf16 product copies every weight out of its tiles and runs on the same
    instruction as the native kernel (the 1.5B: 5x slower at 69 tokens, 1.6x at 1,000-3,000), and
    quantized products are as fast natively: a native model's runner prefills in pieces of one
    batch-invariant product; fp32 models, the PyTorch path and bf16 weights on AMX machines keep
    512-token one-shot products."""
    from specdec.models import runner as runner_mod  # noqa: PLC0415
    ref, nat = pair(quant)
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx512_bf16"})
    assert ModelRunner(nat).prefill_chunk == 32 and ModelRunner(nat).small_chunks
    assert ModelRunner(ref).prefill_chunk == runner_mod.WHOLE_CHUNK  # not native
    assert ModelRunner(nat, prefill_chunk=100).prefill_chunk == 100  # asked for
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: {"avx512_bf16", "amx_bf16"})
    assert ModelRunner(nat).prefill_chunk == (32 if quant else runner_mod.WHOLE_CHUNK)
    fp32 = build_model(config(), dtype=torch.float32, seed=3)
    assert ModelRunner(fp32).prefill_chunk == runner_mod.WHOLE_CHUNK
