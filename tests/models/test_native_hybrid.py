"""The native forward on the hybrid families' recurrent layers (kernels/csrc/recurrent.c: LFM2's short
convolutions, Qwen3.5's gated delta-nets, and its gated attention outputs), bf16 and int4: close to the
PyTorch reference, and bit for bit what exact speculation rests on, in logits and in the state rings the
HybridCache keeps by position: a block of K + 1 tokens is K + 1 one-token steps, a row alone is that row
in a batch at other positions, any number of threads gives the same bits, and a prompt chunk riding a
decode step leaves the rings its own prefill leaves. Through the LLM API, n-gram speculation on the
native path gives plain greedy's tokens."""
from __future__ import annotations

import pytest
import torch

from family_util import family_config, family_dir
from native_util import reference_and_native
from specdec import LLM, SamplingParams
from specdec.models import native
from specdec.models.llama import PromptChunk

pytestmark = pytest.mark.usefixtures("native_kernels")

# native-friendly sizes: Qwen3.5's heads of 64 (a quarter rotary: 16 dimensions); "qwen3_5-wide": one key
# head for four value heads of 32 (each head's output whole quantization groups)
CONFIGS = {"lfm2": ("lfm2", {}), "qwen3_5": ("qwen3_5", dict(head_dim=64)),
           "qwen3_5-wide": ("qwen3_5", dict(head_dim=64, linear_num_key_heads=1, linear_value_head_dim=32))}
QUANTS = [None, "int4"]
VOCAB = 97


def config(name: str):
    family, overrides = CONFIGS[name]
    return family_config(family, **overrides)


def pair(name: str, quant: str | None = None):
    return reference_and_native(config(name), quant)


