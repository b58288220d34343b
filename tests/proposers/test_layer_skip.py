"""Layer selection for self-speculation (the search and its scoring, on synthetic acceptance), the
quantized self-draft, and bad configs."""
from __future__ import annotations

import pytest

from conftest import make_model_dir
from specdec import LLM, SamplingParams
from specdec.errors import SpecdecError
from specdec.quant.qlinear import QLinear
from specdec.proposers.layer_skip import LayerSearch, initial_skip_set


def test_initial_set_spreads_over_the_middle():
    s = initial_skip_set(28, 0.45)
    assert len(s) == 13 and min(s) >= 2 and max(s) <= 25
    assert initial_skip_set(6, 0.9) == frozenset({1, 2, 3, 4})
    assert initial_skip_set(3, 0.5) == frozenset({1})


def run_search(acceptance, n_layers=12, steps=400, seed=0):
    """Drive the search with a synthetic verifier: ``acceptance(skip)`` tokens accepted of 4 drafted."""
    s = LayerSearch(n_layers, ratio=0.4, trial_steps=4, search_steps=steps, seed=seed)
    for _ in range(steps + 8):
        acc = acceptance(s.skip_set())
        s.report([4, 4], [acc, acc])
    return s


def test_search_learns_to_keep_an_important_layer():
    # skipping layer 5 ruins the draft; every other skipped layer makes drafting cheaper
    important = 5
    s = run_search(lambda skip: 0 if important in skip else 4)
    assert important not in s.best.skip
    assert s.skip_set() == s.best.skip  # after the search the best set is used
    assert len(s.best.skip) >= 3


def test_search_trades_cost_against_acceptance():
    # acceptance falls as more layers are skipped: the optimum skips a middling number
    s = run_search(lambda skip: max(0, 4 - max(0, len(skip) - 3)), steps=600)
    assert 2 <= len(s.best.skip) <= 5, s.best.skip


def test_score_is_tokens_per_unit_cost():
    s = LayerSearch(10, ratio=0.5, trial_steps=100, search_steps=0)
    s.report([4], [3])  # 4 drafts with half the layers: cost 1 + 4 * 0.5 = 3, emitted 4
    assert abs(s.current.score() - 4 / 3) < 1e-9


def test_measured_seconds_are_the_cost_when_given():
    s = LayerSearch(10, ratio=0.5, trial_steps=100, search_steps=0)
    s.report([4], [3], seconds=0.5)
    s.report([2], [0], seconds=0.25)
    assert abs(s.current.score() - 5 / 0.75) < 1e-9


def test_a_quantized_drafter_may_skip_no_layer():
    assert initial_skip_set(28, 0.0) == frozenset()
    s = LayerSearch(12, ratio=0.0, trial_steps=1, search_steps=200, seed=1, min_skip=0)
    seen = set()
    for _ in range(200):
        seen.add(len(s.skip_set()))
        s.report([4], [4], seconds=0.1 + 0.01 * len(s.skip_set()))  # skipping only costs here
    assert 0 in seen and max(seen) >= 1 and s.best.skip == frozenset()
    s = LayerSearch(12, ratio=0.2, trial_steps=1, search_steps=200, seed=1)  # the default keeps >= 1
    for _ in range(200):
        assert len(s.skip_set()) >= 1
        s.report([4], [4], seconds=0.1 + 0.01 * len(s.skip_set()))


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("ls") / "deep", layers=4, hidden=64, seed=2)


def test_quantized_self_draft_uses_the_targets_own_weights_at_four_bits(deep):
    llm = LLM(model=str(deep), dtype="float32", progress=False,
              speculative_config={"method": "layer_skip", "quantization": "int4", "skip_ratio": 0.0,
                                  "search_steps": 0, "num_speculative_tokens": 4})
    prop = llm.proposer
    assert prop.model is not llm.target.model
    assert prop.model.embed_tokens is llm.target.model.embed_tokens  # shared, not copied
    assert all(isinstance(prop.model.layers[i].mlp.down_proj, QLinear) for i in range(4))
    assert prop.search.skip_set() == frozenset()
    p = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = llm.generate(["def f(x):", "Hello"], p, num_speculative_tokens=0)
    outs = llm.generate(["def f(x):", "Hello"], p)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    m = outs[0].metrics
    # a 4-bit copy of the same model agrees with it far more often than not
    assert m.num_accepted_tokens > 0.5 * m.num_draft_tokens > 0


@pytest.mark.parametrize("opts,match", [
    ({"skip_ratio": 0.0}, r"skip_ratio must be in \(0, 1\)"),
    ({"skip_ratio": 1.0, "quantization": "int4"}, r"skip_ratio of speculative method 'layer_skip' must be in \[0, 1\)"),
    ({"skip_layers": [0, 1, 2, 3]}, "leaving at least one layer"),
    ({"search_steps": -1}, "search_steps"),
    ({"draft_confidence_threshold": 1.5}, "draft_confidence_threshold"),
    ({"quantization": "int3"}, "quantization of speculative method 'layer_skip' must be one of int4, int8, gguf, got 'int3'"),
    ({"model": "x"}, r"unknown option\(s\) for speculative method 'layer_skip': model"),
    ({"lookahead": 2}, r"unknown option\(s\) for speculative method 'layer_skip': lookahead"),
])
def test_bad_layer_skip_config(deep, opts, match):
    with pytest.raises(SpecdecError, match=match):
        LLM(model=str(deep), dtype="float32", progress=False,
            speculative_config={"method": "layer_skip", "num_speculative_tokens": 3, **opts})


def test_quantization_is_refused_where_nothing_drafts_with_weights(deep):
    with pytest.raises(SpecdecError, match=r"unknown option\(s\) for speculative method 'ngram': quantization"):
        LLM(model=str(deep), dtype="float32", progress=False,
            speculative_config={"method": "ngram", "quantization": "int4"})
