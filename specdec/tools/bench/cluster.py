"""Scaling out: the single-process server against 1, 2, 4 Ray Serve replicas under the same fixed load.

    python -m specdec.tools.bench.cluster --model smollm2-135m --replicas 0,1,2,4 --concurrency 1,16 \\
        --requests 96 --max-tokens 32 --out bench-cluster

``--replicas``: 0 is ``specdec serve`` alone, N > 0 is ``specdec serve --replicas N``; each starts on a
free loopback port with the same flags (``--max-batch-size``, ``--max-model-len``; each replica gets
``--replica-cpus``), gets the same requests at each ``--concurrency`` (the load test's mix, checked
against the single server's greedy answers: every answer must be identical), and is stopped. Bounded
by ``--requests`` per level and ``--time-limit`` seconds per level. Writes ``results.json`` and
``report.md`` (throughput, p50/p99 latency, and the proxy's cost: 1 replica vs the single server at
concurrency 1) in ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

from specdec.tools.bench.load import PROMPTS, Client, references, run_level


def start(replicas: int, a: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", a.model, "--port", str(port),
           "--max-batch-size", str(a.max_batch_size), "--max-model-len", str(a.max_model_len),
           "--drain-timeout", "2", "--log-level", "warning"]
    if replicas:
        cmd += ["--replicas", str(replicas), "--replica-cpus", str(a.replica_cpus)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "1"})
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if Client(url, None, 5).get("/health")[0] == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"error: the server with --replicas {replicas} did not come up; see {log}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def report(rows: list[dict]) -> str:
    lines = ["| server | concurrency | ok / sent | req/s | output tok/s | p50 latency (s) | p99 latency (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        name = "single process" if r["replicas"] == 0 else f"Ray Serve, {r['replicas']} replica(s)"
        lines.append(f"| {name} | {r['concurrency']} | {r['ok']} / {r['requests']} | {r['requests_per_second']:.2f} "
                     f"| {r['output_tokens_per_second']:.1f} | {r['latency_p50']:.3f} | {r['latency_p99']:.3f} |")
    at1 = {r["replicas"]: r for r in rows if r["concurrency"] == 1}
    if 0 in at1 and 1 in at1:
        cost = (at1[1]["latency_p50"] - at1[0]["latency_p50"]) * 1000
        lines += ["", f"Proxy cost (1 replica vs the single server, concurrency 1): {cost:+.1f} ms p50 latency."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.bench.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--replicas", default="0,1,2,4", help="0: the single-process server; N: N Ray replicas")
    p.add_argument("--concurrency", default="1,16", help="clients at once, each level in turn")
    p.add_argument("--requests", type=int, default=96, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per level; later requests are not sent")
    p.add_argument("--max-batch-size", type=int, default=8, help="per server / replica")
    p.add_argument("--max-model-len", type=int, default=512, help="per server / replica (bounds the KV cache)")
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--out", default="bench-cluster", help="directory for results.json and report.md")
    a = p.parse_args(argv)
    a.server_pid, a.settle = None, 0.0  # what run_level reads besides the above
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    jobs = [(rng.randrange(len(PROMPTS)), rng.random() < 0.5, rng.random() < 0.5) for _ in range(a.requests)]
    refs, rows = None, []
    for n in (int(x) for x in a.replicas.split(",")):
        proc, url = start(n, a, out / f"serve-{n}.log")
        try:
            client = Client(url, None, timeout=a.time_limit)
            refs = refs or references(client, a.model, jobs, a.max_tokens)  # the first server's answers
            for c in (int(x) for x in a.concurrency.split(",")):
                r = run_level(a, client, a.model, jobs, refs, c) | {"replicas": n}
                rows.append(r)
                print(f"replicas {n}, concurrency {c}: {r['ok']}/{r['requests']} ok, {r['requests_per_second']:.2f} "
                      f"req/s, p50 {r['latency_p50']:.3f} s, p99 {r['latency_p99']:.3f} s", flush=True)
        finally:
            stop(proc)
    (out / "results.json").write_text(json.dumps({"args": {k: v for k, v in vars(a).items()}, "rows": rows},
                                                 indent=1, default=str))
    (out / "report.md").write_text(report(rows))
    print(report(rows))
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
