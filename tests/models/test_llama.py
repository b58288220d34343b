"""Our Llama-family forward against transformers' on tiny random weights, plus the cache contract."""
import pytest
import torch

from specdec.config import ModelConfig
from specdec.models.llama import build_model
from kv_util import same_rows

transformers = pytest.importorskip("transformers")


def hf_tiny(arch: str, tie: bool):
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie, rope_theta=5000.0)
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(sliding_window=None, **common)
        model_cls = transformers.MistralForCausalLM
    elif arch == "llama3":
        cfg = transformers.LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                                       **common)
        model_cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # make biases non-zero so they are really tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def ours_from_hf(hf) -> torch.nn.Module:
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    return build_model(cfg, sd, dtype=torch.float32)


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False),
                                      ("mistral", False), ("llama3", False)])
def test_logits_match_transformers(arch, tie):
    hf = hf_tiny(arch, tie)
    ours = ours_from_hf(hf)
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        cache = ours.new_cache(2, 64)
        pos = torch.arange(40).expand(2, 40)
        got = ours(tokens, pos, cache).logits
    assert (got - ref).abs().max().item() < 1e-4


def test_incremental_decode_with_ragged_rows_matches_full_forward():
    hf = hf_tiny("qwen2", False)
    ours = ours_from_hf(hf)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 97, (n,), generator=g) for n in (12, 7)]
    with torch.no_grad():
        full = [ours(s[None], torch.arange(len(s))[None], ours.new_cache(1, 32)).logits[0] for s in seqs]
        cache = ours.new_cache(2, 32)
        # prefill each row alone, to different lengths, leaving 3 tokens of each to decode
        for r, s in enumerate(seqs):
            n = len(s) - 3
            ours(s[None, :n], torch.arange(n)[None], cache, rows=torch.tensor([r]))
        # then two ragged steps: a 2-token block and a 1-token block, both rows at once
        for lo, hi in ((3, 1), (1, 0)):
            toks = torch.stack([s[len(s) - lo:len(s) - hi] for s in seqs])
            pos = torch.stack([torch.arange(len(s) - lo, len(s) - hi) for s in seqs])
            out = ours(toks, pos, cache).logits
            for r, s in enumerate(seqs):
                assert torch.allclose(out[r], full[r][len(s) - lo:len(s) - hi], atol=1e-5)


def test_stale_cache_slots_are_ignored_and_overwritten():
    hf = hf_tiny("llama", True)
    ours = ours_from_hf(hf)
    s = torch.randint(0, 97, (10,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = ours(s[None], torch.arange(10)[None], ours.new_cache(1, 16)).logits[0]
        cache = ours.new_cache(1, 16)
        ours(s[None, :6], torch.arange(6)[None], cache)
        # a rejected 4-token draft written at slots 6..9
        ours(torch.full((1, 4), 5), torch.arange(6, 10)[None], cache)
        out = ours(s[None, 6:], torch.arange(6, 10)[None], cache).logits[0]
    assert torch.allclose(out, ref[6:], atol=1e-5)


def test_tree_mask_equals_separate_chains():
    """Two branches verified in one forward with a tree mask give each branch's chain logits."""
    hf = hf_tiny("llama", False)
    ours = ours_from_hf(hf)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 97, (5,), generator=g)
    a, b = torch.randint(0, 97, (2,), generator=g), torch.randint(0, 97, (2,), generator=g)
    with torch.no_grad():
        ref_a = ours(torch.cat([prefix, a])[None], torch.arange(7)[None], ours.new_cache(1, 16)).logits[0, 5:]
        ref_b = ours(torch.cat([prefix, b])[None], torch.arange(7)[None], ours.new_cache(1, 16)).logits[0, 5:]
        cache = ours.new_cache(1, 16)
        ours(prefix[None], torch.arange(5)[None], cache)
        nodes = torch.cat([a, b])[None]  # nodes a0 a1 b0 b1 in slots 5..8
        rope_pos = torch.tensor([[5, 6, 5, 6]])
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)[None]
        out = ours(nodes, rope_pos, cache, cache_pos=torch.arange(5, 9)[None], attn_mask=tree).logits[0]
    assert torch.allclose(out[:2], ref_a, atol=1e-5)
    assert torch.allclose(out[2:], ref_b, atol=1e-5)


