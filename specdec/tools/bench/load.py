"""Load test of a running `specdec serve`: correctness under concurrency, throughput, latency, memory.

    python -m specdec.tools.bench.load --url http://127.0.0.1:8000 --requests 200 --concurrency 16 \\
        --stream-fraction 0.5 --max-tokens 64 [--server-pid PID] [--api-key KEY] [--json out.json]

First each prompt is sent alone (greedy, non-streaming) to get its reference answer; then
``--requests`` greedy requests (completions and chat, streaming or not) run ``--concurrency`` at a
time (a list such as ``1,2,4,8`` repeats them at each level), and every answer must be complete (a
finish reason, ``[DONE]`` for streams, usage counts) and equal to its reference. Reports requests/s,
output tokens/s, p50/p90/p99 of end-to-end latency and of time to first token (streaming requests),
and the server's RSS before, at its sampled peak and after (from /proc/PID/status with --server-pid,
else the /metrics gauge process_resident_memory_bytes). ``--speculation both`` runs each level with speculation off
(per request) and then on, and prints the speedup: the speculation break-even by batch size.
Loopback addresses only; bounded by --requests and --time-limit. Exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import random
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

PROMPTS = [
    "def fibonacci(n):",
    "Write a Python function that reverses a linked list.",
    "The capital of France is",
    "Explain speculative decoding in two sentences.",
    "import os\nfor name in os.listdir('.'):",
    "List three prime numbers and explain why they are prime.",
    "class Stack:\n    def __init__(self):",
    "What is the difference between a process and a thread?",
]


@dataclass
class Result:
    ok: bool
    error: str = ""
    latency: float = 0.0
    ttft: float | None = None  # streaming requests only: until the first text arrives
    tokens: int = 0


class Client:
    """Minimal blocking HTTP client (stdlib only) for one loopback server."""

    def __init__(self, url: str, api_key: str | None, timeout: float) -> None:
        u = urlparse(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        if not _is_loopback(self.host):
            raise SystemExit(f"error: {url} is not a loopback address: the load test only targets this machine")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("GET", path, headers=self.headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def post(self, path: str, body: dict) -> tuple[str, str | None, dict | None, float, bool]:
        """(text, finish_reason, usage, seconds to first text, saw [DONE]) of one choice."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        t0 = time.perf_counter()
        try:
            conn.request("POST", path, body=json.dumps(body), headers=self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            if not body.get("stream"):
                d = json.loads(resp.read())
                c = d["choices"][0]
                text = c["message"]["content"] if "message" in c else c["text"]
                return text, c["finish_reason"], d.get("usage"), time.perf_counter() - t0, True
            text, reason, use, ttft, done = "", None, None, 0.0, False
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                d = json.loads(line[6:])
                if "error" in d:
                    raise RuntimeError(f"stream error: {d['error']}")
                use = d.get("usage") or use
                for c in d["choices"]:
                    piece = (c["delta"].get("content") or "") if "delta" in c else c["text"]
                    if piece and not text:
                        ttft = time.perf_counter() - t0
                    text += piece
                    reason = c["finish_reason"] or reason
            return text, reason, use, ttft, done
        finally:
            conn.close()


def _is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
    except (socket.gaierror, ValueError):
        return False


def _request(model: str, prompt: str, chat: bool, stream: bool, max_tokens: int,
             plain: bool = False) -> tuple[str, dict]:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if plain:
        body["speculative"] = {"enabled": False}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", body | {"prompt": prompt}


def server_rss(client: Client, pid: int | None) -> float:
    """The server's resident memory in MiB (NaN if it cannot be read)."""
    try:
        if pid is not None:
            with open(f"/proc/{pid}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        _, text = client.get("/metrics")
        for line in text.decode().splitlines():
            if line.startswith("process_resident_memory_bytes "):
                return float(line.split()[1]) / 2**20
    except (OSError, StopIteration, ValueError):
        pass
    return float("nan")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def references(client: Client, model: str, jobs: list[tuple[int, bool, bool]], max_tokens: int) -> dict:
    """Each (prompt, chat) pair's greedy answer, sent alone."""
    refs = {}
    for pi, chat in sorted({(p, c) for p, c, _ in jobs}):
        text, reason, _, _, _ = client.post(*_request(model, PROMPTS[pi], chat, False, max_tokens))
        refs[pi, chat] = (text, reason)
    return refs


def run_level(a: argparse.Namespace, client: Client, model: str, jobs: list, refs: dict, concurrency: int,
              plain: bool = False) -> dict:
    """Send ``jobs`` ``concurrency`` at a time; check them; measure throughput, latency and RSS.

    ``plain``: each request turns speculation off for itself (``speculative.enabled = false``).
    """
    rss_before = server_rss(client, a.server_pid)
    peak, stop = [rss_before], threading.Event()

    def sample() -> None:
        while not stop.wait(0.25):
            peak.append(server_rss(client, a.server_pid))

    deadline = time.monotonic() + a.time_limit

    def one(job: tuple[int, bool, bool]) -> Result:
        pi, chat, stream = job
        if time.monotonic() > deadline:
            return Result(False, "not sent: --time-limit reached")
        t0 = time.perf_counter()
        try:
            text, reason, use, ttft, done = client.post(*_request(model, PROMPTS[pi], chat, stream, a.max_tokens,
                                                                  plain))
        except (OSError, RuntimeError, ValueError, KeyError) as e:
            return Result(False, f"{type(e).__name__}: {e}")
        latency = time.perf_counter() - t0
        problems = [p for p, bad in (("no [DONE]", not done), ("no finish_reason", reason is None),
                                     ("no usage", not use), ("text differs from the reference",
                                                              (text, reason) != refs[pi, chat])) if bad]
        return Result(not problems, "; ".join(problems), latency, ttft if stream else None,
                      (use or {}).get("completion_tokens", 0))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    time.sleep(a.settle)
    rss_after = server_rss(client, a.server_pid)
    good = [r for r in results if r.ok]
    lat, ttft = [r.latency for r in good], [r.ttft for r in good if r.ttft is not None]
    return {
        "concurrency": concurrency, "speculation": "off" if plain else "server", "requests": len(results),
        "ok": len(good), "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "seconds": wall, "requests_per_second": len(good) / wall,
        "output_tokens_per_second": sum(r.tokens for r in good) / wall,
        "latency_p50": percentile(lat, 50), "latency_p90": percentile(lat, 90), "latency_p99": percentile(lat, 99),
        "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "ttft_p99": percentile(ttft, 99),
        "mean_output_tokens": statistics.fmean(r.tokens for r in good) if good else 0.0,
        "rss_mib_before": rss_before, "rss_mib_peak": max(peak), "rss_mib_after": rss_after,
    }


def print_level(r: dict) -> None:
    print(f"concurrency {r['concurrency']}, speculation {r['speculation']}: {r['ok']}/{r['requests']} requests "
          f"complete and correct in {r['seconds']:.1f}s: {r['requests_per_second']:.2f} req/s, "
          f"{r['output_tokens_per_second']:.1f} output tok/s")
    print(f"  latency p50/p90/p99: {r['latency_p50']:.2f} / {r['latency_p90']:.2f} / {r['latency_p99']:.2f} s; "
          f"time to first token (streams): {r['ttft_p50']:.2f} / {r['ttft_p90']:.2f} / {r['ttft_p99']:.2f} s")
    print(f"  server RSS: {r['rss_mib_before']:.0f} MiB before, {r['rss_mib_peak']:.0f} peak, "
          f"{r['rss_mib_after']:.0f} after", flush=True)
    for e in r["errors"]:
        print(f"  failure: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=200, help="requests per concurrency level")
    p.add_argument("--concurrency", default="16", help="clients at once; a list (1,2,4,8) runs each in turn")
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument("--chat-fraction", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--speculation", choices=("server", "off", "both"), default="server",
                   help="server: as the server is configured; off: every request disables it; both: each "
                        "level runs off, then on, and reports the speedup (the spec break-even)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-pid", type=int, default=None, help="read RSS from /proc/PID/status")
    p.add_argument("--time-limit", type=float, default=1800.0, help="per level: send no request after this")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--settle", type=float, default=2.0, help="seconds to wait before the 'after' RSS")
    p.add_argument("--json", default=None, help="also write the report to this file")
    a = p.parse_args(argv)
    try:
        levels = [int(c) for c in a.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency takes integers separated by commas, got {a.concurrency!r}")
    if not (0 < a.requests <= 10000 and all(0 < c <= 256 for c in levels) and len(levels) <= 16):
        p.error("--requests must be in 1..10000 and --concurrency in 1..256 (at most 16 levels)")
    client = Client(a.url, a.api_key, a.request_timeout)
    model = a.model or json.loads(client.get("/v1/models")[1])["data"][0]["id"]
    rng = random.Random(a.seed)
    jobs = [(rng.randrange(len(PROMPTS)), rng.random() < a.chat_fraction, rng.random() < a.stream_fraction)
            for _ in range(a.requests)]
    refs = references(client, model, jobs, a.max_tokens)
    report = []
    for c in levels:
        for plain in {"server": [False], "off": [True], "both": [True, False]}[a.speculation]:
            report.append(run_level(a, client, model, jobs, refs, c, plain))
            print_level(report[-1])
        if a.speculation == "both":
            off, on = report[-2]["output_tokens_per_second"], report[-1]["output_tokens_per_second"]
            print(f"  speculation speedup at concurrency {c}: {on / off if off else float('nan'):.2f}x", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
