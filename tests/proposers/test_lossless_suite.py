"""The losslessness suite every registered method passes: greedy output identical to plain greedy
decoding for every draft length and batch size, adaptive or not (the sampled-distribution half is
tests/proposers/test_distribution.py)."""
from __future__ import annotations

import pytest

from conftest import CONSTRAINED_ONLY, EXTRA_TREES, SUITE_VARIANTS, make_pair, spec_method_config
from specdec import LLM, SamplingParams
from specdec.proposers.registry import METHODS as REGISTERED

METHODS = SUITE_VARIANTS + EXTRA_TREES
PROMPTS = ["def fibonacci(n): fibonacci(n): fibonacci(n):", "The quick brown fox The quick brown",
           "Hello", "import os\nimport os\nimport"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("suite"))


@pytest.fixture(scope="module")
def plain_outputs(dirs):
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False)
    return {n: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(n))] for n in (7, 40)}


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_every_registered_method_is_in_the_suite(dirs):
    for m in REGISTERED:
        assert m in SUITE_VARIANTS + CONSTRAINED_ONLY and spec_method_config(m, dirs[1])["method"] == m


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_greedy_equals_plain_for_every_k_and_batch(dirs, plain_outputs, method, adaptive):
    cfg = spec_method_config(method, dirs[1]) | {"num_speculative_tokens": 8, "adaptive": adaptive}
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False, speculative_config=cfg)
    drafted = 0
    for k in (1, 3, 5, 8):
        for batch in (1, 4):
            for n in (7, 40):
                outs = llm.generate(PROMPTS[:batch], greedy(n), num_speculative_tokens=k)
                assert [o.outputs[0].token_ids for o in outs] == plain_outputs[n][:batch], (k, batch, n)
                drafted += sum(o.metrics.num_draft_tokens for o in outs)
    assert drafted > 0


@pytest.fixture(scope="module")
def plain_quantized(dirs):
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False, quantization="int4")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(40))]


def quantized_drafts(cfg: dict) -> dict:
    """The same config with every draft model int8 (a quantized drafter for a quantized target)."""
    if cfg.get("method") == "draft_model":
        return cfg | {"quantization": "int8"}
    if "stages" in cfg:
        return cfg | {"stages": [quantized_drafts(s) for s in cfg["stages"]]}
    return cfg


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_plain_on_a_quantized_target(dirs, plain_quantized, plain_outputs, method):
    """Speculation is exact relative to the int4 target (native kernel or its PyTorch twin)."""
    assert plain_quantized != plain_outputs[40]  # quantization really changed the model
    cfg = quantized_drafts(spec_method_config(method, dirs[1])) | {"num_speculative_tokens": 8}
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False, quantization="int4", speculative_config=cfg)
    drafted = 0
    for k in (1, 3, 5, 8):
        for batch in (1, 4):
            outs = llm.generate(PROMPTS[:batch], greedy(40), num_speculative_tokens=k)
            assert [o.outputs[0].token_ids for o in outs] == plain_quantized[:batch], (k, batch)
            drafted += sum(o.metrics.num_draft_tokens for o in outs)
    assert drafted > 0


PENALIZED = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, presence_penalty=0.8,
                            frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={5: 3.0, 40: -2.0}),
             SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=2.0),
             SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),  # beside rows without any
             SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, frequency_penalty=-1.0,
                            logit_bias={7: 4.0})]


@pytest.fixture(scope="module")
def plain_penalized(dirs):
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False)
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PENALIZED)]
    unpenalized = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, [greedy(30)] * 4)]
    assert outs[0] != unpenalized[0] and outs[1] != unpenalized[1] and outs[2] == unpenalized[2]
    return outs


@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_penalties_and_bias_equals_plain(dirs, plain_penalized, method):
    """Penalties count the draft tokens before each verified position: still token-for-token plain."""
    cfg = spec_method_config(method, dirs[1]) | {"num_speculative_tokens": 5}
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False, speculative_config=cfg)
    drafted = accepted = 0
    for k in (1, 3, 5):
        outs = llm.generate(PROMPTS, PENALIZED, num_speculative_tokens=k)
        assert [o.outputs[0].token_ids for o in outs] == plain_penalized, k
        drafted += sum(o.metrics.num_draft_tokens for o in outs)
        accepted += sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted > 0 and accepted > 0
