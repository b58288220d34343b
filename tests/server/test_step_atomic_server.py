"""The engine thread publishes every step whole: a request that finishes in a step where another
request fails still gets its final event."""
from __future__ import annotations

import asyncio

from specdec import LLM, SamplingParams
from specdec.server.metrics import ServerMetrics
from specdec.server.scheduler import Scheduler
from tests.engine.test_step_atomic import Faults


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_a_finished_request_gets_its_final_event_when_a_riding_prompt_fails(tiny_model_dir):
    """``--max-prefill-tokens 24`` (prompt chunks ride in the decode forward): beside a running
    stream, a short request (one token to generate) and a 33-token prompt whose ``add`` raises. The
    short one finishes in the very step whose riding chunk ends the long prompt: it must get its
    final event and the long one its error. Would have caught issue 33, item 3: the step raised
    after releasing the finished request, the scheduler returned without publishing it, and the
    request waited forever (its ``_active`` entry leaked)."""
    llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    llm.runner.prefill_chunk = 32
    llm.proposer = Faults(llm.proposer, "add")
    sched = Scheduler(llm, ServerMetrics(), max_batch_size=4, spec_max_batch=4, max_prefill_tokens=24)
    sched.start()

    async def go():
        loop = asyncio.get_running_loop()
        running = sched.submit([llm.make_sequence("Hello", greedy(60))], loop)
        events = running.events()
        await events.__anext__()  # it decodes: the next prompts' chunks ride its steps
        short = llm.make_sequence("The quick", greedy(1))
        long = llm.make_sequence([(7 * i + 3) % 300 + 3 for i in range(33)], greedy(8))
        llm.proposer.bad.add(long.request_id)
        handles = [sched.submit([short], loop), sched.submit([long], loop)]  # admitted together
        got = [[ev async for ev in h.events()] for h in handles]
        rest = [ev async for ev in events]
        return got, rest, short, long

    try:
        got, rest, short, long = asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        sched.stop()
    (short_ev, long_ev) = (evs[-1] for evs in got)
    assert short_ev.finish_reason == "length" and short_ev.error is None and len(short.output_ids) == 1
    assert long_ev.finish_reason == "abort" and "injected fault in add" in long_ev.error
    assert rest[-1].finish_reason == "length" and not sched._active and not sched.engine.running
