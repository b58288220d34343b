"""The prefill pacer: prompt tokens per step from measured step times, so that streams keep
1 / slowdown of their speed while a prompt is prefilled beside them."""
from __future__ import annotations

import pytest

from specdec.engine.pacing import PrefillPacer


def test_the_first_steps_measure_with_one_chunk_then_the_budget_fills_the_slack():
    p = PrefillPacer(slowdown=2.0, cap=512, quantum=16)
    assert p.budget(0) == 512  # nothing decodes: the cap
    assert p.budget(4) == 16  # nothing measured yet
    p.observe(4, 0.050, 0)  # a decode-only step: 50 ms
    assert p.budget(4) == 16  # the cost of a prompt token is still unknown
    p.observe(4, 0.066, 16)  # 16 riding tokens added 16 ms: 1 ms a token
    # slack: (2 - 1) x 50 ms = 50 ms = 50 tokens -> 48 (whole chunks)
    assert p.budget(4) == 48
    assert p.budget(2) == 16  # another batch size measures on its own


def test_the_budget_stays_within_one_chunk_and_the_cap():
    p = PrefillPacer(slowdown=1.5, cap=64, quantum=16)
    p.observe(1, 0.010, 0)
    p.observe(1, 1.010, 16)  # a token costs far more than the slack: still one chunk a step
    assert p.budget(1) == 16
    q = PrefillPacer(slowdown=3.0, cap=64, quantum=16)
    q.observe(1, 0.100, 0)
    q.observe(1, 0.1001, 32)  # nearly free tokens: the cap
    assert q.budget(1) == 64


def test_means_follow_the_measurements():
    p = PrefillPacer(slowdown=2.0, cap=4096, quantum=1)
    p.observe(2, 0.020, 0)
    p.observe(2, 0.021, 1)
    for _ in range(60):  # the model got slower per prompt token: the budget follows
        p.observe(2, 0.020, 0)
        p.observe(2, 0.020 + 0.004 * 10, 10)
    assert p.budget(2) == 5  # 20 ms slack / 4 ms a token


def test_every_eighth_paced_step_measures_the_decode_step_again():
    p = PrefillPacer(slowdown=2.0, cap=512, quantum=1)
    p.observe(4, 0.010, 0)
    p.observe(4, 0.020, 10)
    budgets = [p.budget(4) for _ in range(16)]
    assert budgets == [10] * 7 + [0] + [10] * 7 + [0]
    p.observe(4, 0.020, 0)  # the streams' contexts grew: a decode step now takes 20 ms
    assert p.decode_s[4] == pytest.approx(0.012)


@pytest.mark.parametrize("kw, match", [(dict(slowdown=1.0, cap=64, quantum=16), "must be > 1"),
                                       (dict(slowdown=2.0, cap=8, quantum=16), "at least one chunk")])
def test_bad_settings_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        PrefillPacer(**kw)


def test_the_engine_prefills_what_the_pacer_allows_beside_running_streams_and_changes_no_output(tmp_path):
    """Beside two decoding streams, each step prefills the pacer's budget of a long prompt (it rides the
    decode forward, cut at any token on the native path), the pacer learns the step times, and every
    output equals the one of a whole prefill."""
    from specdec import LLM, SamplingParams
    from test_core import long_context_model

    llm = LLM(model=long_context_model(tmp_path / "m"), dtype="bfloat16", progress=False, max_num_seqs=4)
    llm.runner.prefill_chunk = 32
    core = llm.engine(max_prefill_tokens=128, prefill_slowdown=2.0)
    assert core.pacer is not None and core.pacer.cap == 128 and core.pacer.quantum == 1  # native: any cut
    budgets = iter([5, 64, 27, 128, 1] + [128] * 20)
    asked: list[int] = []
    real = core.pacer.budget

    def budget(batch: int) -> int:
        asked.append(batch)
        real(batch)
        return next(budgets) if batch and core.prefilling else 128
    core.pacer.budget = budget
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 40, 4)]
    shorts = [llm.make_sequence(p, greedy[0]) for p in ("Hello", "import os")]
    for s in shorts:
        core.add(s)
    for _ in range(3):
        core.step()
    long_ids = [(7 * i + 3) % 390 + 3 for i in range(400)]
    long = llm.make_sequence(long_ids, greedy[2])
    core.add(long)
    done = []
    while not long.output_ids:
        core.step()
        done.append(core._prefilled.get(long.request_id, len(long_ids) - 1))
    # 5, 64, 27, 128, 1 tokens, then 128 a step, each time beside the two streams
    assert done[:5] == [5, 69, 96, 224, 225] and 2 in asked
    assert 2 in core.pacer.decode_s and 2 in core.pacer.token_s  # it measured this batch size
    while core.has_work():
        core.step()
    want = [o.outputs[0].token_ids for o in llm.generate(["Hello", "import os", long_ids], greedy)]
    assert [s.output_ids for s in (*shorts, long)] == want


def test_no_pacer_without_a_slowdown_or_a_budget(tiny_model_dir):
    from specdec import LLM

    llm = LLM(model=tiny_model_dir, progress=False)
    assert llm.engine(max_prefill_tokens=64).pacer is None
    assert llm.engine(prefill_slowdown=2.0).pacer is None  # whole prompts: nothing to pace
