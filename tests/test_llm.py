"""The offline API on a tiny random-weight model: greedy exactness, batching, sampling, stops, errors."""
from __future__ import annotations

import pytest
import torch

from conftest import logits_of
from specdec import LLM, SamplingParams, SpecdecError


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", progress=False)


def reference_greedy(llm: LLM, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding by re-running the whole sequence each step: no cache, no batching."""
    model, ids = llm.target.model, list(prompt_ids)
    for _ in range(n):
        logits = logits_of(model, ids)
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nfor i in range(10):", "Hello"]


def test_greedy_matches_uncached_reference_and_batching_changes_nothing(llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    batch = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batch):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == reference_greedy(llm, ids, 24)
        alone = llm.generate(prompt, params)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)


def test_more_prompts_than_cache_rows_queue_and_finish(tiny_model_dir):
    small = LLM(model=str(tiny_model_dir), dtype="float32", max_num_seqs=2, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = small.generate(PROMPTS, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8] * 4
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == small.generate(p, params)[0].outputs[0].token_ids


def test_token_id_prompts(llm):
    ids = llm.tokenizer.encode("def fibonacci(n):")
    a = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=5))[0]
    b = llm.generate("def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt is None


def test_seeded_sampling_is_repeatable_and_independent_of_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=16, seed=123, ignore_eos=True)
    alone = llm.generate("Hello", p)[0].outputs[0].token_ids
    again = llm.generate("Hello", p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.7, max_tokens=10, seed=None)
    mixed = llm.generate(["The quick", "Hello", "import"], [others, p, others])[1].outputs[0].token_ids
    assert alone == again == mixed
    different = llm.generate("Hello", p.replace(seed=124))[0].outputs[0].token_ids
    assert different != alone


def test_stop_strings_truncate_text_and_end_the_request(llm):
    base = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    text = base[0].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate("The quick brown fox",
                       SamplingParams(temperature=0.0, max_tokens=30, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    assert len(out.token_ids) < 30


def test_eos_ends_generation_unless_ignored(llm):
    params = SamplingParams(temperature=0.0, max_tokens=10)
    free = llm.generate("Hello", params.replace(ignore_eos=True))[0].outputs[0].token_ids
    third = free[2]  # declare the third greedy token an end-of-sequence token
    saved = set(llm.tokenizer.eos_token_ids)
    llm.tokenizer.eos_token_ids.add(third)
    try:
        out = llm.generate("Hello", params)[0].outputs[0]
        cut = free.index(third) + 1
        assert out.token_ids == free[:cut] and out.finish_reason == "stop" and out.stop_reason == third
        out = llm.generate("Hello", params.replace(ignore_eos=True))[0].outputs[0]
        assert out.token_ids == free and out.finish_reason == "length"
    finally:
        llm.tokenizer.eos_token_ids.clear()
        llm.tokenizer.eos_token_ids.update(saved)


def test_context_limit_ends_generation(tiny_model_dir):
    small = LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=20, progress=False)
    ids = small.tokenizer.encode("def fibonacci(n):")
    out = small.generate("def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0]
    assert len(ids) + len(out.outputs[0].token_ids) == 20
    assert out.outputs[0].finish_reason == "length"


def test_chat_applies_the_template(llm):
    msgs = [{"role": "user", "content": "Hello"}]
    out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(msgs)
    with pytest.raises(SpecdecError, match="chat messages"):
        llm.chat([{"content": "no role"}])


def test_metrics_are_filled(llm):
    m = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].metrics
    assert m.num_generated_tokens == 12 and m.num_steps == 12 and m.mean_accepted_length == 1.0
    assert m.prefill_seconds > 0 and m.decode_seconds > 0 and m.tokens_per_second > 0


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -3}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"min_p": 1.5}, "min_p"), ({"stop": [""]}, "stop"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(SpecdecError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts(tiny_model_dir, llm):
    with pytest.raises(SpecdecError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(SpecdecError, match="outside the vocabulary"):
        llm.generate([[1, 10**7]], SamplingParams(max_tokens=2))
    small = LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=8, progress=False)
    with pytest.raises(SpecdecError, match="context is 8 tokens"):
        small.generate("The quick brown fox jumps over the lazy dog again and again", SamplingParams())


def test_bad_constructor_arguments(tiny_model_dir):
    with pytest.raises(SpecdecError, match="unknown dtype"):
        LLM(model=str(tiny_model_dir), dtype="float13", progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(SpecdecError, match="no CUDA"):
            LLM(model=str(tiny_model_dir), device="cuda", progress=False)
    with pytest.raises(SpecdecError, match="unknown model"):
        LLM(model="no-such-model-xyz", progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_greedy_matches_cpu(tiny_model_dir):
    gpu = LLM(model=str(tiny_model_dir), dtype="float32", device="cuda", progress=False)
    cpu = LLM(model=str(tiny_model_dir), dtype="float32", device="cpu", progress=False)
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, p)] == \
        [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, p)]


def test_the_tests_run_on_the_device_they_ask_for(llm):
    """SPECDEC_TEST_DEVICE (conftest) moves every LLM a test builds without naming a device."""
    from conftest import TEST_DEVICE
    assert llm.device.type == TEST_DEVICE
    assert {p.device.type for p in llm.target.model.parameters()} == {TEST_DEVICE}


def test_a_deployment_config_supplies_model_speculation_and_batch_cap(tiny_model_dir, tmp_path, llm):
    from specdec.deploy import DeploymentConfig
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    path = DeploymentConfig(model=str(tiny_model_dir), dtype="float32", speculative_config=ngram, spec_max_batch=1,
                            report={"note": "ignored"}).save(tmp_path)
    tuned = LLM(config=path, progress=False)
    assert tuned.dtype == torch.float32 and tuned.speculative_method == "ngram"
    assert tuned.num_speculative_tokens == 3 and tuned.spec_max_batch == 1 and tuned.max_prefill_tokens is None
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = "def f(x): return x def f(x): return x def f(x):"  # repeats: the n-gram lookup drafts
    alone = tuned.generate(prompt, params)[0]
    assert alone.metrics.num_draft_tokens > 0
    assert alone.outputs[0].token_ids == llm.generate(prompt, params)[0].outputs[0].token_ids
    batch = tuned.generate([prompt, "def fibonacci(n):"], params)  # 2 > spec_max_batch: plain decoding
    assert [o.metrics.num_draft_tokens for o in batch] == [0, 0]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids
                                                       for o in llm.generate([prompt, "def fibonacci(n):"], params)]
    # arguments win over the config's values; a DeploymentConfig object works as a path does
    other = LLM(config=DeploymentConfig.load(path), speculative_config=None, dtype="bfloat16", progress=False)
    assert other.dtype == torch.bfloat16 and other.speculative_method == "ngram"
    k2 = LLM(config=path, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, progress=False)
    assert k2.num_speculative_tokens == 2 and _load_cap(k2.engine(spec_max_batch=4).policy).spec_max_batch == 4
    assert _load_cap(k2.engine().policy).spec_max_batch == 1


def _load_cap(policy):
    """The LoadAwareK inside the engine's policy (the cost-aware policy wraps it)."""
    while not hasattr(policy, "spec_max_batch"):
        policy = policy.base
    return policy


def test_a_config_without_a_model_needs_the_model_argument(tiny_model_dir, tmp_path):
    from specdec.deploy import DeploymentConfig
    path = DeploymentConfig(dtype="float32").save(tmp_path / "c.json")
    with pytest.raises(SpecdecError, match="needs a model"):
        LLM(config=path, progress=False)
    with pytest.raises(SpecdecError, match="needs a model"):
        LLM(progress=False)
    assert LLM(str(tiny_model_dir), config=path, progress=False).dtype == torch.float32
    with pytest.raises(SpecdecError, match="not found"):
        LLM(str(tiny_model_dir), config=tmp_path / "missing.json", progress=False)


def test_each_speculative_config_keeps_its_own_draft_record(tmp_path):
    """Issue 59, item 7: an MoE target's cost-aware policy kept its record (acceptance so far, probe gap)
    by K alone, so a method switched to with ``set_speculative_config`` inherited another method's
    acceptance and probe gap. Keyed by the config (method and options) and K: the second method starts
    from a fresh record, and the first finds its own again."""
    from family_util import family_dir
    from specdec.engine.budget import DraftRecord

    path = family_dir(tmp_path, "olmoe", num_hidden_layers=2)
    llm = LLM(model=str(path), dtype="float32", progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.generate(["the cat sat on the mat the cat sat on the"],
                 SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    first = llm.engine().policy.record
    assert first != DraftRecord()  # what the n-gram drafts did
    llm.set_speculative_config({"method": "suffix", "num_speculative_tokens": 3})
    assert llm.engine().policy.record == DraftRecord()
    llm.set_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert llm.engine().policy.record is first


def test_vllm_prompt_dicts_are_accepted_alone_and_in_mixed_lists(llm):
    """Catches vLLM's prompt forms refused ("a prompt must be a string or a list of token ids"): a
    TokensPrompt ``{"prompt_token_ids": ids}`` and a TextPrompt ``{"prompt": text}``, alone or in a list
    mixed with strings and id lists, give the same tokens as the plain forms."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    text = "def fibonacci(n):"
    ids = llm.tokenizer.encode(text)
    want = llm.generate(text, params)[0].outputs[0].token_ids
    for single in ({"prompt_token_ids": ids}, {"prompt": text}, {"prompt_token_ids": tuple(ids)}):
        out = llm.generate(single, params)
        assert len(out) == 1 and out[0].outputs[0].token_ids == want and out[0].prompt_token_ids == ids
    mixed = llm.generate([{"prompt_token_ids": ids}, text, {"prompt": text}, ids], params)
    assert [o.outputs[0].token_ids for o in mixed] == [want] * 4
    assert [o.prompt for o in mixed] == [None, text, text, None]
    named = llm.generate({"prompt_token_ids": ids, "prompt": text}, params)[0]  # the text rides along
    assert named.prompt == text and named.prompt_token_ids == ids


@pytest.mark.parametrize("prompt,match", [
    ({}, "'prompt' .*or 'prompt_token_ids'"),
    ({"text": "Hello"}, "'prompt' .*or 'prompt_token_ids'"),
    ({"prompt": 3}, "'prompt' must be a string"),
    ({"prompt_token_ids": "Hello"}, "'prompt_token_ids' must be a list of token ids"),
    ({"prompt_token_ids": [1, "a"]}, "'prompt_token_ids' must be a list of token ids"),
    ({"prompt_token_ids": [1, 10**7]}, "outside the vocabulary"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 2], "multi_modal_data": {}}, "multi_modal_data"),
])
def test_bad_prompt_dicts_are_one_clear_error(llm, prompt, match):
    """A prompt dict with neither key, a bad value or a key specdec cannot honour: one SpecdecError."""
    with pytest.raises(SpecdecError, match=match):
        llm.generate([prompt], SamplingParams(max_tokens=2))
    with pytest.raises(SpecdecError, match=match):
        llm.generate(prompt, SamplingParams(max_tokens=2))


def test_a_tree_drafting_method_is_refused_on_a_hybrid_target_by_its_options_not_its_name(tmp_path):
    """Catches the refusal of trees keyed on the name "medusa": suffix decoding (always a token tree)
    slipped past it onto a hybrid target, and so would any new tree method. Whether a method drafts trees
    is its options' ``drafts_trees``."""
    from dataclasses import dataclass

    from family_util import family_dir
    from specdec.proposers.options import SpecOptions
    from specdec.proposers.registry import parse_config

    assert parse_config({"method": "suffix"}).drafts_trees and parse_config({"method": "medusa"}).drafts_trees
    assert parse_config({"method": "eagle", "tree_topk": 2}).drafts_trees
    assert not parse_config({"method": "eagle"}).drafts_trees and not parse_config({"method": "ngram"}).drafts_trees

    @dataclass(frozen=True)
    class NewTreeOptions(SpecOptions):
        method = "new_tree"

        @property
        def drafts_trees(self) -> bool:
            return True

    hybrid = LLM(model=str(family_dir(tmp_path, "lfm2")), dtype="float32", progress=False)
    for config in ({"method": "suffix"}, NewTreeOptions()):
        with pytest.raises(SpecdecError, match="chains of drafts, not token trees"):
            hybrid.set_speculative_config(config)
    assert hybrid.proposer is None
    hybrid.set_speculative_config({"method": "ngram"})  # a chain method is fine