def test_hidden_states_and_skipped_layers():
    hf = hf_tiny("llama", False)
    ours = ours_from_hf(hf)
    s = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(6)[None]
    with torch.no_grad():
        ref = hf(s, output_hidden_states=True).hidden_states  # embeddings, after block 0, 1, 2(normed)
        out = ours(s, pos, ours.new_cache(1, 8), hidden_layers=(0, 1, -1))
        assert torch.allclose(out.hidden[0], ref[1], atol=1e-5)
        assert torch.allclose(out.hidden[1], ref[2], atol=1e-5)
        assert torch.allclose(out.hidden[-1], ref[3], atol=1e-5)
        # skipping block 1 = feeding block 0's output straight into block 2
        skipped = ours(s, pos, ours.new_cache(1, 8), skip_layers=frozenset({1}), logits_positions="last")
        manual_cache = ours.new_cache(1, 8)
        x = ours.embed_tokens(s)
        from specdec.models.llama import ForwardContext  # noqa: PLC0415
        ang = (pos.float().unsqueeze(-1) * ours.inv_freq)
        ang = torch.cat((ang, ang), -1).unsqueeze(1)
        mask = (torch.arange(6).view(1, 6) <= torch.arange(6).view(6, 1)).view(1, 1, 6, 6)
        fwd = ForwardContext(manual_cache, None, manual_cache.slot_index(None, pos), 6, mask, [(ang.cos(), ang.sin())], pos)
        x = ours.layers[2](ours.layers[0](x, fwd, 0), fwd, 2)
        manual = ours.lm_head(ours.norm(x))[:, -1:]
    assert torch.allclose(skipped.logits, manual, atol=1e-5)
    assert skipped.logits.shape == (1, 1, 97)


def test_random_init_builds_every_arch():
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=8, attention_bias=True,
                      tie_word_embeddings=True, architecture="qwen2")
    m = build_model(cfg, dtype=torch.bfloat16)
    assert m.lm_head.weight is m.embed_tokens.weight
    out = m(torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]]), m.new_cache(1, 4)).logits
    assert out.shape == (1, 3, 50) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_verification_scores_exactly_like_one_token_steps(dtype):
    """Speculation is exact only if a K-token block gives the same logits, bit for bit, as K steps."""
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, architecture="qwen2",
                      attention_bias=True)
    m = build_model(cfg, dtype=dtype, seed=3)
    g = torch.Generator().manual_seed(6)
    seqs = torch.randint(0, 97, (3, 80), generator=g)
    with torch.inference_mode():
        step_cache = m.new_cache(3, 96)
        m(seqs[:, :40], torch.arange(40).expand(3, 40), step_cache)
        steps = [m(seqs[r:r + 1, t:t + 1], torch.tensor([[t]]), step_cache, rows=torch.tensor([r])).logits[0, 0]
                 for r in range(3) for t in range(40, 80)]
        steps = torch.stack(steps).view(3, 40, -1)
        block_cache = m.new_cache(3, 96)
        m(seqs[:, :40], torch.arange(40).expand(3, 40), block_cache)
        t = 40
        for k in (1, 2, 5, 9, 7, 16):  # blocks of different sizes, all rows at once
            out = m(seqs[:, t:t + k], torch.arange(t, t + k).expand(3, k), block_cache).logits
            assert torch.equal(out, steps[:, t - 40:t - 40 + k]), (k, t)
            t += k


