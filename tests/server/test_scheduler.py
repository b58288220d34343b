"""The engine thread, request validation and per-request speculative options, without HTTP."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from conftest import make_model_dir
from fault_util import FaultyProposer
from specdec import LLM, SamplingParams
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, SpeculativeOptions,
                                     parse_request, sampling_params, speculative_cap)
from specdec.server.scheduler import Scheduler


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", progress=False,
               speculative_config={"method": "draft_model", "model": str(tiny_model_dir),
                                   "num_speculative_tokens": 4})


def test_scheduler_streams_and_cancels(llm):
    metrics = ServerMetrics()
    sched = Scheduler(llm, metrics, max_batch_size=2, spec_max_batch=1)
    sched.start()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=("never",))

    async def run() -> tuple[list[str], list[str], str | None]:
        loop = asyncio.get_running_loop()
        seqs = [llm.make_sequence(p, params) for p in ("Hello", "The quick", "import os")]
        handle = sched.submit(seqs, loop)  # three choices, two rows: one waits
        texts = ["", "", ""]
        async for ev in handle.events():
            texts[ev.index] += ev.text
        long = sched.submit([llm.make_sequence("Hello", params.replace(max_tokens=200))], loop)
        async for _ in long.events():
            sched.cancel(long)  # after its first tokens
        return texts, [s.text for s in seqs], long.seqs[0].finish_reason

    try:
        texts, full, reason = asyncio.run(run())
    finally:
        sched.stop()
    assert texts == full and reason == "abort"
    assert [llm.generate(p, params)[0].outputs[0].text for p in ("Hello", "The quick", "import os")] == full
    assert metrics.registry.get_sample_value("specdec:num_requests_running") == 0 and not sched.engine.running


def test_parse_request_and_sampling_limits():
    req = parse_request(CompletionRequest, b'{"model": "m", "prompt": "hi", "max_tokens": 5, "stop": "x"}')
    sp = sampling_params(req, prompt_len=10, max_model_len=64, seed=3)
    assert (sp.max_tokens, sp.stop, sp.seed, sp.temperature) == (5, ("x",), 3, 1.0)
    chat = parse_request(ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
    assert sampling_params(chat, prompt_len=10, max_model_len=64, seed=None).max_tokens == 54
    for body, word in ((b'{"model": "m", "prompt": "hi", "x": 1, "y": 2}', "x, y"),
                       (b'{"model": "m", "prompt": "hi", "max_tokens": true}', "max_tokens"),
                       (b'{"model": "m", "prompt": "hi", "suffix": "x"}', "suffix")):
        with pytest.raises(APIError, match=word):
            parse_request(CompletionRequest, body)
    with pytest.raises(APIError, match="context length"):
        sampling_params(req, prompt_len=60, max_model_len=64, seed=None)


def test_speculative_cap():
    from specdec.proposers.registry import parse_config
    server = parse_config({"method": "draft_model", "model": "m", "num_speculative_tokens": 4})
    assert speculative_cap(None, server) is None
    assert speculative_cap(SpeculativeOptions(enabled=False), server) == 0
    assert speculative_cap(SpeculativeOptions(num_speculative_tokens=2), server) == 2
    assert speculative_cap(SpeculativeOptions(num_speculative_tokens=0), server) == 0
    assert speculative_cap(SpeculativeOptions(num_speculative_tokens=9), server) is None
    assert speculative_cap(SpeculativeOptions(enabled=True, method="draft_model"), server) is None
    with pytest.raises(APIError, match="ngram"):
        speculative_cap(SpeculativeOptions(method="ngram"), server)
    with pytest.raises(APIError, match="num_speculative_tokens"):
        speculative_cap(SpeculativeOptions(num_speculative_tokens=-1), server)
    with pytest.raises(APIError, match="draft_context"):  # not a per-request option
        speculative_cap(SpeculativeOptions(draft_context=4), server)
    assert speculative_cap(SpeculativeOptions(enabled=True), None) == 0

# ---- faults, overload, health ------------------------------------------------------------------
@pytest.fixture(scope="module")
def imperfect(tmp_path_factory, tiny_model_dir):
    """An LLM whose draft is another random model: most drafts are rejected, so the rejection path runs."""
    draft = make_model_dir(tmp_path_factory.mktemp("draft") / "model", seed=3, layers=1)
    return LLM(model=str(tiny_model_dir), dtype="float32", progress=False,
               speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})


@pytest.fixture
def faulty(imperfect):
    """``(llm, make)``: ``make(where)`` puts a FaultyProposer in front of the LLM's proposer (undone after)."""
    inner = imperfect.proposer

    def make(where: str) -> FaultyProposer:
        imperfect.proposer = FaultyProposer(inner, where)
        return imperfect.proposer

    yield imperfect, make
    imperfect.proposer = inner


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = ("Hello", "The quick", "import os")


