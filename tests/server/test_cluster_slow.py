"""Slow Ray Serve runs on smollm2-135m: output identical to one server, and a replica killed during a
burst of 200 requests loses none that the client retries as the README documents."""
from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from cluster_util import cluster_server, kill_replica
from server_util import ServerProcess

pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.real]

MODEL = "smollm2-135m"
TIMEOUT = 60.0


def _client(srv: ServerProcess, retries: int = 5):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=retries, timeout=TIMEOUT)


def stream_with_retry(client, attempts: int = 5, **kw) -> str:
    """The README's retry for streams: an error event mid-stream (code replica_failed) -> resend."""
    for _ in range(attempts):
        try:
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
        except openai.APIError as e:
            if "replica" not in str(e):
                raise
    raise AssertionError("the stream failed every attempt")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    srv = cluster_server(MODEL, tmp_path_factory.mktemp("cluster"), "--max-batch-size", "8",
                         "--request-timeout", str(TIMEOUT))
    yield srv
    srv.stop()


def test_greedy_output_identical_to_one_server(cluster):
    kw = {"model": MODEL, "temperature": 0.0, "max_tokens": 16}
    single = ServerProcess(MODEL, "--max-batch-size", "4", "--max-model-len", "256")
    try:
        one, two = _client(single), _client(cluster)
        for p in ("The capital of France is", "def add(a, b):"):
            want = one.completions.create(prompt=p, **kw).choices[0].text
            assert two.completions.create(prompt=p, **kw).choices[0].text == want
        msgs = [{"role": "user", "content": "Name three colors."}]
        want = one.chat.completions.create(messages=msgs, **kw).choices[0].message.content
        assert stream_with_retry(two, messages=msgs, **kw) == want
    finally:
        single.stop()


def test_killing_a_replica_during_a_burst_loses_no_request(cluster):
    client = _client(cluster)

    def one(i: int) -> tuple[str, float]:
        t0 = time.monotonic()
        if i % 5 == 0:
            text = stream_with_retry(client, model=MODEL, messages=[{"role": "user", "content": f"Say {i}"}],
                                     max_tokens=6)
        else:
            text = client.completions.create(model=MODEL, prompt=f"Number {i} is", max_tokens=6).choices[0].text
        return text, time.monotonic() - t0

    with cf.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(200)]
        while sum(f.done() for f in futures) < 40:
            time.sleep(0.05)
        kill_replica(cluster)
        done, pending = cf.wait(futures, timeout=4 * TIMEOUT)
    assert not pending, "requests hung"
    results = [f.result() for f in futures]  # raises if one was lost
    assert all(text for text, _ in results)
    assert max(t for _, t in results) < 3 * TIMEOUT
    retried = cluster.metric("specdec:replica_retries_total", 'replica="ingress"')
    failed = sum(cluster.metric("specdec:replica_failures_total", f'replica="ingress",stage="{s}"')
                 for s in ("before_response", "streaming"))
    assert retried + failed > 0, "the kill hit no request in flight: the test proved nothing"
