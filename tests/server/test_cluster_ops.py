"""Ray Serve operations, with Ray in the test process (a private instance on 127.0.0.1): a replica whose
engine thread dies is replaced while requests keep succeeding; autoscaling up under a burst and back
down after it; a request in flight when the application is deleted completes (graceful drain)."""
from __future__ import annotations

import concurrent.futures as cf
import os
import re
import socket
import threading
import time
import urllib.request

import pytest

from cluster_util import serve_args
from conftest import make_model_dir
from server_util import ROOT

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

# handles and replicas report their ongoing requests to the autoscaler every 0.5 s instead of 10 s
FAST_METRICS = {"RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5", "RAY_USAGE_STATS_ENABLED": "0"}
NO_SPEC = {"extra_body": {"speculative": {"enabled": False}, "ignore_eos": True}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("cluster-ops") / "model")


@pytest.fixture(scope="module")
def serve_url():
    """Ray (3 CPUs, on loopback) and Serve's proxy on a free port, both ended by their handles."""
    import faulty_engine
    from ray import serve

    ray.cloudpickle.register_pickle_by_value(faulty_engine)  # the replicas cannot import tests/
    env = FAST_METRICS | {"PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the Ray processes started now inherit it
    try:
        ray.init(num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
                 object_store_memory=100 * 2**20)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def deploy(monkeypatch):
    """``deploy(args)``: run the application (engine replicas: ``FaultyEngine``); deleted after the test."""
    from ray import serve

    from faulty_engine import FaultyEngine
    from specdec.server.cluster import app
    from specdec.server.cluster.app import APP_NAME

    monkeypatch.setattr(app, "Engine", FaultyEngine)
    yield lambda a: serve.run(app.application(a), name=APP_NAME, route_prefix="/")
    serve.delete(APP_NAME)


def _engine():
    from ray import serve

    from specdec.server.cluster.app import APP_NAME
    return serve.get_deployment_handle("SpecdecEngine", app_name=APP_NAME)


def _running() -> int:
    from ray import serve

    from specdec.server.cluster.app import APP_NAME
    return serve.status().applications[APP_NAME].deployments["SpecdecEngine"].replica_states.get("RUNNING", 0)


def _replica_ids() -> set[str]:
    """The live engine replicas' ids (their actors' names end with them)."""
    return {a["name"].rsplit("#", 1)[1] for a in ray.util.list_named_actors(all_namespaces=True)
            if "#SpecdecEngine#" in a["name"]}


def _wait(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.2)
    return time.monotonic() - t0


def test_a_replica_whose_engine_thread_died_is_replaced_and_no_request_fails(serve_url, model, deploy):
    deploy(serve_args(model, "--replicas", "2"))
    client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="none", max_retries=0, timeout=60)

    def one(i: int) -> tuple[str, float]:
        t0 = time.monotonic()
        answer = client.completions.create(model=str(model), prompt=f"{i} apples", max_tokens=24, **NO_SPEC)
        return answer.choices[0].text, time.monotonic() - t0

    before = _replica_ids()
    assert len(before) == 2
    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, i) for i in range(60)]  # no client retries: the ingress must save them
        while sum(f.done() for f in futures) < 6:
            time.sleep(0.02)
        killed = _engine().kill_engine_thread.remote().result()
        results = [f.result() for f in futures]
    assert killed in before and all(text for text, _ in results)
    # the watchdog: resent within a second or so, not after Serve's three failed health checks (15 s)
    assert max(t for _, t in results) < 10.0, sorted(t for _, t in results)[-5:]
    with urllib.request.urlopen(f"{serve_url}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    retried = re.search(r'^specdec:replica_retries_total\{replica="ingress"\} ([0-9.]+)$', metrics, re.M)
    assert float(retried.group(1)) > 0, "no request was in flight on the replica that died: the test proved nothing"
    replaced = _wait(lambda: len(_replica_ids() - before) == 1 and killed not in _replica_ids() and _running() == 2,
                     60, "the replica was not replaced")
    print(f"replica replaced {replaced:.1f} s after the requests ended")
    assert all(one(i)[0] for i in range(4))


def test_autoscaling_adds_a_replica_under_a_burst_and_removes_it_after(serve_url, model, deploy, monkeypatch):
    from specdec.server.cluster import app

    options = app.engine_options

    def quick(a):  # react within a second, scale down 3 s after the burst
        opts = options(a)
        opts["autoscaling_config"] |= {"upscale_delay_s": 0.5, "downscale_delay_s": 3.0, "metrics_interval_s": 0.5,
                                       "look_back_period_s": 1.0}
        return opts
    monkeypatch.setattr(app, "engine_options", quick)
    deploy(serve_args(model, "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "1"))
    assert _running() == 1
    client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="none", max_retries=2, timeout=60)
    stop, errors = threading.Event(), []

    def load(i: int) -> None:
        while not stop.is_set():
            try:
                client.completions.create(model=str(model), prompt=f"{i} pears", max_tokens=48, **NO_SPEC)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        up = _wait(lambda: _running() == 2, 90, "no second replica under the burst")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    down = _wait(lambda: _running() == 1 and len(_replica_ids()) == 1, 60, "not back to one replica")
    print(f"scaled up in {up:.1f} s, down in {down:.1f} s after the burst")


def test_a_request_in_flight_when_the_app_is_deleted_completes(serve_url, model, deploy):
    from ray import serve

    from specdec.server.cluster.app import APP_NAME

    deploy(serve_args(model, "--replicas", "1", "--drain-timeout", "30"))
    _engine().slow_steps.remote(0.03).result()  # 64 tokens, one per step: about 2 s
    client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="none", max_retries=0, timeout=60)
    stream = client.completions.create(model=str(model), prompt="drain me", max_tokens=64, stream=True, **NO_SPEC)
    chunks = iter(stream)
    first = next(chunks)
    deleted = threading.Thread(target=serve.delete, args=(APP_NAME,))
    t0 = time.monotonic()
    deleted.start()
    rest = list(chunks)
    streamed = time.monotonic() - t0
    deleted.join(60)
    assert not deleted.is_alive()
    assert rest and rest[-1].choices[0].finish_reason == "length"
    assert first.choices[0].text + "".join(c.choices[0].text for c in rest)
    assert streamed > 0.5, "the stream ended before the delete reached the replica: the test proved nothing"
    assert APP_NAME not in serve.status().applications
