"""`specdec serve --replicas 2` on Ray Serve with the official openai client: the same answers as one
server, errors passed through, one /metrics for every replica. Skipped without Ray (specdec[cluster])."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Id:
    unique_id: str


class _FakeReplicas:
    """``engine.options(stream=True).forward.remote(...)`` over replicas in order of preference:
    the first not in ``avoid`` answers; ``sick`` ones answer 503 (their engine died) and name themselves."""

    def __init__(self, order: list[str], sick: set[str]) -> None:
        self.order, self.sick, self.calls = order, sick, []
        self.forward = SimpleNamespace(remote=self._remote)

    def options(self, **_):
        return self

    def _remote(self, call, route_key=None, avoid=()):
        name = next((r for r in self.order if r not in avoid), self.order[0])
        self.calls.append((name, tuple(avoid)))
        status, body = (503, b'{"error": {"code": "engine_dead"}}') if name in self.sick else (200, b'{"ok": 1}')

        return _Stream([{"type": "http.response.start", "status": status,
                         "headers": [(b"content-type", b"application/json"), (b"x-specdec-replica", name.encode())]},
                        {"type": "http.response.body", "body": body, "more_body": False}])


class _Stream:
    """A DeploymentResponseGenerator's surface: async iteration and ``cancel``."""

    def __init__(self, messages: list[dict]) -> None:
        self.messages = iter(messages)

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        try:
            return next(self.messages)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        pass


def test_a_503_is_resent_to_another_replica_never_the_same_one():
    """The ingress passes the replicas that answered 503 as ``avoid``; the router leaves them out while
    others remain (a conversation's first choice would otherwise take every retry: CI, round 3)."""
    from starlette.requests import Request

    from specdec.server.cluster.ingress import Ingress
    from specdec.server.cluster.router import PrefixAffinityRouter
    from specdec.server.cluster.routing import rank

    engine = _FakeReplicas(["a", "b", "c"], sick={"a", "b"})
    ingress = Ingress(engine, board=None, retries=3)

    async def receive():
        return {"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"", "headers": []}
    answer = asyncio.run(ingress(Request(scope, receive)))
    assert answer.status_code == 200 and json.loads(answer.body) == {"ok": 1}
    assert engine.calls == [("a", ()), ("b", ("a",)), ("c", ("a", "b"))]

    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # Serve builds it; only its state matters
    router.imbalance, router._replica_queue_len_cache = 4, {}
    replicas = [SimpleNamespace(replica_id=_Id(x)) for x in "pqrs"]
    key = "a conversation"
    first = rank(key, [x.replica_id.unique_id for x in replicas])[0]

    def chosen(avoid):
        ranks = asyncio.run(router.choose_replicas(replicas, SimpleNamespace(kwargs={"route_key": key, "avoid": avoid})))
        return [r.replica_id.unique_id for rank_ in ranks for r in rank_]
    assert chosen(())[0] == first
    for _ in range(20):
        assert first not in chosen((first,))
    assert set(chosen(tuple("pqrs"))) <= set("pqrs")  # every replica answered 503: any may take it again
