"""A step is atomic: it returns what it did and what failed, and never raises after changing state."""
from __future__ import annotations

import pytest

from fault_util import FaultyProposer
from specdec import LLM, SamplingParams
from specdec.engine.core import EngineCore
from specdec.engine.policies import FixedK


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


class Faults(FaultyProposer):
    """A ``FaultyProposer`` that raises in any of ``wheres`` ("add", "accept": after the inner
    proposer's ``on_accept`` ran, leaving its state half updated) for the rows of ``bad``."""

    def __init__(self, inner, *wheres: str) -> None:
        super().__init__(inner, "")
        self.wheres = set(wheres)

    def _check(self, where, seqs) -> None:
        if where in self.wheres and any(s.request_id in self.bad for s in seqs):
            raise RuntimeError(f"injected fault in {where}")

    def on_path(self, seqs, paths) -> None:
        self.inner.on_path(seqs, paths)

    def on_accept(self, seqs, num_accepted) -> None:
        self.inner.on_accept(seqs, num_accepted)
        self._check("accept", seqs)


def drive(core: EngineCore) -> tuple[list, list]:
    """Run ``core`` to the end as a driver does; every step's finished rows and failures, in order."""
    finished, failed = [], []
    while core.has_work():
        r = core.step()
        assert r.error is None
        finished += [s for s in r.stepped if s.finished]
        failed += [s for s, _ in r.failed]
    return finished, failed


def test_a_request_finishing_beside_a_failing_riding_prompt_is_reported(tiny_model_dir):
    """Prompt chunks ride in the decode forward (``max_prefill_tokens`` 24, bf16 chunks of 32); in
    the step where a long prompt's last chunk rides, a short request finishes and the proposer's
    ``add`` raises for the long one. The step reports both: the finished request in ``stepped``, the
    long one in ``failed``. Would have caught issue 33, item 3: ``_prefilled_to`` ran after
    ``_decode`` and raised ``RequestFailed``, so the finished request, already released by the
    core, was never returned: the server never sent its final event and leaked its ``_active``
    entry."""
    llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.runner.prefill_chunk = 32
    faulty = Faults(llm.proposer, "add")
    core = EngineCore(llm.runner, faulty, FixedK(3), max_num_seqs=4, max_prefill_tokens=24)
    calls = []
    prefill = llm.runner.prefill
    llm.runner.prefill = lambda row, ids, *a, **k: calls.append(len(ids)) or prefill(row, ids, *a, **k)
    long_ids = [(7 * i + 3) % 300 + 3 for i in range(33)]
    c = llm.make_sequence("Hello", greedy(30))
    core.add(c)
    assert not core.step().failed  # c prefilled alone (nothing to ride), then decodes
    a, b = llm.make_sequence("The quick", greedy(1)), llm.make_sequence(long_ids, greedy(8))
    faulty.bad.add(b.request_id)
    core.add(a)
    core.add(b)
    r = core.step()  # a's prompt rides c's step; b's 32 tokens do not fit beside it
    assert r.stepped == [c] and not r.failed
    r = core.step()  # b's 32 tokens ride: a finishes, b's ``add`` raises
    assert r.error is None and [s for s, _ in r.failed] == [b] and a in r.stepped and a.finished
    assert b.finish_reason == "abort" and 32 not in calls  # b's prompt rode the decode forward
    finished, failed = drive(core)
    llm.runner.prefill = prefill
    assert finished == [c] and not failed
    assert c.output_ids == llm.generate("Hello", greedy(30), num_speculative_tokens=0)[0].outputs[0].token_ids
    assert not core.running and not core.prefilling and core.num_free() == 4


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", progress=False,
               speculative_config={"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3})


@pytest.mark.parametrize("rebuild_fails", [False, True])
def test_a_proposer_raising_after_the_rows_took_their_tokens_loses_nothing(llm, rebuild_fails):
    """The proposer's ``on_accept`` raises (its state half updated) whenever one request is in the
    batch: the step still returns, every row keeps its verified tokens, and the proposer's state of
    the batch's rows is rebuilt (remove + add), so every output equals plain decoding's and every
    request is reported finished exactly once; where rebuilding that request raises too, it alone
    fails. Would have caught issue 33, item 3: ``accept`` appended the tokens, then the callback's
    error escaped the step with the batch changed (against the core's contract), finished rows still
    in the batch and nothing published."""
    faulty = Faults(llm.proposer, "accept", *(["add"] if rebuild_fails else []))
    core = EngineCore(llm.runner, faulty, FixedK(3), max_num_seqs=3)
    prompts, lengths = ["Hello", "The quick", "import os"], [9, 14, 20]
    seqs = [llm.make_sequence(p, greedy(n)) for p, n in zip(prompts, lengths)]
    core.reserve(3, max(core.slots_needed(s) for s in seqs))
    for s in seqs:
        core.add(s)
    core.step()  # admitted and added before the fault is armed
    faulty.bad.add(seqs[1].request_id)
    finished, failed = drive(core)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, [greedy(n) for n in lengths],
                                                         num_speculative_tokens=0)]
    if rebuild_fails:
        assert failed == [seqs[1]] and seqs[1].finish_reason == "abort"
        assert sorted(finished, key=seqs.index) == [seqs[0], seqs[2]]
        assert [seqs[0].output_ids, seqs[2].output_ids] == [want[0], want[2]]
    else:
        assert not failed and sorted(finished, key=seqs.index) == seqs and len(finished) == 3
        assert [s.output_ids for s in seqs] == want
    assert not core.running and llm.proposer.valid == {} and core.num_free() == 3
