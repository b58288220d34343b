"""Greedy acceptance computed from the target's outputs equals what the engine counts."""
import pytest
import torch

from conftest import make_pair
from specdec import LLM, SamplingParams
from specdec.metrics import aggregate
from specdec.formats.loader import LoadedModel
from specdec.train.acceptance import Acceptance, measure


def test_the_walk_keeps_leading_matches_and_adds_the_targets_token():
    acc = Acceptance(k=3)
    # step 1 drafts O[0..2]: O[0], O[1] match, O[2] not -> 2 kept + O[2]; step 2 drafts O[3..5]:
    # O[3] wrong -> 0 kept + O[3]; step 3 drafts O[4..6]: all match -> 3 kept + O[7]; step 4 at 8
    # emitted: room 10 - 8 = 2 -> one draft, O[8] kept + O[9]
    acc.add([True, True, False, False, True, True, True, True, True, True], max_tokens=10)
    assert (acc.steps, acc.drafted, acc.accepted, acc.generated) == (4, 10, 6, 10)
    assert acc.drafted_by_position == [4, 3, 3] and acc.accepted_by_position == [3, 2, 1]
    assert acc.mean_accepted_length == pytest.approx(10 / 4)


def test_an_output_that_stops_early_ends_the_walk():
    acc = Acceptance(k=4)
    acc.add([True, True, True], max_tokens=50)  # EOS is the third token: one step keeps all three
    assert (acc.steps, acc.drafted, acc.accepted) == (1, 4, 3)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("acc"))


@pytest.mark.parametrize("k,draft", [(1, "d"), (5, "d"), (3, "t")])
def test_computed_acceptance_equals_the_engines_counters(pair, k, draft):
    t, d = pair
    d = t if draft == "t" else d  # the target drafting for itself: every token kept
    prompts = ["The quick brown fox", "def fibonacci(n):", "Hello world! a b a b"]
    plain = LLM(model=str(t), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = plain.generate(prompts, params, num_speculative_tokens=0)
    acc = measure(LoadedModel(str(d), torch.float32, torch.device("cpu"), progress=False),
                  [(o.prompt_token_ids, o.outputs[0].token_ids, 24) for o in outs], k)
    spec = LLM(model=str(t), dtype="float32", speculative_config={
        "method": "draft_model", "model": str(d), "num_speculative_tokens": k})
    m = aggregate([spec.generate(p, params)[0] for p in prompts])
    assert (acc.drafted, acc.accepted, acc.steps) == (m.num_draft_tokens, m.num_accepted_tokens, m.num_steps)
    if draft == "t":
        assert acc.accepted == acc.drafted > 0
