"""`specdec serve --replicas 2` on Ray Serve with the official openai client: the same answers as one
server, errors passed through, one /metrics for every replica. Skipped without Ray (specdec[cluster])."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from cluster_util import cluster_server, engine_replica_pids, serve_args
from conftest import make_model_dir
from server_util import ServerProcess

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Hello world!", "The capital of France"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("cluster") / "model")


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    srv = cluster_server(model, tmp_path_factory.mktemp("cluster"))
    yield srv
    srv.stop()


async def _replica(monkeypatch, model, name: str):
    """An engine replica built outside Ray (its replica context faked); it answers through ``forward``."""
    from specdec.server.cluster import replica

    monkeypatch.setattr(replica.serve, "get_replica_context",
                        lambda: SimpleNamespace(replica_id=SimpleNamespace(unique_id=name)))
    engine = replica.Engine.__new__(replica.Engine)
    await engine.__init__(serve_args(model))
    return engine


async def _complete(engine, model, prompt: str) -> list[dict]:
    from specdec.server.cluster.relay import HTTPCall

    body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": 3}).encode()
    call = HTTPCall("POST", "/v1/completions", headers=((b"content-type", b"application/json"),), body=body)
    return [m async for m in engine.forward(call)]


def test_a_replica_whose_engine_thread_died_fails_its_health_check_and_ends(model, monkeypatch):
    from faulty_engine import kill_engine_thread
    from specdec.server.cluster import replica

    exits: list[str] = []
    monkeypatch.setattr(replica, "exit_replica", exits.append)  # the real one ends the process

    async def go():
        drained = await _replica(monkeypatch, model, "drained")
        assert (await _complete(drained, model, "hello"))[0]["status"] == 200
        drained.check_health()
        await drained.__del__()  # a drain stops the engine thread: not a death
        await asyncio.sleep(3 * replica.ENGINE_WATCH_S)
        assert exits == []

        broken = await _replica(monkeypatch, model, "broken")
        try:
            broken.check_health()
            kill_engine_thread(broken.scheduler)
            deadline = time.monotonic() + 5
            while broken.scheduler.engine_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            with pytest.raises(RuntimeError, match="replica broken: the engine thread is not running"):
                broken.check_health()
            while not exits and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert exits == ["replica broken: the engine thread died"]
        finally:
            await broken.__del__()
    asyncio.run(go())


def _client(srv: ServerProcess):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=3, timeout=60)


def test_two_replicas_answer_like_one_server(cluster, model):
    single = ServerProcess(model, "--max-batch-size", "4", "--max-model-len", "256")
    try:
        one, two = _client(single), _client(cluster)
        for p in PROMPTS:
            want = one.completions.create(model=str(model), prompt=p, **GREEDY).choices[0].text
            assert two.completions.create(model=str(model), prompt=p, **GREEDY).choices[0].text == want
        msgs = [{"role": "user", "content": "Hello there"}]
        want = one.chat.completions.create(model=str(model), messages=msgs, **GREEDY).choices[0].message.content
        chunks = list(two.chat.completions.create(model=str(model), messages=msgs, stream=True, **GREEDY))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        single.stop()


def test_client_errors_stay_client_errors(cluster, model):
    status, body = cluster.request("POST", "/v1/completions", {"model": str(model), "prompt": "x", "bogus": 1})
    assert status == 400 and body["error"]["param"] == "bogus"
    status, body = cluster.request("POST", "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = cluster.request("POST", "/v1/completions", {"model": "other", "prompt": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_metrics_merge_every_replica(cluster, model):
    client = _client(cluster)
    for i in range(8):  # distinct conversations: the router spreads them over both replicas
        client.completions.create(model=str(model), prompt=f"{i} {PROMPTS[i % 4]}", max_tokens=2)
    assert len(engine_replica_pids(cluster)) == 2
    deadline = time.monotonic() + 15  # replicas push every 2 s
    while True:
        _, text = cluster.request("GET", "/metrics")
        replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                    if line.startswith("specdec:generation_tokens_total")}
        if len(replicas) == 2 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(replicas) == 2, text
    assert 'specdec:replica_retries_total{replica="ingress"} 0.0' in text
