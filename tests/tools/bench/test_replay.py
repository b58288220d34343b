"""Replaying model-free drafters over recorded greedy outputs: the count of steps must be the one the
engine takes."""
from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.step import speculative_step
from specdec.proposers.base import Draft, Proposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.registry import parse_config
from specdec.runtime.sequence import Sequence
from specdec.tools.bench.replay import Recorded, replay
from tests.conftest import make_model_dir


class Fixed(Proposer):
    """Drafts the same tokens (a tree when ``parents`` is given) on every step."""

    def __init__(self, tokens: list[int], parents: list[int] | None = None) -> None:
        self.tokens, self.parents = tokens, parents

    def propose(self, seqs, ks):
        return Draft(torch.tensor([self.tokens]), torch.tensor([len(self.tokens)]),
                     parents=None if self.parents is None else torch.tensor([self.parents]))


def accepted(tokens: list[int], parents: list[int] | None, truth: list[int]) -> int:
    """What the engine's verifier keeps of one draft against the recorded target."""
    prompt = [1, 2, 3]
    seq = Sequence(request_id="r", prompt=None, prompt_ids=prompt, params=SamplingParams(temperature=0.0),
                   detokenizer=None, eos_ids=frozenset(), max_len=64, seed=0, row=0)
    target = Recorded(prompt + truth, 16)
    return speculative_step(target, Fixed(tokens, parents), [seq], [len(tokens)]).num_accepted[0]


def test_the_recorded_target_verifies_chains_and_trees_as_greedy_decoding_would():
    """The stand-in target scores each drafted path against the recording through the engine's own
    verifier (the replay had its own copy of greedy tree verification)."""
    assert accepted([5, 6, 7], None, [5, 6, 9, 1]) == 2
    assert accepted([5, 6, 7], None, [4, 1, 1, 1]) == 0
    # 5 -> 6 -> 7 and 5 -> 8 -> 9: the second branch matches
    assert accepted([5, 6, 8, 7, 9], [-1, 0, 0, 1, 2], [5, 8, 9, 3, 1, 1]) == 3
    # a child of a wrong node never counts, even if its token matches
    assert accepted([4, 8], [-1, 0], [5, 8, 1]) == 0


def test_replay_counts_a_copying_output():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    stats = replay(NgramProposer(1, 3), [(prompt, [1, 2, 3, 4, 5, 6, 7, 8, 9])], k=4)[0]
    # step 1: "8" never occurred before: no draft, keeps 1; step 2: "1" occurred at the start, drafts
    # 2 3 4 5, all kept, + 6; step 3: "4 5 6" drafts 7 8 (3 tokens of room left: 2 drafts and the
    # target's own), both kept, + 9
    assert (stats.tokens, stats.steps, stats.drafted, stats.accepted) == (9, 3, 6, 6)
    assert stats.tokens_per_step == 3.0 and stats.acceptance == 1.0


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("replay") / "t", layers=2, hidden=64)


PROMPTS = ["def fibonacci(n): fibonacci(n): fibonacci(n):", "The quick brown fox The quick brown",
           "def fibonacci(n): fibonacci(n):"]


@pytest.mark.parametrize("config", [{"method": "ngram", "prompt_lookup_max": 3},
                                    {"method": "suffix", "suffix_factor": 4.0, "suffix_min_prob": 0.0}])
def test_replay_takes_the_engines_steps(target, config):
    k = 4
    llm = LLM(model=str(target), dtype="float32", progress=False,
              speculative_config={**config, "num_speculative_tokens": k})
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reqs, steps, counts = [], [], []
    for text in PROMPTS:  # one at a time, as the bench runs them
        out = llm.generate([text], p)[0]
        reqs.append((out.prompt_token_ids, out.outputs[0].token_ids))
        steps.append(out.metrics.num_steps)
        counts.append((out.metrics.num_draft_tokens, out.metrics.num_accepted_tokens))
    assert sum(steps) < sum(len(o) for _, o in reqs)  # the drafter kept something
    got = replay(parse_config(config).build(None), reqs, k)
    assert [s.steps for s in got] == steps
    assert [s.tokens for s in got] == [len(o) for _, o in reqs]
    assert [(s.drafted, s.accepted) for s in got] == counts  # one accounting (engine.accounting)
