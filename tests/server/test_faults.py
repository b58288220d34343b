"""Fault injection into the server's engine: restarts that start afresh, an honest /health, no hangs.

Faults are injected into the objects a restart must replace (the target's KV cache, the drafter's
cache), at concurrency 1 (one request at a time: a broken engine fails them one by one) and 16 (a
whole batch fails at once), through the scheduler and through the ASGI app (/health, 503s).
"""
from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
from starlette.testclient import TestClient

from faulty_engine import kill_engine_thread
from specdec import LLM, SamplingParams
from specdec.server.app import ServerConfig, create_app
from specdec.server.metrics import ServerMetrics
from specdec.server.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", progress=False, max_model_len=128,
               speculative_config={"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3})


def corrupt(llm, sched: Scheduler, where: str) -> None:
    """Break the cache ``where`` names so that every write to it raises (its pool stays at one block)."""
    drafter = sched.engine.proposer.inner  # the draft model, behind the grammar-forced drafts' wrapper
    cache = llm.runner.cache if where == "target cache" else drafter.runner.cache
    cache.k, cache.v = cache.k[:, :1], cache.v[:, :1]


def prompts(n: int, tag: str) -> list[str]:
    return [f"{tag} request {i}:" for i in range(n)]


def run_round(sched: Scheduler, llm, texts: list[str]) -> list[tuple[str, int | None]]:
    """One request per prompt, all at once; each request's (text, error status or None)."""
    async def one(handle):
        text, status = "", None
        async for ev in handle.events(time.monotonic() + 60):
            text += ev.text
            status = ev.status if ev.error is not None else status
        return text, status

    async def go():
        loop = asyncio.get_running_loop()
        handles = [sched.submit([llm.make_sequence(p, GREEDY)], loop) for p in texts]
        return await asyncio.gather(*[one(h) for h in handles])
    return asyncio.run(go())


def plain(llm, texts: list[str]) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(texts, GREEDY, num_speculative_tokens=0)]


@pytest.mark.parametrize("where", ["target cache", "draft cache"])
@pytest.mark.parametrize("concurrency", [1, 16])
def test_a_broken_engine_restarts_with_a_new_cache_and_proposer(llm, concurrency, where):
    """Would have caught: at concurrency 1 a broken engine answered 500 forever (a restart needed every row
    of a step of several rows to fail), and a restart reused the runner, KV pool and proposer, so a
    corrupted cache failed every request after it too (at concurrency 16 as well)."""
    sched = Scheduler(llm, ServerMetrics(), max_batch_size=16, spec_max_batch=16)
    sched.start()
    old = (llm.runner, llm.runner.cache, sched.engine.proposer)
    corrupt(llm, sched, where)
    try:
        rounds = []
        for r in range(3):  # restart_after (2) failed requests in a row at most, or one failed batch
            texts = prompts(concurrency, f"broken {r}")
            rounds.append((texts, run_round(sched, llm, texts)))
            if sched.restarts:
                break
        restarts = sched.restarts
        after = run_round(sched, llm, prompts(concurrency, "after"))
        ok, why = sched.health()
    finally:
        sched.stop()
    assert restarts == 1, rounds
    # each request failed (500; 503 once the engine restarted) or, submitted after the restart, ran right
    for texts, out in rounds:
        want = plain(llm, texts)  # once the engine thread has stopped: the runner is the LLM's
        assert all(s in (500, 503) or (s is None and t == w) for (t, s), w in zip(out, want)), out
    assert sum(s is not None for _, out in rounds for _, s in out) >= 2
    assert llm.runner is not old[0] and llm.runner.cache is not old[1] and sched.engine.proposer is not old[2]
    assert [t for t, _ in after] == plain(llm, prompts(concurrency, "after")) and not any(s for _, s in after)
    assert ok, why


