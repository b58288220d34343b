"""Head-of-line blocking: how much a long prompt's prefill slows the streams already decoding.

    python -m specdec.tools.bench.hol --serve "--model smollm2-135m --max-prefill-tokens 512"
    python -m specdec.tools.bench.hol --serve "--model smollm2-135m --max-prefill-tokens 0"  # one-shot prefill

``--streams`` greedy streams (plain decoding, ``ignore_eos``: one token per chunk) start; once each has
run ``--warmup`` seconds, one request with a ``--long-tokens``-token prompt (max_tokens 1) arrives.
Per stream: the mean time between its chunks before the long request was sent (the baseline) and
while it was being served (its prefill window), and their ratio; the report gives the worst ratio
and the longest gap. A stream's own steps get slower as its context grows (on a CPU where attention
is costly, markedly over 1,500 tokens), which the ratio to the baseline counts as the long prompt's
doing; so the same streams then run again on the same server without the long prompt (``--control``,
on by default), and each stream's gaps over the same tokens give the second ratio, the long prompt's
own cost. Loopback only. Exit status 1 when a request fails.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time

from specdec.tools.bench.load import Client
from specdec.tools.bench.soak import launch

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def stream(client: Client, model: str, max_tokens: int, times: list[float], errors: list[str]) -> None:
    """One greedy stream; appends the arrival time of each chunk that carries text."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "speculative": {"enabled": False}}
    conn = http.client.HTTPConnection(client.host, client.port, timeout=client.timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers=client.headers)
        resp = conn.getresponse()
        if resp.status != 200:
            errors.append(f"stream: HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}")
            return
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                return
            if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    except OSError as e:
        errors.append(f"stream: {e}")
    finally:
        conn.close()


def long_prompt(n: int) -> list[int]:
    """``n`` token ids (a list prompt: its length is exact whatever the tokenizer; ids under 250 exist
    in every vocabulary)."""
    return [(i * 7919) % 200 + 50 for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.bench.hol", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", required=True, help="`specdec serve` arguments, quoted (the server is started here)")
    p.add_argument("--streams", type=int, default=4, help="streams decoding when the long prompt arrives (default 4)")
    p.add_argument("--long-tokens", type=int, default=3000, help="tokens of the long prompt (default 3000)")
    p.add_argument("--stream-tokens", type=int, default=400, help="tokens each stream generates (default 400)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of decoding before the long prompt (default 3)")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.add_argument("--no-control", dest="control", action="store_false",
                   help="skip the second run of the streams without the long prompt")
    a = p.parse_args(argv)
    proc, url = launch(a.serve, 600)
    try:
        client = Client(url, None, 600)
        model = json.loads(client.get("/v1/models")[1])["data"][0]["id"]
        client.post("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 4})  # warm up
        errors: list[str] = []
        times, sent, done = run_streams(client, model, a, errors, a.long_tokens)
        control = run_streams(client, model, a, errors, 0)[0] if a.control and not errors else None
    finally:
        proc.terminate()
        proc.wait(60)
    if errors:
        print("errors: " + "; ".join(errors), file=sys.stderr)
        return 1
    if any(t[-1] <= sent for t in times):
        print("error: a stream ended before the long prompt arrived: raise --stream-tokens or lower --warmup",
              file=sys.stderr)
        return 1
    rows = []
    for i, t in enumerate(times):
        gaps = [b - x for x, b in zip(t, t[1:])]
        before = [g for x, g in zip(t, gaps) if x < sent]
        window = [j for j, b in enumerate(t[1:]) if sent < b <= done + max(before)]  # chunks that waited on it
        during = [gaps[j] for j in window]
        base, slow = statistics.mean(before), statistics.mean(during) if during else float("nan")
        row = {"stream": i, "baseline_ms": round(base * 1e3, 2), "during_ms": round(slow * 1e3, 2),
               "ratio": round(slow / base, 2), "longest_gap_ms": round(max(during or [0]) * 1e3, 1),
               "chunks_during": len(during)}
        line = (f"stream {i}: {base * 1e3:7.1f} ms/token before, {slow * 1e3:7.1f} during the long prefill "
                f"(x{slow / base:.2f}, longest gap {max(during or [0]) * 1e3:.0f} ms, {len(during)} tokens)")
        if control is not None:
            cgaps = [b - x for x, b in zip(control[i], control[i][1:])]
            same = [cgaps[j] for j in window if j < len(cgaps)]
            alone = statistics.mean(same) if same else float("nan")
            row |= {"same_tokens_alone_ms": round(alone * 1e3, 2), "ratio_same_tokens": round(slow / alone, 2)}
            line += f"; the same tokens without it {alone * 1e3:.1f} (x{slow / alone:.2f})"
        rows.append(row)
        print(line)
    worst = max(r["ratio"] for r in rows)
    worst_same = max(r["ratio_same_tokens"] for r in rows) if control is not None else None
    print(f"long prompt ({a.long_tokens} tokens) served in {done - sent:.2f} s; worst slowdown x{worst:.2f}"
          + (f" against the baseline, x{worst_same:.2f} against the same tokens without it" if worst_same else ""))
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"serve": a.serve, "long_tokens": a.long_tokens, "long_seconds": round(done - sent, 3),
                       "streams": rows, "worst_ratio": worst, "worst_ratio_same_tokens": worst_same}, f, indent=2)
    return 0


def run_streams(client: Client, model: str, a, errors: list[str], long_tokens: int):
    """The streams, and once each has decoded ``a.warmup`` seconds a ``long_tokens`` prompt (none for 0):
    each stream's chunk arrival times, when the long request was sent and when it was answered."""
    times: list[list[float]] = [[] for _ in range(a.streams)]
    threads = [threading.Thread(target=stream, args=(client, model, a.stream_tokens, t, errors)) for t in times]
    for t in threads:
        t.start()
    while min(len(t) for t in times) < 2 or time.perf_counter() - min(t[0] for t in times) < a.warmup:
        time.sleep(0.05)
        if errors:
            break
    sent = done = time.perf_counter()
    if long_tokens:
        try:
            client.post("/v1/completions", {"model": model, "prompt": long_prompt(long_tokens), "max_tokens": 1})
        except RuntimeError as e:
            errors.append(f"long prompt: {e}")
        done = time.perf_counter()
    for t in threads:
        t.join()
    return times, sent, done


if __name__ == "__main__":
    sys.exit(main())
