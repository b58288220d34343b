"""Every family against transformers' own implementation of it, on the same random weights, and
speculation on every family token-identical to plain decoding.

The models are built by transformers' classes for each ``model_type`` (tests/family_util.py), saved with
``save_pretrained`` beside a real tokenizer, and loaded by specdec as a user's directory would be. The
prompts are longer than the models' sliding windows (16 positions), so windows are exercised.
"""
from __future__ import annotations

import pytest

from conftest import CORPUS
from family_util import FAMILY_CONFIGS, MOE_CONFIGS, assert_greedy_is_generate, family_dir, teacher_forced_error
from specdec import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
FAMILIES = list(FAMILY_CONFIGS) + list(MOE_CONFIGS)  # the mixture-of-experts families too
PROMPTS = [CORPUS[0] + CORPUS[2], CORPUS[1] + " " + CORPUS[3]]  # 40+ tokens each: past every window


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.mark.parametrize("name", FAMILIES)
def test_teacher_forced_logits_match_transformers(root, name):
    """fp32 logits of 40 positions (two rows) within 1e-4 of transformers', relative to their scale."""
    assert teacher_forced_error(family_dir(root, name)) < 1e-4


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_match_transformers_generate(root, name):
    """specdec's fp32 greedy tokens (through the LLM API, KV cache and all) equal transformers' generate."""
    assert_greedy_is_generate(family_dir(root, name), PROMPTS)


def _spec_configs(draft: str) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "self-int4": {"method": "layer_skip", "quantization": "int4", "skip_ratio": 0.0, "search_steps": 0,
                      "draft_confidence_threshold": 0.0},
        "tree": {"method": "draft_model", "model": draft, "tree_topk": 2, "tree_depth": 3},
    }


# MoE families: two in the default run (Qwen3-MoE's dense layer, gpt-oss's sinks and windows), the others
# in the slow stage (their native forward's exactness is checked in full by test_native_moe.py)
SPEC_FAMILIES = [n if n not in MOE_CONFIGS or n in ("qwen3_moe", "gpt_oss") else pytest.param(n, marks=pytest.mark.slow)
                 for n in FAMILIES]


@pytest.mark.parametrize("name", SPEC_FAMILIES)
def test_speculation_equals_plain_greedy_in_bf16_and_int4(root, name):
    """bf16 (the native path where the family runs there) and an int4 target: n-gram, the int4
    self-draft and a tree of a one-layer draft model of the same family give plain greedy's tokens,
    batch 2 (on the int4 target: n-gram)."""
    path, draft = family_dir(root, name), family_dir(root, name, seed=3, num_hidden_layers=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for quant in (None, "int4"):
        llm = LLM(model=str(path), dtype="bfloat16", progress=False, quantization=quant)
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        configs = _spec_configs(str(draft))
        for label in (configs if quant is None else ("ngram",)):
            spec = LLM(model=str(path), dtype="bfloat16", progress=False, quantization=quant,
                       speculative_config=configs[label] | {"num_speculative_tokens": 4})
            outs = spec.generate(PROMPTS, greedy)
            assert [o.outputs[0].token_ids for o in outs] == plain, (quant, label)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_speculative_samples_follow_the_target(root, name):
    """Sampled speculation keeps the target's exact law on a family's own layers: the first two tokens'
    joint law computed from the model, 3,000 seeded speculative samples against it (chi-square at
    ALPHA; tests/proposers/test_distribution.py's test, on Qwen3, Gemma 3 and Qwen3-MoE with a draft of
    their family)."""
    from proposers.test_distribution import ALPHA, PROMPT, chi2_pvalue, exact_joint, sample_pairs

    target, draft = family_dir(root, name), family_dir(root, name, seed=3, num_hidden_layers=1)
    llm = LLM(model=str(target), dtype="float32", progress=False, max_num_seqs=512,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    # these random models are peaked (their logits span tens): a high temperature spreads the law over
    # dozens of likely pairs, so a verifier leaking the draft's law would show
    params = SamplingParams(temperature=6.0, top_k=8, max_tokens=3, ignore_eos=True)
    joint = exact_joint(llm, params)
    assert max(joint.values()) < 0.9  # not one certain pair: the law has room to be wrong
    assert llm.generate(PROMPT, params.replace(seed=0))[0].metrics.num_draft_tokens > 0
    assert chi2_pvalue(sample_pairs(llm, params), joint) > ALPHA


@pytest.mark.parametrize("name,method", [("gemma3", "draft_model"), ("mistral", "ngram")])
def test_long_generations_free_the_windowed_keys_and_stay_exact(root, name, method, monkeypatch):
    """120 tokens past a 45-token prompt with windows of 16 (and a step back of one block allowed): the
    windowed layers' blocks behind the window are freed as the row moves on (a row's windowed blocks stay
    bounded), and the tokens still equal transformers' generate (fp32) and, with speculation, plain greedy
    decoding (bf16, the native path)."""
    from specdec.runtime import kv_cache

    monkeypatch.setattr(kv_cache, "WINDOW_SLACK", kv_cache.KV_BLOCK)
    peak = {}
    write = kv_cache.KVCache.prepare_writes

    def counting(self, rows, cache_pos, since=None):
        write(self, rows, cache_pos, since)
        if self.window:
            peak[id(self)] = max(peak.get(id(self), 0), self.pool.num_used)

    monkeypatch.setattr(kv_cache.KVCache, "prepare_writes", counting)
    path = family_dir(root, name)
    assert_greedy_is_generate(path, PROMPTS[:1], n=120)
    # one row: the blocks of a window, a block of slack and the blocks being written, not the 160 positions'
    assert peak and max(peak.values()) <= kv_cache.blocks_for(16 + kv_cache.KV_BLOCK) + 1 < kv_cache.blocks_for(160)
    greedy = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    plain = LLM(model=str(path), dtype="bfloat16", progress=False).generate(PROMPTS, greedy)
    config = ({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram"
              else {"method": "draft_model", "model": str(family_dir(root, name, seed=3, num_hidden_layers=1))})
    spec = LLM(model=str(path), dtype="bfloat16", progress=False,
               speculative_config=config | {"num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy)] == [o.outputs[0].token_ids for o in plain]


def test_a_windowed_draft_models_big_tree_keeps_the_keys_it_steps_back_to(root, caplog):
    """Issue 59 (4): a windowed draft model growing a 16 x 16 tree writes its nodes up to 240 slots past the pending
    token, further than a windowed group keeps behind a row (``WINDOW_SLACK``, 128): the keys its window reads at the
    tree's root were freed, so moving the kept path back there raised (the proposer's state rebuilt, the draft row
    prefilled again, every step). Now nothing raises or is rebuilt, and the tokens equal plain greedy decoding."""
    path = family_dir(root, "gemma3")
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(path), dtype="bfloat16", progress=False).generate(PROMPTS, greedy)
    config = {"method": "draft_model", "model": str(family_dir(root, "gemma3", seed=3, num_hidden_layers=1)),
              "num_speculative_tokens": 32, "tree_topk": 16, "tree_depth": 16}
    spec = LLM(model=str(path), dtype="bfloat16", progress=False, speculative_config=config)
    with caplog.at_level("ERROR"):
        got = spec.generate(PROMPTS, greedy)
    assert not [r for r in caplog.records if "rebuilding" in r.getMessage()]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.num_draft_tokens for o in got) > 0
