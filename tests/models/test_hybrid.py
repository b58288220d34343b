"""Hybrid families (LFM2's short convolutions, Qwen3.5's gated delta-nets) against transformers' own
classes on the same random weights, and speculation on them token-identical to plain decoding with
rejections at every draft position: the recurrent states kept by position need no rollback.
"""
from __future__ import annotations

import pytest
import torch

from conftest import CORPUS
from family_util import HYBRID_CONFIGS, assert_greedy_is_generate, family_config, family_dir, teacher_forced_error
from specdec import LLM, SamplingParams
from specdec.errors import SpecdecError
from specdec.formats.hf import load_model_config, load_state_dict
from specdec.models.llama import build_model
from specdec.proposers.base import Draft, Proposer, draft_budget

transformers = pytest.importorskip("transformers")

HYBRIDS = list(HYBRID_CONFIGS)
PROMPTS = [CORPUS[0] + CORPUS[2], CORPUS[1] + " " + CORPUS[3]]  # two lengths: rows at different positions
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hybrid")


@pytest.mark.parametrize("name", HYBRIDS)
def test_teacher_forced_logits_match_transformers_whole_and_in_blocks(root, name):
    """fp32 logits of 40 positions (two rows) within 1e-4 of transformers' (its chunked delta rule over
    the whole prompt), and the same logits in blocks of 30, 1, 4 and 5 tokens through the states kept in
    the cache, bit for bit."""
    path = family_dir(root, name)
    assert teacher_forced_error(path) < 1e-4
    cfg = load_model_config(path)
    ours = build_model(cfg, load_state_dict(path, torch.float32), dtype=torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = ours(tokens, torch.arange(40).expand(2, 40), ours.new_cache(2, 64)).logits
        cache, parts = ours.new_cache(2, 64), []
        for a, b in ((0, 30), (30, 31), (31, 35), (35, 40)):
            parts.append(ours(tokens[:, a:b], torch.arange(a, b).expand(2, b - a), cache).logits)
    assert torch.equal(torch.cat(parts, 1), whole)


@pytest.mark.parametrize("name", HYBRIDS)
def test_greedy_tokens_match_transformers_generate(root, name):
    assert_greedy_is_generate(family_dir(root, name), PROMPTS)


class Rejecting(Proposer):
    """Drafts K tokens of which the first j are plain greedy's next tokens and the rest wrong, j going
    0, 1, ..., K, 0, ... from step to step: every draft position is rejected in turn (and a whole
    block accepted once per cycle)."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.truth, self.vocab, self.step = truth, vocab, 0
        self.rejected_at: set[int] = set()

    def propose(self, seqs, ks):
        budget = draft_budget(seqs, ks)
        k = max(budget)
        rows = []
        for s, b in zip(seqs, budget):
            out = self.truth[tuple(s.prompt_ids)][len(s.output_ids):]
            j = self.step % (b + 1) if b else 0
            if j < b:
                self.rejected_at.add(j)
            rows.append([out[i] if i < j else (out[i] + 1) % self.vocab for i in range(b)] + [0] * (k - b))
        self.step += 1
        return Draft(torch.tensor(rows, dtype=torch.long).view(len(rows), k), torch.tensor(budget))


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("k", [4, 9])
def test_rejections_at_every_draft_position_change_no_token(root, name, k):
    """bf16 and int4: a proposer that is wrong from position j on, for every j in turn, leaves plain
    greedy's tokens (batch 2, rows at different positions); K = 9 needs rings wider than the default."""
    path = family_dir(root, name)
    for quant in (None, "int4"):
        llm = LLM(model=str(path), dtype="bfloat16", progress=False, quantization=quant,
                  speculative_config={"method": "ngram", "num_speculative_tokens": k})
        params = GREEDY.replace(max_tokens=64)  # a whole cycle of j = 0..K fits
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, num_speculative_tokens=0)]
        truth = {tuple(llm.tokenizer.encode(p)): out + [0] * (k + 1) for p, out in zip(PROMPTS, plain)}
        llm.proposer = Rejecting(truth, llm.target.config.vocab_size)
        outs = llm.generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in outs] == plain, quant
        assert llm.proposer.rejected_at == set(range(k))
        assert outs[0].metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("name", HYBRIDS)
def test_speculation_equals_plain_greedy_in_bf16_and_int4(root, name):
    """n-gram, the int4 self-draft and a two-layer draft model of the same family (itself hybrid) give
    plain greedy's tokens, bf16 and int4 targets, batch 2."""
    path, draft = family_dir(root, name), family_dir(root, name, seed=3, num_hidden_layers=2)
    configs = {"ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
               "self-int4": {"method": "layer_skip", "quantization": "int4", "skip_ratio": 0.0, "search_steps": 0,
                             "draft_confidence_threshold": 0.0},
               "draft": {"method": "draft_model", "model": str(draft)}}
    for quant in (None, "int4"):
        plain = [o.outputs[0].token_ids for o in LLM(model=str(path), dtype="bfloat16", progress=False,
                                                      quantization=quant).generate(PROMPTS, GREEDY)]
        for label, conf in configs.items():
            spec = LLM(model=str(path), dtype="bfloat16", progress=False, quantization=quant,
                       speculative_config=conf | {"num_speculative_tokens": 4})
            outs = spec.generate(PROMPTS, GREEDY)
            assert [o.outputs[0].token_ids for o in outs] == plain, (quant, label)
            assert sum(o.metrics.num_draft_tokens for o in outs) > 0, (quant, label)


