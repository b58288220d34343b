"""Our decoding against llama.cpp's on the same GGUF file, alternated in one run: each round llama-bench tg128
(2 threads, 2 repetitions), then our greedy decode of 129 tokens (EOS ignored) of one prompt, and with
``--draft`` our speculative decoding of held-out code prompts (greedy, 128 tokens each) with its tokens
checked against plain decoding's; prints each round's tok/s and ratios, then the medians.

    python -m specdec.tools.bench.vs_llamabench [ROUNDS] [LLAMA_BIN_DIR] [--model M] [--quantization Q]
        [--draft D] [--draft-quantization Q] [--k K]

The model loads as a user's would: a GGUF file (or an embedded name) runs its own blocks unless
``--quantization int4`` (our min/max codes) or ``--dtype bfloat16`` asks otherwise. llama-bench is built by
scripts/build_llamacpp.sh (LLAMA_BIN_DIR: its build/bin, /tmp/specdec-llamacpp/build/bin by default).
"""
import argparse
import re
import statistics as st
import subprocess
import time
from pathlib import Path

from specdec import LLM, SamplingParams
from specdec.formats.hub import gguf_source

PROMPT = "Write a Python function that parses an ISO 8601 date string and returns a datetime object."
# held out: no tuning or test used these
CODE = ["Write a Python class implementing an LRU cache with get and put methods, with docstrings.",
        "Write a Python function that merges overlapping intervals in a list of (start, end) tuples.",
        "Implement binary search over a sorted list in Python, returning the insertion point.",
        "Write a Python function that tokenizes an arithmetic expression string into numbers and operators."]


def _decode(llm: LLM, prompt: str, n: int) -> tuple[list[int], float]:
    """Greedy tokens of ``prompt`` (``n``, EOS ignored) and their decode speed in tok/s."""
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
    return list(out.outputs[0].token_ids), out.metrics.decode_tokens_per_second


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", type=int, nargs="?", default=4)
    ap.add_argument("bin_dir", type=Path, nargs="?", default=Path("/tmp/specdec-llamacpp/build/bin"),
                    help="where llama-bench is")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="an embedded name or a .gguf file")
    ap.add_argument("--quantization", default=None, help="default: the file's own blocks")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--draft", default=None, help="a draft model (its default load) for speculative decoding")
    ap.add_argument("--draft-quantization", default=None, help="the draft's (default: its file's own blocks)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step with --draft")
    a = ap.parse_args(argv)
    bench = a.bin_dir / "llama-bench"
    gguf = gguf_source(a.model, progress=False)
    t0 = time.perf_counter()
    llm = LLM(a.model, quantization=a.quantization, dtype=a.dtype, progress=False)
    print(f"load: {time.perf_counter() - t0:.1f} s", flush=True)
    spec = None
    if a.draft:
        cfg = {"method": "draft_model", "model": a.draft, "num_speculative_tokens": a.k}
        if a.draft_quantization:
            cfg["quantization"] = a.draft_quantization
        spec = LLM(a.model, quantization=a.quantization, dtype=a.dtype, progress=False, speculative_config=cfg)
    _decode(llm, PROMPT, 129)  # warm
    ours, theirs, speedups, vs_llama, mismatches = [], [], [], [], 0
    for i in range(a.rounds):
        out = subprocess.run([str(bench), "-m", str(gguf), "-t", "2", "-p", "0", "-n", "128", "-r", "2"],
                             capture_output=True, text=True, check=True).stdout
        tg = float(re.search(r"tg128\s*\|\s*([\d.]+)", out).group(1))
        ours.append(_decode(llm, PROMPT, 129)[1])
        theirs.append(tg)
        line = f"round {i}: llama-bench tg128 {tg:.2f} tok/s, ours {ours[-1]:.2f} tok/s, ratio {ours[-1] / tg:.3f}"
        if spec is not None:
            plain_s = spec_s = 0.0
            tokens = 0
            for p in CODE:
                ids, rate = _decode(llm, p, 128)
                sids, srate = _decode(spec, p, 128)
                mismatches += ids != sids
                plain_s += len(ids) / rate
                spec_s += len(ids) / srate
                tokens += len(ids)
            speedups.append(plain_s / spec_s)
            vs_llama.append(tokens / spec_s / tg)
            line += (f"; code with {a.draft} K={a.k}: {tokens / spec_s:.2f} tok/s, {speedups[-1]:.2f}x our plain, "
                     f"{vs_llama[-1]:.2f}x llama.cpp's plain")
        print(line, flush=True)
    print(f"median: ours {st.median(ours):.2f}, llama-bench {st.median(theirs):.2f}, ratio of medians "
          f"{st.median(ours) / st.median(theirs):.3f}, median of ratios {st.median(o / t for o, t in zip(ours, theirs)):.3f}")
    if spec is not None:
        print(f"median speculative: {st.median(speedups):.2f}x our plain, {st.median(vs_llama):.2f}x llama.cpp's "
              f"plain; {mismatches} outputs differing from plain decoding's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
