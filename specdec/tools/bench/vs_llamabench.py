"""Plain int4 decoding against llama.cpp's, alternated: llama-bench tg128 (2 threads, 2 repetitions) on
the GGUF file the model comes from, then our greedy decode of 129 tokens (EOS ignored) in one process,
N rounds; prints each round's tok/s and ratio, then the medians.

    python -m specdec.tools.bench.vs_llamabench [ROUNDS] [LLAMA_BIN_DIR]

llama-bench is built by scripts/build_llamacpp.sh (LLAMA_BIN_DIR: its build/bin, /tmp/specdec-llamacpp/build/bin
by default).
"""
import argparse
import re
import statistics as st
import subprocess
from pathlib import Path

from specdec import LLM, SamplingParams
from specdec.models.hub import gguf_source


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", type=int, nargs="?", default=4)
    ap.add_argument("bin_dir", type=Path, nargs="?", default=Path("/tmp/specdec-llamacpp/build/bin"),
                    help="where llama-bench is")
    a = ap.parse_args(argv)
    rounds = a.rounds
    bench = a.bin_dir / "llama-bench"
    gguf = gguf_source("qwen2.5-coder-1.5b", progress=False)
    llm = LLM("qwen2.5-coder-1.5b", quantization="int4", progress=False)
    sp = SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True)
    prompt = "Write a Python function that parses an ISO 8601 date string and returns a datetime object."
    llm.generate(prompt, sp)  # warm
    ours, theirs = [], []
    for i in range(rounds):
        out = subprocess.run([str(bench), "-m", str(gguf), "-t", "2", "-p", "0", "-n", "128", "-r", "2"],
                             capture_output=True, text=True, check=True).stdout
        tg = float(re.search(r"tg128\s*\|\s*([\d.]+)", out).group(1))
        m = llm.generate(prompt, sp)[0].metrics
        ours.append(m.decode_tokens_per_second)
        theirs.append(tg)
        print(f"round {i}: llama-bench tg128 {tg:.2f} tok/s, ours {ours[-1]:.2f} tok/s, ratio {ours[-1] / tg:.3f}", flush=True)
    print(f"median: ours {st.median(ours):.2f}, llama-bench {st.median(theirs):.2f}, ratio of medians "
          f"{st.median(ours) / st.median(theirs):.3f}, median of ratios {st.median(o / t for o, t in zip(ours, theirs)):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