async def collect(handle) -> tuple[list[str], list]:
    """Each choice's text and the error events of one request."""
    texts, errors = [""] * len(handle.seqs), []
    async for ev in handle.events():
        texts[ev.index] += ev.text
        if ev.error is not None:
            errors.append(ev)
    return texts, errors


def run_requests(sched: Scheduler, llm, prompts, params=GREEDY, before=None) -> list[tuple[list[str], list]]:
    """Submit one single-choice request per prompt at once; ``before(seqs)`` runs before they are submitted."""
    async def go():
        loop = asyncio.get_running_loop()
        seqs = [llm.make_sequence(p, params) for p in prompts]
        if before is not None:
            before(seqs)
        handles = [sched.submit([s], loop) for s in seqs]
        return await asyncio.gather(*[collect(h) for h in handles])
    return asyncio.run(go())


def plain(llm, prompts, params=GREEDY) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(list(prompts), params, num_speculative_tokens=0)]


@pytest.mark.parametrize("where", ["add", "propose"])
def test_a_request_whose_rows_raise_fails_alone(faulty, where):
    llm, make = faulty
    fault = make(where)
    sched = Scheduler(llm, ServerMetrics(), max_batch_size=4, spec_max_batch=4)
    sched.start()
    try:
        outs = run_requests(sched, llm, PROMPTS, before=lambda seqs: fault.bad.add(seqs[1].request_id))
        assert sched.health() == (True, "")
    finally:
        sched.stop()
    assert [len(e) for _, e in outs] == [0, 1, 0] and outs[1][1][0].status == 500 and "injected" in outs[1][1][0].error
    want = plain(llm, PROMPTS)
    assert outs[0][0] == [want[0]] and outs[2][0] == [want[2]]
    assert not sched.engine.running and not sched.engine.prefilling


def test_an_error_in_the_cancellation_path_does_not_stop_the_engine(faulty):
    llm, make = faulty
    fault = make("remove")
    sched = Scheduler(llm, ServerMetrics(), max_batch_size=4, spec_max_batch=4)
    sched.start()

    async def go():
        loop = asyncio.get_running_loop()
        doomed = llm.make_sequence("Hello", GREEDY.replace(max_tokens=200))
        fault.bad.add(doomed.request_id)
        cancelled = sched.submit([doomed], loop)
        other = sched.submit([llm.make_sequence(PROMPTS[1], GREEDY)], loop)
        reasons = []
        async for ev in cancelled.events():
            reasons.append(ev.finish_reason)
            sched.cancel(cancelled)  # after its first tokens: proposer.remove raises for it
        return reasons, await collect(other)

    try:
        reasons, (texts, errors) = asyncio.run(go())
        after = run_requests(sched, llm, PROMPTS[2:])  # the engine thread still serves
        assert sched.health() == (True, "")
    finally:
        sched.stop()
    assert reasons[-1] == "abort" and not errors and texts == [plain(llm, PROMPTS[1:2])[0]]
    assert after[0][0] == plain(llm, PROMPTS[2:]) and not after[0][1]


def test_an_error_of_the_engine_fails_what_is_in_flight_retryably_and_restarts(faulty):
    llm, make = faulty
    fault = make("propose")
    fault.everyone = True
    metrics = ServerMetrics()
    sched = Scheduler(llm, metrics, max_batch_size=4, spec_max_batch=4)
    sched.start()

    async def both_rows_in_one_step():  # two choices of one request are admitted together
        handle = sched.submit([llm.make_sequence(p, GREEDY) for p in PROMPTS[:2]], asyncio.get_running_loop())
        return await collect(handle)

    try:
        _, errors = asyncio.run(both_rows_in_one_step())
        fault.everyone = False
        after = run_requests(sched, llm, PROMPTS)
    finally:
        sched.stop()
    assert len(errors) == 1 and errors[0].status == 503 and "restarted" in errors[0].error
    assert metrics.registry.get_sample_value("specdec:engine_restarts_total") == 1
    assert [t[0] for t, _ in after] == plain(llm, PROMPTS) and not any(e for _, e in after)