@pytest.mark.parametrize("name", ["lfm2", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_speculative_samples_follow_the_target(root, name):
    """Sampled speculation keeps the target's exact law on a hybrid model: the first two tokens' joint law
    from the model, 3,000 seeded speculative samples against it (chi-square, tests/proposers/
    test_distribution.py's test) with a two-layer hybrid draft. Qwen3.5's (80 s: its delta rule runs token
    by token on the reference path in fp32) in the slow stage."""
    from proposers.test_distribution import ALPHA, PROMPT, chi2_pvalue, exact_joint, sample_pairs

    target, draft = family_dir(root, name), family_dir(root, name, seed=3, num_hidden_layers=2)
    llm = LLM(model=str(target), dtype="float32", progress=False, max_num_seqs=512,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    params = SamplingParams(temperature=6.0, top_k=8, max_tokens=3, ignore_eos=True)
    joint = exact_joint(llm, params)
    assert max(joint.values()) < 0.9
    assert llm.generate(PROMPT, params.replace(seed=0))[0].metrics.num_draft_tokens > 0
    assert chi2_pvalue(sample_pairs(llm, params), joint) > ALPHA


def test_trees_are_refused_and_a_prompt_in_flight_is_shared(root):
    path = family_dir(root, "lfm2")
    with pytest.raises(SpecdecError, match="chains of drafts, not token trees"):
        LLM(model=str(path), dtype="float32", progress=False,
            speculative_config={"method": "draft_model", "model": str(path), "tree_topk": 2})
    llm = LLM(model=str(path), dtype="float32", progress=False)
    assert llm.hybrid
    model = llm.target.model
    assert model.new_cache(1, 128).share_prefix(0, list(range(96)), 1) == 0  # no prefix cache
    with pytest.raises(ValueError, match="token trees are not supported"):
        model(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), model.new_cache(1, 8),
              attn_mask=torch.ones(1, 2, 2, dtype=torch.bool))
    # the same prompt twice in one batch: the second row maps the first's blocks and copies its rings
    # (prefilled once), and both give plain greedy's tokens
    calls = []
    real = llm.runner._prefill
    llm.runner._prefill = lambda *a, **k: calls.append(a[0]) or real(*a, **k)
    outs = llm.generate([PROMPTS[0]] * 3, GREEDY)
    llm.runner._prefill = real
    alone = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in outs] == [alone] * 3
    assert len(calls) == 1


def test_a_state_not_kept_is_an_error_not_a_wrong_token(root):
    """A block starting where the ring no longer holds the state before it raises."""
    cfg = family_config("qwen3_5")
    model = build_model(cfg, dtype=torch.float32)
    cache = model.new_cache(1, 64)
    with torch.no_grad():
        model(torch.ones(1, 30, dtype=torch.long), torch.arange(30)[None], cache)
        model(torch.ones(1, 1, dtype=torch.long), torch.tensor([[30]]), cache)  # the state after 29 is kept
        with pytest.raises(RuntimeError, match="is not kept"):
            model(torch.ones(1, 1, dtype=torch.long), torch.tensor([[5]]), cache)  # after 4: long overwritten


def test_state_memory_is_constant_in_context_and_counted(root):
    """The rings' bytes do not depend on the context; the KV blocks count attention layers only; the
    states of max_num_seqs sequences come out of the memory budget first."""
    cfg = family_config("qwen3_5")
    model = build_model(cfg, dtype=torch.float32)
    per_row = model.state_bytes()
    # three delta layers: (conv inputs of 2*32 + 64 values, fp32 states of 4 heads of 16 x 16) per entry
    assert per_row == 3 * model.state_slots * (128 * 4 + 4 * 16 * 16 * 4)
    short, long = model.new_cache(2, 64), model.new_cache(2, 4096)
    assert short.state_bytes() == long.state_bytes() == per_row
    assert model.block_bytes() == 2 * 1 * cfg.num_key_value_heads * 32 * cfg.head_dim * 4  # one attention layer
    path = family_dir(root, "qwen3_5")
    with pytest.raises(SpecdecError, match="recurrent states"):
        LLM(model=str(path), dtype="float32", progress=False, max_num_seqs=64, kv_cache_memory=64 * per_row // 2)


@pytest.mark.parametrize("name", HYBRIDS)
def test_config_round_trip(name):
    """``to_hf`` gives a config.json transformers reads back to the same ModelConfig."""
    from specdec.config import ModelConfig

    cfg = family_config(name)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_a_multimodal_qwen3_5_checkpoint_loads_its_language_model(tmp_path):
    """Qwen3.5 ships as Qwen3_5ForConditionalGeneration (config nested in text_config, weights under
    model.language_model., a vision tower beside them): specdec reads the language model and gives
    transformers' text logits."""
    from family_util import _COMMON

    from conftest import make_tokenizer

    vocab = make_tokenizer(tmp_path)
    _, extra = HYBRID_CONFIGS["qwen3_5"]
    cfg = transformers.Qwen3_5Config(
        text_config={**_COMMON, **extra, "vocab_size": vocab},
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                           patch_size=4, temporal_patch_size=1, spatial_merge_size=1))
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape))
    hf.save_pretrained(tmp_path)
    config = load_model_config(tmp_path)
    assert config.architecture == "qwen3_5_text" and config.layer_mixers[-1] == "attention"
    ours = build_model(config, load_state_dict(tmp_path, torch.float32), dtype=torch.float32)
    tokens = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(input_ids=tokens).logits
        got = ours(tokens, torch.arange(24)[None], ours.new_cache(1, 32)).logits
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4