def test_health_counts_failures_and_a_failed_restart_answers_503_until_a_retry_succeeds(llm, monkeypatch):
    """Would have caught /health saying 200 while every request failed (it counted no failures), and a
    failed restart keeping the broken core (requests kept reaching it) instead of answering 503 with
    Retry-After and trying again."""
    sched = Scheduler(llm, ServerMetrics(), max_batch_size=4, spec_max_batch=4, restart_backoff=0.05)
    sched.start()
    reset, allowed = llm.reset_runtime, threading.Event()

    def failing_reset():
        if not allowed.is_set():
            raise MemoryError("injected: no memory for a new KV cache")
        reset()

    monkeypatch.setattr(llm, "reset_runtime", failing_reset)
    corrupt(llm, sched, "target cache")
    try:
        first = run_round(sched, llm, ["one"])
        report = sched.health_report()
        second = run_round(sched, llm, ["two"])  # the second failure in a row: a restart, which fails
        broken = sched.health_report()
        from specdec.server.protocol import APIError
        with pytest.raises(APIError) as refused:
            run_round(sched, llm, ["three"])
        allowed.set()  # the next retry succeeds
        deadline = time.monotonic() + 10
        while not sched.health()[0] and time.monotonic() < deadline:
            time.sleep(0.02)
        healed = sched.health_report()
        after = run_round(sched, llm, ["four"])
    finally:
        sched.stop()
    assert first[0][1] == 500 and second[0][1] == 503  # the second failure restarted the engine
    assert report == {"status": "ok", "consecutive_failures": 1, "restarts": 0}
    assert broken["status"] == "unhealthy" and "injected" in broken["reason"] and broken["consecutive_failures"] == 2
    assert refused.value.status == 503 and refused.value.headers["Retry-After"].isdigit()
    assert healed["status"] == "ok" and healed["restarts"] == 1
    assert after == [(plain(llm, ["four"])[0], None)]
    assert sched.health_report()["consecutive_failures"] == 0


def test_a_dead_engine_thread_ends_requests_in_flight_and_refuses_new_ones_with_503(llm):
    """Would have caught requests hanging on a dead engine thread in the single-process server: the one in
    flight waited for events that never came and ``submit`` queued new ones (only Ray replicas had a
    watchdog); here they would get the 408 of the 5 s timeout instead of a prompt 503."""
    config = ServerConfig(model_name="tiny", max_batch_size=4, request_timeout=5.0)
    app = create_app(llm, config)
    sched: Scheduler = app.state.scheduler
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "temperature": 0.0}
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        step = sched.engine.step
        sched.engine.step = lambda: (time.sleep(0.02), step())[1]  # the request stays in flight a while
        answer = []
        caller = threading.Thread(target=lambda: answer.append(client.post("/v1/completions", json=body)))
        caller.start()
        deadline = time.monotonic() + 10
        while not sched._active and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        kill_engine_thread(sched)
        caller.join(10)
        waited = time.monotonic() - t0
        health = client.get("/health")
        refused = client.post("/v1/completions", json=body)
    assert answer[0].status_code == 503 and waited < 3, (answer[0].text, waited)
    assert health.status_code == 503 and "not running" in health.json()["reason"]
    assert refused.status_code == 503 and refused.headers["Retry-After"].isdigit(), refused.text
    assert refused.json()["error"]["code"] == "engine_dead"


def test_requests_have_a_finite_timeout_by_default():
    """Would have caught the request timeout defaulting to None: with a stuck engine a request then waits
    forever. The default (600 s) is documented in `specdec serve --help`; 0 turns it off."""
    import argparse

    from specdec.server import DEFAULT_REQUEST_TIMEOUT, add_serve_parser

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_serve_parser(sub)
    assert 0 < DEFAULT_REQUEST_TIMEOUT < math.inf
    assert parser.parse_args(["serve", "--model", "m"]).request_timeout == DEFAULT_REQUEST_TIMEOUT
    assert ServerConfig(model_name="m").request_timeout == DEFAULT_REQUEST_TIMEOUT
    assert f"(default {DEFAULT_REQUEST_TIMEOUT:.0f}; 0: no limit)" in " ".join(sub.choices["serve"].format_help().split())