def test_health_turns_unhealthy_while_the_engine_hangs_and_back(faulty):
    llm, make = faulty
    fault = make("propose")
    sched = Scheduler(llm, ServerMetrics(), max_batch_size=4, spec_max_batch=4, stale_after=0.3)
    sched.start()
    fault.hang.set()
    seen = []

    def watch() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and sched.health()[0]:
            time.sleep(0.05)
        seen.append(sched.health())
        fault.release.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        outs = run_requests(sched, llm, PROMPTS[:1])
        watcher.join()
        deadline = time.monotonic() + 10
        while not sched.health()[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        healthy_again = sched.health()
    finally:
        fault.release.set()
        sched.stop()
    assert seen[0][0] is False and "progress" in seen[0][1]
    assert healthy_again == (True, "") and outs[0][0] == plain(llm, PROMPTS[:1])


def test_a_full_waiting_queue_answers_429_with_retry_after(llm):
    sched = Scheduler(llm, ServerMetrics(), max_batch_size=1, spec_max_batch=1, max_waiting=2)  # not started

    async def go():
        loop = asyncio.get_running_loop()
        sched.submit([llm.make_sequence("Hi", GREEDY), llm.make_sequence("Hi", GREEDY)], loop)
        with pytest.raises(APIError) as e:
            sched.submit([llm.make_sequence("Hi", GREEDY)], loop)
        return e.value

    err = asyncio.run(go())
    sched.stop()
    assert err.status == 429 and err.headers["Retry-After"].isdigit() and "overloaded" in err.message
    with pytest.raises(APIError, match="shutting down"):
        asyncio.run(_submit_one(sched, llm))


async def _submit_one(sched, llm):
    sched.submit([llm.make_sequence("Hi", GREEDY)], asyncio.get_running_loop())


def test_a_request_past_its_deadline_gets_408(llm):
    from specdec.server.scheduler import RequestHandle

    async def go():
        handle = RequestHandle([llm.make_sequence("Hi", GREEDY)], asyncio.get_running_loop())
        with pytest.raises(APIError) as e:
            async for _ in handle.events(deadline=time.monotonic() + 0.01):
                pass
        return e.value

    err = asyncio.run(go())
    assert err.status == 408 and err.code == "request_timeout"


def test_a_row_plain_for_its_length_is_counted_and_said(tmp_path, monkeypatch):
    """Issue 58: a request whose context makes its block too dear (a stand-in cost curve: at any context
    bucket each token of a block costs 20 plain steps) decodes plainly beside a short one that drafts; the
    server counts those steps as specdec:spec_decode_off_steps{reason="length"} and the row's provenance
    says why, in words."""
    from family_util import family_dir
    from specdec.engine import budget

    path = family_dir(tmp_path, "qwen3", max_position_embeddings=4096)
    short = {1: 1.0, 2: 1.01, 4: 1.05, 8: 1.2}
    monkeypatch.setattr(budget, "verify_costs", lambda model, b, sizes=(), repeats=3, context=0:
                        {t: c + (20.0 * t if context else 0.0) for t, c in short.items()})
    llm = LLM(model=str(path), dtype="float32", progress=False, max_model_len=2048,
              speculative_config={"method": "draft_model", "model": str(path), "num_speculative_tokens": 3})
    metrics = ServerMetrics()
    sched = Scheduler(llm, metrics, max_batch_size=2, spec_max_batch=2)
    sched.start()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def run():
        loop = asyncio.get_running_loop()
        seqs = [llm.make_sequence([(7 * i) % 90 + 3 for i in range(1100)], params),
                llm.make_sequence([5, 6, 7, 8], params)]
        handle = sched.submit(seqs, loop)
        why = set()
        async for _ in handle.events():
            why.add(seqs[0].spec_off)
        return seqs, why

    try:
        seqs, why = asyncio.run(run())
    finally:
        sched.stop()
    assert seqs[0].num_draft == 0 and seqs[1].num_draft > 0
    assert any(w and "1100 tokens of context" in w for w in why), why
    assert metrics.registry.get_sample_value("specdec:spec_decode_off_steps_total", {"reason": "length"}) >= 1
