"""A long-running server's memory follows its use, not its KV budget (issue 33, item 6)."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from conftest import make_model_dir
from server_util import ServerProcess

REQUESTS, FIRST, CLIENTS = 4000, 400, 16


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's RSS from /proc")
def test_rss_after_4000_short_requests_stays_within_10_percent_of_rss_after_400(tmp_path):
    """Would have caught the pool cycling through its blocks: each short request took a never-used block,
    so the server's RSS climbed by one block per request until the whole KV budget (2,081 blocks of
    64 KiB here: +130 MB) was resident; the soak of the issue saw 783 -> 3,699 MB on smollm2-135m."""
    model = make_model_dir(tmp_path / "model", layers=4, hidden=128)  # 64 KiB of keys and values per block
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 4096}))
    srv = ServerProcess(model, "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                        "--max-batch-size", str(CLIENTS), "--max-model-len", "4096", "--kv-cache-memory", "512MiB",
                        "--served-model-name", "tiny")
    done, lock, failures, rss = [0], threading.Lock(), [], {}

    def client(i: int) -> None:
        while True:
            with lock:
                if done[0] >= REQUESTS:
                    return
                done[0] += 1
                n = done[0]
            status, body = srv.request("POST", "/v1/completions", {
                "model": "tiny", "prompt": f"Request {n} of client {i}:", "max_tokens": 8, "ignore_eos": True,
                "temperature": 0.0})
            if status != 200:
                failures.append(body)
            with lock:
                if n in (FIRST, REQUESTS):
                    rss[n] = rss_mb(srv.proc.pid)

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rss["end"] = rss_mb(srv.proc.pid)
        blocks = srv.metric("specdec:kv_cache_blocks_free") + srv.metric("specdec:kv_cache_blocks_used")
    finally:
        srv.stop()
    print(f"server RSS (MB) after {FIRST} requests, {REQUESTS}, at the end: {rss}")  # docs/bench/server-memory.md
    assert not failures, failures[:3]
    assert blocks > 2000  # the budget: far more blocks than 400 requests touch
    assert rss["end"] <= 1.10 * rss[FIRST], rss