def rings(cache, row: int | None = None) -> list[torch.Tensor]:
    """Copies of the cache's state rings (of one row, or all): inputs, states, the positions held."""
    sel = slice(None) if row is None else row
    return ([x[sel].clone() for x in cache.inputs] + [x[sel].clone() for x in cache.states if x is not None]
            + [cache.held[:, sel].clone()])


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def tokens(shape, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_the_hybrid_families_run_natively():
    for name in CONFIGS:
        cfg = config(name)
        assert native.missing_features(cfg) == [], name
        _, nat = pair(name)
        assert nat.native is not None
    # what still cannot run is said
    assert native.missing_features(family_config("qwen3_5")) == ["4 rotary dimensions (a multiple of 16 runs natively)"]
    assert native.missing_features(family_config("qwen3_5", head_dim=64, linear_value_head_dim=24)) == [
        "delta-net heads of 16 x 24 (multiples of 16 run natively)"]


@pytest.mark.parametrize("name", ["lfm2", "qwen3_5"])
@pytest.mark.parametrize("quant", QUANTS)
def test_native_logits_agree_with_the_reference(name, quant):
    """After a prompt's prefill and a block, through the rings either path wrote: close to the reference."""
    ref, nat = pair(name, quant)
    toks = tokens((2, 38), 1)
    outs = []
    for m in (ref, nat):
        cache = m.new_cache(2, 64)
        with torch.inference_mode():
            m(toks[:, :32], torch.arange(32).expand(2, -1), cache, fused_attention=True)
            outs.append(m(toks[:, 32:], torch.arange(32, 38).expand(2, -1), cache).logits.float())
    a, b = outs
    # bf16 sums in another order (and int4 activations quantized on either side): close, not equal
    assert (a - b).abs().max() < (0.03 if quant is None else 0.05) * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("quant", [*QUANTS, "int8"])
def test_blocks_score_and_keep_rings_exactly_like_one_token_steps(name, quant):
    """Blocks of 1, K + 1 = 5, one longer than the ring (12 > 8 entries: only its last entries kept) and 3
    tokens, two rows: the logits and every ring entry of the one-token steps, bit for bit."""
    _, m = pair(name, quant)
    m.state_slots = 8  # rings of 8 entries
    seqs = tokens((2, 41), 6)
    with torch.inference_mode():
        step_cache = m.new_cache(2, 64)
        m(seqs[:, :20], torch.arange(20).expand(2, 20), step_cache)
        steps = torch.stack([m(seqs[r:r + 1, t:t + 1], torch.tensor([[t]]), step_cache, rows=torch.tensor([r])).logits[0, 0]
                             for r in range(2) for t in range(20, 41)]).view(2, 21, -1)
        block_cache = m.new_cache(2, 64)
        m(seqs[:, :20], torch.arange(20).expand(2, 20), block_cache)
        t = 20
        for k in (1, 5, 12, 3):
            out = m(seqs[:, t:t + k], torch.arange(t, t + k).expand(2, k), block_cache).logits
            assert torch.equal(out, steps[:, t - 20:t - 20 + k]), (k, t)
            t += k
    assert same(rings(block_cache), rings(step_cache))


@pytest.mark.parametrize("name", ["lfm2", "qwen3_5"])
def test_results_do_not_depend_on_the_number_of_threads(name):
    _, m = pair(name, "int4" if name == "lfm2" else None)
    toks = tokens((2, 30), 7)
    outs, kept, threads = [], [], torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            cache = m.new_cache(2, 64)
            with torch.inference_mode():
                m(toks[:, :22], torch.arange(22).expand(2, 22), cache)
                outs.append(m(toks[:, 22:], torch.arange(22, 30).expand(2, 8), cache).logits)
            kept.append(rings(cache))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert all(same(kept[0], k) for k in kept[1:])


@pytest.mark.parametrize("name", ["lfm2", "qwen3_5"])
@pytest.mark.parametrize("quant", QUANTS)
def test_a_row_in_a_batch_at_another_position_is_that_row_alone(name, quant):
    """Rows at positions 17 and 26 verify blocks of 5 in one forward: each row's logits and rings are its
    own forward's alone."""
    _, m = pair(name, quant)
    seqs = tokens((2, 31), 8)
    starts = (17, 26)
    pos = torch.stack([torch.arange(s, s + 5) for s in starts])
    with torch.inference_mode():
        caches = []
        for _ in range(2):
            c = m.new_cache(2, 64)
            for r, s in enumerate(starts):
                m(seqs[r:r + 1, :s], torch.arange(s)[None], c, rows=torch.tensor([r]))
            caches.append(c)
        batch = m(torch.stack([seqs[r, s:s + 5] for r, s in enumerate(starts)]), pos, caches[0]).logits
        for r, s in enumerate(starts):
            alone = m(seqs[r:r + 1, s:s + 5], pos[r:r + 1], caches[1], rows=torch.tensor([r])).logits
            assert torch.equal(batch[r:r + 1], alone), r
    assert same(rings(caches[0]), rings(caches[1]))


@pytest.mark.parametrize("name", ["lfm2", "qwen3_5"])
@pytest.mark.parametrize("quant", QUANTS)
def test_prompt_chunks_riding_a_step_leave_their_own_prefills_rings(name, quant):
    """Row 1's prompt in two chunks (from position 0, then on from 8) rides row 0's block: row 0's
    logits are its block's alone, row 1's rings (and its next step) those of its chunks' own prefills."""
    _, m = pair(name, quant)
    seqs = tokens((2, 24), 9)
    chunks = PromptChunk.split(1, seqs[1, :14].tolist(), 0, 8)
    with torch.inference_mode():
        riding, alone = m.new_cache(2, 64), m.new_cache(2, 64)
        for c in (riding, alone):
            m(seqs[:1, :16], torch.arange(16)[None], c, rows=torch.tensor([0]))
        a = m(seqs[:1, 16:20], torch.arange(16, 20)[None], riding, rows=torch.tensor([0]), prompt_chunks=chunks).logits
        b = m(seqs[:1, 16:20], torch.arange(16, 20)[None], alone, rows=torch.tensor([0])).logits
        for pc in chunks:
            m(torch.tensor([pc.tokens]), torch.arange(pc.start, pc.start + len(pc.tokens))[None], alone,
              rows=torch.tensor([1]))
        assert torch.equal(a, b)
        assert same(rings(riding, 1), rings(alone, 1)) and same(rings(riding, 0), rings(alone, 0))
        nxt = [m(seqs[1:, 14:17], torch.arange(14, 17)[None], c, rows=torch.tensor([1])).logits for c in (riding, alone)]
    assert torch.equal(*nxt)


def test_a_state_not_kept_is_an_error_and_skipped_layers_write_nothing():
    _, m = pair("qwen3_5")
    cache = m.new_cache(1, 64)
    with torch.inference_mode():
        m(torch.ones(1, 30, dtype=torch.long), torch.arange(30)[None], cache)
        before = rings(cache)
        skip = frozenset(m.config.state_layers[:2])
        m(torch.ones(1, 2, dtype=torch.long), torch.tensor([[30, 31]]), cache, skip_layers=skip)
        after = rings(cache)
        for s, i in enumerate(m.config.state_layers):  # the skipped layers' rings as they were, the others on
            assert torch.equal(after[-1][s], before[-1][s]) == (i in skip)
        with pytest.raises(RuntimeError, match="is not kept"):  # the state after 4: long overwritten
            m(torch.ones(1, 1, dtype=torch.long), torch.tensor([[5]]), cache)
        with pytest.raises(RuntimeError, match="is not kept"):  # skipped layers hold nothing past 29
            m(torch.ones(1, 1, dtype=torch.long), torch.tensor([[32]]), cache)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("native-hybrid")


@pytest.mark.parametrize("name", ["lfm2", pytest.param("qwen3_5", marks=pytest.mark.slow)])  # 14 s each
def test_ngram_speculation_on_the_native_path_equals_plain_greedy(root, name):
    family, overrides = CONFIGS[name]
    path = family_dir(root, family, **overrides)
    llm = LLM(model=str(path), dtype="bfloat16", progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    assert llm.target.model.native is not None
    prompts = ["the cat sat on the mat and the cat sat on the", "a b c a b c a b"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, num_speculative_tokens=0)]
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
