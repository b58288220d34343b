"""The Ray-free parts of the cluster: route keys, rendezvous ranking, the metrics merge, the in-process
ASGI relay, and `specdec serve --replicas` without Ray installed."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server_util import ROOT
from specdec.server.cluster.metrics import MetricsBoard, merge_metrics
from specdec.server.cluster.relay import HTTPCall, call_asgi
from specdec.server.cluster.routing import ROUTE_KEY_CHARS, rank, route_key


def _chat(*messages) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}).encode()


def test_a_conversation_keeps_its_route_key_from_turn_to_turn():
    turn1 = _chat(("system", "be brief"), ("user", "hi"))
    turn2 = _chat(("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "and then?"))
    other = _chat(("system", "be brief"), ("user", "something else"))
    assert route_key("/v1/chat/completions", turn1) == route_key("/v1/chat/completions", turn2) is not None
    assert route_key("/v1/chat/completions", other) != route_key("/v1/chat/completions", turn1)
    parts = _chat(("user", [{"type": "text", "text": "hi"}]))
    assert route_key("/v1/chat/completions", parts) == route_key("/v1/chat/completions", _chat(("user", "hi")))


def test_completion_route_keys_and_bodies_without_one():
    long = "x" * 1000
    key = route_key("/v1/completions", json.dumps({"prompt": long + "a"}).encode())
    assert key == route_key("/v1/completions", json.dumps({"prompt": [long + "b", "z"]}).encode())
    assert len(key) == ROUTE_KEY_CHARS
    assert route_key("/v1/completions", json.dumps({"prompt": [1, 2, 3]}).encode()) == "[1, 2, 3]"
    for body in (b"not json", b"[1]", b"", json.dumps({"messages": ["x"]}).encode()):
        assert route_key("/v1/chat/completions", body) is None
    assert route_key("/v1/models", b"") is None


def test_rank_is_stable_and_spreads_keys():
    ids = [f"r{i}" for i in range(4)]
    firsts = {k: rank(k, ids)[0] for k in (f"conversation {i}" for i in range(400))}
    counts = [list(firsts.values()).count(r) for r in ids]
    assert min(counts) > 60, counts  # about 100 each
    # a replica leaves: only its keys move, and they move to their second choice
    for k, first in firsts.items():
        after = rank(k, ids[1:])[0]
        assert after == first if first != "r0" else after == rank(k, ids)[1]
    assert sorted(rank("k", ids)) == ids


def _registry_text(value: float) -> str:
    r = CollectorRegistry()
    Counter("specdec:http_requests", "requests", ["endpoint"], registry=r).labels(endpoint="/v1/x").inc(value)
    Histogram("specdec:lat", "latency", buckets=(1.0,), registry=r).observe(value)
    return generate_latest(r).decode()


def test_merge_labels_each_replica_and_keeps_families_whole():
    text = merge_metrics({"a": _registry_text(1), "b": _registry_text(3)}).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    reqs = {s.labels["replica"]: s.value for s in fams["specdec:http_requests"].samples if s.name.endswith("_total")}
    assert reqs == {"a": 1.0, "b": 3.0}
    sums = {s.labels["replica"]: s.value for s in fams["specdec:lat"].samples if s.name.endswith("_sum")}
    assert sums == {"a": 1.0, "b": 3.0}
    assert text.count("# TYPE specdec:lat histogram") == 1


def test_board_drops_replicas_that_stopped_pushing(monkeypatch):
    board = MetricsBoard(stale_after=5.0)
    now = [100.0]
    monkeypatch.setattr("specdec.server.cluster.metrics.time.monotonic", lambda: now[0])
    board.put("a", _registry_text(1))
    now[0] = 103.0
    board.put("b", _registry_text(2))
    assert board.replicas() == ["a", "b"]
    now[0] = 106.0
    assert board.replicas() == ["b"]
    assert 'replica="a"' not in board.merged().decode() and 'replica="ingress"' in board.merged(
        {"ingress": _registry_text(0)}).decode()


def _app(stopped: list):
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: dict):
        return {"got": body}

    @app.get("/stream")
    async def stream():
        async def parts():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                stopped.append(True)
        return StreamingResponse(parts(), media_type="text/event-stream")
    return app


def test_relay_passes_answers_through_and_stops_a_stream_nobody_reads():
    async def go():
        stopped: list = []
        app = _app(stopped)
        call = HTTPCall("POST", "/echo", headers=((b"content-type", b"application/json"),), body=b'{"a": 1}')
        msgs = [m async for m in call_asgi(app, call)]
        assert msgs[0]["status"] == 200 and json.loads(msgs[-1]["body"]) == {"got": {"a": 1}}
        bad = [m async for m in call_asgi(app, HTTPCall("POST", "/echo", body=b"{"))]
        assert bad[0]["status"] == 422
        gen = call_asgi(app, HTTPCall("GET", "/stream"))
        got = [await gen.__anext__() for _ in range(4)]
        assert got[0]["status"] == 200 and got[3]["body"] == b"data: 2\n\n" and got[3]["more_body"]
        await gen.aclose()  # the caller went away
        await asyncio.sleep(0.1)
        assert stopped == [True]
    asyncio.run(go())


def test_replicas_without_ray_is_a_clear_error(tmp_path):
    code = ("import sys; sys.modules['ray'] = None\n"
            "from specdec.cli import main\n"
            "sys.exit(main(['serve', '--model', 'nowhere', '--replicas', '2']))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "pip install 'specdec[cluster]'" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", "--model", "m", "--min-replicas", "3",
                        "--max-replicas", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--min-replicas (3) is above --max-replicas (2)" in p.stderr, p.stderr