@pytest.mark.parametrize("dtype,chunk", [(torch.float32, 1), (torch.float32, 3), (torch.float32, 4),
                                         (torch.bfloat16, 1), (torch.bfloat16, 7), (torch.bfloat16, 32)])
def test_a_prompt_chunk_riding_a_step_changes_neither_the_step_nor_its_own_cache(dtype, chunk):
    """Mixed batches: a decode/verification step that also prefills a piece of another prompt gives
    the step's logits bit for bit, and writes the cache a prefill call of that piece alone writes
    (for pieces of at most ``row_block`` tokens, whose products are the same calls either way)."""
    from specdec.quant.linear import whole_products
    from specdec.models.llama import PromptChunk

    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, architecture="qwen2",
                      attention_bias=True)
    m = build_model(cfg, dtype=dtype, seed=5)
    g = torch.Generator().manual_seed(chunk)
    seqs = torch.randint(0, 97, (2, 50), generator=g)
    prompts = {1: torch.randint(0, 97, (1, 40 + chunk), generator=g),  # two prompts, rows 1 and 3
               3: torch.randint(0, 97, (1, 40 + chunk), generator=g)}
    rows = torch.tensor([0, 2])
    block, pos = seqs[:, 45:50], torch.arange(45, 50).expand(2, 5)
    with torch.inference_mode():
        caches = []
        for ride in (False, True):
            cache = m.new_cache(4, 128)
            m(seqs[:, :45], torch.arange(45).expand(2, 45), cache, rows=rows, fused_attention=True)
            for r, p in prompts.items():
                m(p[:, :40], torch.arange(40).unsqueeze(0), cache, rows=torch.tensor([r]), fused_attention=True)
            if ride:
                chunks = [PromptChunk(r, p[0, 40:].tolist(), 40) for r, p in prompts.items()]
                out = m(block, pos, cache, rows=rows, prompt_chunks=chunks).logits
            else:
                out = m(block, pos, cache, rows=rows).logits
                for r, p in prompts.items():
                    with whole_products():  # the prefill call of that piece alone
                        m(p[:, 40:], torch.arange(40, 40 + chunk).unsqueeze(0), cache, rows=torch.tensor([r]),
                          logits_positions="last", fused_attention=True)
            caches.append((out, cache))
    (a, ca), (b, cb) = caches
    assert torch.equal(a, b)
    assert same_rows(ca, cb, {0: 50, 2: 50} | {r: 40 + chunk for r in prompts})
    with pytest.raises(ValueError, match="skips layers"):
        m(block, pos, cb, rows=rows, skip_layers=frozenset({0}), prompt_chunks=[PromptChunk(1, [3], 40)])


def test_small_prefill_chunks_grouped_in_one_forward_write_the_cache_of_one_call_each(monkeypatch):
    """``ModelRunner.prefill`` with chunks of at most ``row_block`` tokens runs several per forward;
    the cache is the one a prefill call per chunk writes, bit for bit."""
    from specdec.quant.linear import whole_products
    from specdec.models import runner as runner_mod

    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, architecture="qwen2")
    m = build_model(cfg, dtype=torch.bfloat16, seed=8)
    ids = torch.randint(0, 97, (290,), generator=torch.Generator().manual_seed(1)).tolist()
    monkeypatch.setattr(runner_mod, "GROUP_TOKENS", 100)  # 4 chunks of 24 per forward, then the rest
    r = runner_mod.ModelRunner(m, prefill_chunk=24)
    r.ensure_cache(2, 384)
    assert r.prefill(1, ids, start=10) is None
    want = m.new_cache(2, 384)
    with torch.inference_mode(), whole_products():
        for a in range(0, 290, 24):
            piece = ids[a:a + 24]
            m(torch.tensor([piece]), torch.arange(10 + a, 10 + a + len(piece)).unsqueeze(0), want,
              rows=torch.tensor([1]), logits_positions="last", fused_attention=True)
    assert same_rows(r.cache, want, {1: 300})
