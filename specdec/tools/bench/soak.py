"""Soak test of `specdec serve`: many requests, some cancelled mid-stream, some malformed.

    python -m specdec.tools.bench.soak --requests 10000 --concurrency 64 \\
        --serve "--model smollm2-135m --speculative-method ngram --num-speculative-tokens 4"
    python -m specdec.tools.bench.soak --url http://127.0.0.1:8000 --server-pid PID --requests 2000

``--requests`` requests run ``--concurrency`` at a time (completions and chat, streaming or not,
greedy and sampled); ``--cancel-fraction`` of them are streams the client hangs up on after the
first chunk, ``--malformed-fraction`` are bad requests (broken JSON, wrong types, unknown fields,
out-of-range values) that must get a 4xx. Reports: hangs (no answer within ``--timeout``), 5xx,
other failures (a well-formed request without a complete answer, a malformed one not answered
with a 4xx), answered / cancelled / rejected counts, and the server's resident memory averaged
over the first and the last thousand requests (``--window``). Afterwards the server must be idle
(nothing running or waiting). With ``--serve`` it starts the server itself on a free loopback
port and stops it with SIGTERM (which must exit 0). Loopback only; bounded by ``--requests`` and
``--time-limit``. Exit status 1 on any hang, 5xx or failure, or RSS growth above ``--max-rss-growth``.
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specdec.tools.bench.load import PROMPTS, Client, server_rss

MALFORMED = [
    b'{"model": "M", "prompt": ',
    b"[1, 2, 3]",
    b'{"model": "M", "prompt": "hi", "max_tokens": "ten"}',
    b'{"model": "M", "prompt": "hi", "temperature": -1}',
    b'{"model": "M", "prompt": "hi", "seed": 18446744073709551616}',
    b'{"model": "M", "prompt": "hi", "n": 0}',
    b'{"model": "M", "prompt": "hi", "unknown_field": 1}',
    b'{"model": "M", "prompt": [], "max_tokens": 4}',
    b'{"model": "M", "prompt": "hi", "max_tokens": 100000000}',
    b'{"model": "M", "messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"model": "M", "prompt": "hi", "top_p": 0}',
    b"\xff\xfe\x00",
]


@dataclass
class Tally:
    answered: int = 0
    cancelled: int = 0
    rejected: int = 0  # malformed requests answered with a 4xx (as they must be)
    overloaded: int = 0  # 429 / 503 with Retry-After: counted, not a failure
    hangs: int = 0
    server_errors: int = 0
    failures: list[str] = field(default_factory=list)
    rss: list[float] = field(default_factory=list)  # MiB after each request, in completion order
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, detail: str = "") -> None:
        with self.lock:
            if kind == "failure":
                self.failures.append(detail)
            else:
                setattr(self, kind, getattr(self, kind) + 1)


def _raw(host: str, port: int, path: str, body: bytes, headers: dict, timeout: float,
         hang_up: bool) -> tuple[int, bytes]:
    """One POST over a fresh socket; ``hang_up``: close after the first chunk of the body."""
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    req = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n{head}"
           "Connection: close\r\n\r\n").encode() + body
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(req)
        data = b""
        while b"\r\n\r\n" not in data:
            got = s.recv(65536)
            if not got:
                break
            data += got
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
        if hang_up and status == 200 and b"data: " not in data.split(b"\r\n\r\n", 1)[-1]:
            data += s.recv(65536)  # the first chunk, then hang up
        if hang_up:
            s.shutdown(socket.SHUT_RDWR)
            return status, data
        while True:
            got = s.recv(65536)
            if not got:
                return status, data
            data += got


def one(a: argparse.Namespace, client: Client, model: str, i: int, tally: Tally, pid: int | None) -> None:
    rng = random.Random(a.seed * 1_000_003 + i)
    r = rng.random()
    malformed = r < a.malformed_fraction
    cancel = not malformed and r < a.malformed_fraction + a.cancel_fraction
    chat = rng.random() < 0.5
    stream = cancel or rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if malformed:
        body = rng.choice(MALFORMED).replace(b'"M"', json.dumps(model).encode())
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    else:
        req: dict = {"model": model, "max_tokens": rng.randint(1, a.max_tokens), "stream": stream,
                     "temperature": rng.choice([0.0, 0.0, 0.7, 1.0]), "seed": rng.randrange(2**32)}
        prompt = rng.choice(PROMPTS)
        req |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        body = json.dumps(req).encode()
    try:
        status, data = _raw(client.host, client.port, path, body, client.headers, a.timeout, cancel)
    except (TimeoutError, socket.timeout):
        tally.add("hangs")
        return
    except OSError as e:
        tally.add("failure", f"request {i}: {type(e).__name__}: {e}")
        return
    finally:
        rss = server_rss(client, pid)
        with tally.lock:
            tally.rss.append(rss)
    text = data.decode("utf-8", "replace")
    if status >= 500 and status != 503:
        tally.add("server_errors")
        tally.add("failure", f"request {i}: HTTP {status}: {text[-300:]}")
    elif status in (429, 503):
        tally.add("overloaded")
    elif malformed:
        tally.add("rejected" if 400 <= status < 500 else "failure", f"malformed request {i} got {status}")
    elif cancel:
        tally.add("cancelled" if status == 200 else "failure", f"request {i}: HTTP {status}")
    elif status != 200:
        tally.add("failure", f"request {i}: HTTP {status}: {text[-300:]}")
    elif stream and ("data: [DONE]" not in text or '"finish_reason": "' not in text):
        tally.add("failure", f"stream {i} ended without a finish reason or [DONE]: {text[-300:]}")
    elif not stream and '"usage"' not in text:
        tally.add("failure", f"request {i}: incomplete answer: {text[-300:]}")
    else:
        tally.add("answered")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(serve_args: str, timeout: float) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--port", str(port), "--log-level", "warning",
           *shlex.split(serve_args)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    client = Client(url, None, 5)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited with {proc.returncode}")
        try:
            if client.get("/health")[0] == 200:
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("error: the server did not come up")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (loopback); else --serve starts one")
    p.add_argument("--serve", default=None, help="`specdec serve` arguments, quoted (starts the server)")
    p.add_argument("--server-pid", type=int, default=None, help="the server's pid, for its RSS")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--cancel-fraction", type=float, default=0.10)
    p.add_argument("--malformed-fraction", type=float, default=0.05)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds without an answer that count as a hang")
    p.add_argument("--time-limit", type=float, default=4 * 3600.0, help="stop submitting after this many seconds")
    p.add_argument("--window", type=int, default=1000, help="requests averaged for first / last RSS")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    if (a.url is None) == (a.serve is None):
        p.error("give exactly one of --url and --serve")
    proc = None
    if a.serve is not None:
        proc, url = launch(a.serve, 600.0)
        pid = proc.pid
    else:
        url, pid = a.url, a.server_pid
    client = Client(url, a.api_key, 30)
    model = json.loads(client.get("/v1/models")[1])["data"][0]["id"]
    tally, t0 = Tally(), time.monotonic()
    with ThreadPoolExecutor(a.concurrency) as pool:
        futures = []
        for i in range(a.requests):
            if time.monotonic() - t0 > a.time_limit:
                break
            futures.append(pool.submit(one, a, client, model, i, tally, pid))
        for f in futures:
            f.result()
    seconds = time.monotonic() - t0
    time.sleep(1.0)
    _, metrics = client.get("/metrics")
    idle = all(f"{name} 0.0" in metrics.decode() for name in ("specdec:num_requests_running",
                                                              "specdec:num_requests_waiting"))
    w = min(a.window, max(1, len(tally.rss) // 2))
    first, last = (sum(tally.rss[:w]) / w, sum(tally.rss[-w:]) / w) if tally.rss else (float("nan"),) * 2
    exit_status = None
    if proc is not None:
        proc.terminate()
        exit_status = proc.wait(120)
    report = {"requests": len(futures), "concurrency": a.concurrency, "seconds": round(seconds, 1),
              "answered": tally.answered, "cancelled": tally.cancelled, "malformed_rejected": tally.rejected,
              "overloaded": tally.overloaded, "hangs": tally.hangs, "server_errors": tally.server_errors,
              "failures": len(tally.failures), "idle_after": idle, "rss_first_mib": round(first, 1),
              "rss_last_mib": round(last, 1), "rss_growth": round(last / first - 1, 4) if first == first else None,
              "server_exit_status": exit_status}
    print(json.dumps(report, indent=2))
    for f in tally.failures[:10]:
        print("failure:", f, file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report | {"failure_examples": tally.failures[:50]}, f, indent=2)
    growth_ok = report["rss_growth"] is None or report["rss_growth"] <= a.max_rss_growth
    ok = not (tally.hangs or tally.server_errors or tally.failures) and idle and growth_ok and exit_status in (None, 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
