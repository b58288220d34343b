"""Paged KV cache measurements: server memory, time to first token with and without prefix caching,
decode speed against another checkout (the static cache on main).

    python -m specdec.tools.bench.paged --models smollm2-135m qwen2.5-coder-1.5b --ref /work/main \\
        --output results/paged.json

For each model: resident memory of `specdec serve` idle and at its peak under ``--concurrency``
requests (this checkout, and ``--ref``'s when given); time to first token of the 2nd and 10th turn
of a growing conversation and the mean over 20 requests on one document of ``--doc-tokens`` tokens,
prefix caching on and off; plain greedy decode tokens/s, this checkout and ``--ref`` interleaved
(each run in a fresh process). Writes JSON and prints markdown. Not a test: numbers depend on the
machine (run it on a quiet one).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from specdec.tools.bench.load import Client
from specdec.tools.bench.soak import _free_port

WORDS = ("the cache keeps keys and values of every token so that a model reads its context once while it "
         "decodes new tokens one by one and each block of the pool holds thirty two slots").split()
HERE = str(Path(__file__).resolve().parents[3])

DECODE = """
import sys, time
from specdec import LLM, SamplingParams
llm = LLM(model=sys.argv[1], progress=False)
p = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[2]), ignore_eos=True)
llm.generate(["Write a Python function that sorts a list."], SamplingParams(max_tokens=8, temperature=0.0))
t = time.perf_counter()
out = llm.generate(["Write a Python function that sorts a list."], p)
print(len(out[0].outputs[0].token_ids) / (time.perf_counter() - t))
"""


def env_for(checkout: str) -> dict:
    """The environment of a process running ``checkout``'s code (run it with ``cwd=checkout`` too:
    ``python -m`` puts the working directory first on the path, ahead of PYTHONPATH)."""
    return os.environ | {"PYTHONPATH": checkout}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def serve_memory(model: str, checkout: str, concurrency: int, max_tokens: int, words: int) -> dict:
    """Idle and peak RSS (MiB) of a server started from ``checkout`` under ``concurrency`` requests."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--model", model, "--port", str(port),
                             "--log-level", "warning"], env=env_for(checkout), cwd=checkout)
    client = Client(f"http://127.0.0.1:{port}", None, 600)
    try:
        for _ in range(1200):
            if proc.poll() is not None:
                raise SystemExit(f"error: the server from {checkout} exited with {proc.returncode}")
            try:
                if client.get("/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        time.sleep(2)
        idle = rss_mib(proc.pid)
        body = {"model": model, "prompt": " ".join((WORDS * (words // len(WORDS) + 1))[:words]), "max_tokens": max_tokens, "temperature": 0.0}
        threads = [threading.Thread(target=client.post, args=("/v1/completions", body)) for _ in range(concurrency)]
        for t in threads:
            t.start()
        peak = idle
        while any(t.is_alive() for t in threads):
            peak = max(peak, rss_mib(proc.pid))
            time.sleep(0.2)
        return {"idle_mib": round(idle, 1), "peak_mib": round(peak, 1)}
    finally:
        proc.terminate()
        proc.wait(30)


def ttft(llm, prompt_ids: list[int]) -> float:
    from specdec import SamplingParams  # noqa: PLC0415
    t = time.perf_counter()
    llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=1))
    return time.perf_counter() - t


def prefix_ttfts(model: str, doc_tokens: int, turns: int, requests: int, turn_tokens: int) -> dict:
    """Seconds to the first token, prefix caching on and off: each turn of a growing conversation,
    and ``requests`` questions over one document."""
    from specdec import LLM, SamplingParams  # noqa: PLC0415
    out = {}
    for on in (True, False):
        llm = LLM(model=model, progress=False, enable_prefix_caching=on)
        tok = llm.tokenizer
        words = iter(WORDS * 10_000)
        text = lambda n: tok.encode(" ".join(next(words) for _ in range(n)))[:n]  # noqa: E731
        conv, per_turn = [], []
        for _ in range(turns):
            conv += text(turn_tokens)  # the user's new message
            per_turn.append(ttft(llm, conv))
            reply = llm.generate([conv], SamplingParams(temperature=0.0, max_tokens=turn_tokens // 2, ignore_eos=True))
            conv += reply[0].outputs[0].token_ids
        doc = text(doc_tokens)
        doc_times = [ttft(llm, doc + text(16)) for _ in range(requests)]
        out["on" if on else "off"] = {"turn_2_s": round(per_turn[1], 3), f"turn_{turns}_s": round(per_turn[-1], 3),
                                      "doc_first_s": round(doc_times[0], 3),
                                      "doc_mean_rest_s": round(statistics.mean(doc_times[1:]), 3)}
        del llm
    return out


def decode_speed(model: str, checkouts: list[str], tokens: int, repeats: int) -> dict:
    """Median plain decode tokens/s of each checkout, runs interleaved, each in a fresh process."""
    runs: dict[str, list[float]] = {c: [] for c in checkouts}
    for _ in range(repeats):
        for c in checkouts:
            res = subprocess.run([sys.executable, "-c", DECODE, model, str(tokens)], env=env_for(c), cwd=c,
                                 capture_output=True, text=True, check=True)
            runs[c].append(float(res.stdout.strip().splitlines()[-1]))
    return {c: round(statistics.median(v), 2) for c, v in runs.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.bench.paged", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    p.add_argument("--ref", default=None, help="another checkout to compare with (e.g. /work/main: the static cache)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request under load")
    p.add_argument("--load-words", type=int, default=400, help="words of each request's prompt under load")
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--turn-tokens", type=int, default=150, help="tokens of each user message (replies: half)")
    p.add_argument("--requests", type=int, default=20, help="questions over the document")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default="results/paged.json")
    a = p.parse_args(argv)
    checkouts = [HERE] + ([a.ref] if a.ref else [])
    results = {}
    for m in a.models:
        r = results[m] = {"memory": {c: serve_memory(m, c, a.concurrency, a.max_tokens, a.load_words) for c in checkouts}}
        r["ttft"] = prefix_ttfts(m, a.doc_tokens, a.turns, a.requests, a.turn_tokens)
        r["decode_tok_s"] = decode_speed(m, checkouts, a.decode_tokens, a.repeats)
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    print("| model | checkout | RSS idle MiB | RSS peak MiB | decode tok/s |\n|---|---|---|---|---|")
    for m, r in results.items():
        for c in checkouts:
            mem = r["memory"][c]
            print(f"| {m} | {c} | {mem['idle_mib']} | {mem['peak_mib']} | {r['decode_tok_s'][c]} |")
    print(f"\n| model | prefix cache | turn 2 s | turn {a.turns} s | doc, 1st s | doc, others mean s |\n|---|---|---|---|---|---|")
    for m, r in results.items():
        for k, v in r["ttft"].items():
            print(f"| {m} | {k} | {v['turn_2_s']} | {v[f'turn_{a.turns}_s']} | {v['doc_first_s']} | {v['doc_mean_rest_s']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
