"""Step accounting (``engine.accounting``): only tokens a sequence emitted count as accepted, in the
engine, the acceptance simulator and the replay tool alike."""
from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.policies import FixedK
from specdec.engine.step import StepOutput, accept
from specdec.metrics import sequence_metrics
from specdec.models.llama import ForwardOutput
from specdec.formats.loader import LoadedModel
from specdec.train.acceptance import measure


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    # the target drafting for itself: every draft token is accepted, so stops land inside drafts
    return LLM(model=str(tiny_model_dir), dtype="float32", progress=False,
               speculative_config={"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 4,
                                   "cost_aware": False})  # K = 4 every step, as the simulator walks it


def test_a_step_cut_by_max_tokens_counts_only_the_tokens_taken(llm):
    """A step whose 4 accepted drafts (+ the target's token) run past max_tokens = 2 counts 2 accepted
    tokens (positions 0 and 1), not 4, and 2 tokens per step, not 5. Would have caught issue 33,
    item 4: ``accept`` added the verifier's count before ``append`` cut the output, so
    acceptance_rate, mean_accepted_length and the server's num_accepted_tokens counted tokens never
    emitted."""
    seq = llm.make_sequence("Hello", greedy(2, ignore_eos=True))
    out = StepOutput(num_draft=[4], num_accepted=[4], emitted=[[5, 6, 7, 8, 9]], target_probs=None,
                     forward=ForwardOutput(logits=None), proposed=True, draft_seconds=0.0, verify_seconds=0.0)
    failed = accept([seq], out, None, FixedK(4))
    assert seq.output_ids == [5, 6] and seq.finish_reason == "length"
    assert (seq.num_steps, seq.num_draft, seq.num_accepted) == (1, 4, 2) and not failed
    assert (seq.drafted_at, seq.accepted_at) == ([1, 1, 1, 1], [1, 1, 0, 0])
    m = sequence_metrics(seq)
    assert (m.acceptance_rate, m.mean_accepted_length) == (0.5, 2.0)


def test_an_eos_inside_an_accepted_draft_counts_as_the_simulator_does(llm, tiny_model_dir):
    """EOS in the middle of a fully accepted draft: the engine's counters equal those of
    ``train.acceptance``'s walk over the emitted output (one accounting for both), and tokens per
    step is tokens emitted over steps. Would have caught issue 33, item 4: the engine counted the
    drafts after EOS as accepted."""
    prompt = "The quick brown"
    free = llm.generate(prompt, greedy(30, ignore_eos=True), num_speculative_tokens=0)[0].outputs[0].token_ids
    # an EOS first emitted mid-draft: not at the end of a 5-token step (4 drafts + the target's)
    at = next(i for i in range(5, 30) if free[i] not in free[:i] and i % 5 != 4)
    core = llm.engine()
    seq = llm.make_sequence(prompt, greedy(30))
    seq.eos_ids = frozenset({free[at]})
    core.reserve(1, core.slots_needed(seq))  # as ``LLM.run`` does (sizes the draft's cache too)
    core.add(seq)
    while core.has_work():
        core.step()
    assert seq.output_ids == free[:at + 1] and seq.finish_reason == "stop"
    walk = measure(LoadedModel(str(tiny_model_dir), torch.float32, torch.device("cpu"), progress=False),
                   [(seq.prompt_ids, seq.output_ids, 30)], 4)
    assert (seq.num_steps, seq.num_draft, seq.num_accepted) == (walk.steps, walk.drafted, walk.accepted)
    assert seq.accepted_at == walk.accepted_by_position and seq.drafted_at == walk.drafted_by_position
    assert seq.num_accepted == at + 1 - (seq.num_steps - 1)  # the last step emitted no token of the target's
    assert sequence_metrics(seq).mean_accepted_length == pytest.approx((at + 1) / seq.num_steps)
