"""Our prefill against llama.cpp's on the same GGUF file: for each length N, a prompt of exactly N tokens (text of
``long_prompts``' styles, cut to N) and one new token, prefix caching off, the best of ``--styles`` (one prompt
each, after a short warm-up), then llama-bench's ppN on the same file (2 threads, one run); prints tok/s and the
ratio per length.

    python -m specdec.tools.bench.prefill [--model M] [--lengths 512,2048] [--styles rag,code]
        [--llamacpp LLAMA_BIN_DIR] [--llama-args "--repack 0"]

The model loads as a user's would (a GGUF file or an embedded name: its own blocks). ``--llamacpp none`` times
ours alone. llama-bench is built by scripts/build_llamacpp.sh (its build/bin, /tmp/specdec-llamacpp/build/bin
by default); ``--llama-args`` adds its flags (``--repack 0`` where its repacked kernels crash, ``--no-warmup`` for
long lengths: it times a warm-up run first otherwise).
"""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from specdec.errors import SpecdecError


def ours(llm, length: int, styles: tuple[str, ...]) -> float:
    """Seconds of the fastest prefill of ``length`` tokens (one new token) over one prompt per style."""
    from specdec import SamplingParams  # noqa: PLC0415
    from specdec.tools.bench.long_prompts import long_prompt  # noqa: PLC0415

    params, best = SamplingParams(temperature=0.0, max_tokens=1), float("inf")
    for style in styles:
        bp = long_prompt(llm.tokenizer, style, length + 64)
        ids = llm.tokenizer.encode(bp.prompt or bp.turns[0])[:length]
        if len(ids) < length:
            raise SpecdecError(f"a {style} prompt of {length} tokens could not be made (got {len(ids)})")
        t = time.perf_counter()
        llm.generate([ids], params)
        best = min(best, time.perf_counter() - t)
    return best


def llama_pp(bench: Path, gguf: Path, length: int, extra: list[str]) -> float:
    """llama-bench's ppN (tok/s) on ``gguf``, 2 threads, one run."""
    out = subprocess.run([str(bench), "-m", str(gguf), "-t", "2", "-p", str(length), "-n", "0", "-r", "1", *extra],
                         capture_output=True, text=True)
    found = re.search(rf"pp{length}\s*\|\s*([\d.]+)", out.stdout)
    if out.returncode != 0 or not found:
        raise SpecdecError(f"llama-bench -p {length} failed (exit {out.returncode}): "
                           f"{(out.stderr or out.stdout).strip().splitlines()[-1:] or ['no output']}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> int:
    from specdec.tools.bench.long_context import parse_lengths, parse_styles  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m specdec.tools.bench.prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="an embedded name or a .gguf file")
    ap.add_argument("--lengths", default="512,2048", help="prompt lengths in tokens, comma-separated (256 or more)")
    ap.add_argument("--styles", default="rag,code", help="prompt styles of long_prompts, comma-separated")
    ap.add_argument("--llamacpp", default="/tmp/specdec-llamacpp/build/bin", help="llama-bench's directory, or none")
    ap.add_argument("--llama-args", default="", help="more llama-bench flags, e.g. \"--repack 0 --no-warmup\"")
    a = ap.parse_args(argv)
    try:
        lengths, styles = parse_lengths(a.lengths), parse_styles(a.styles)
        bench = None if a.llamacpp == "none" else Path(a.llamacpp) / "llama-bench"
        if bench is not None and not bench.is_file():
            raise SpecdecError(f"no llama-bench in {a.llamacpp}: build it (bash scripts/build_llamacpp.sh) or "
                               "pass --llamacpp none")
        from specdec import LLM, SamplingParams  # noqa: PLC0415
        from specdec.formats.hub import gguf_source  # noqa: PLC0415

        llm = LLM(model=a.model, progress=False, enable_prefix_caching=False, max_model_len=max(lengths) + 64)
        llm.generate([list(range(100, 164))], SamplingParams(temperature=0.0, max_tokens=1))  # warm
        print("| prompt tokens | ours tok/s (s) | llama.cpp ppN tok/s | ours / llama.cpp |\n|---|---|---|---|")
        gguf = None if bench is None else gguf_source(a.model, progress=False)
        for n in lengths:
            sec = ours(llm, n, styles)
            theirs = None if bench is None else llama_pp(bench, gguf, n, shlex.split(a.llama_args))
            ratio = f"{n / sec / theirs:.2f}x" if theirs else "-"
            print(f"| {n} | {n / sec:.1f} ({sec:.2f}) | {theirs if theirs else '-'} | {ratio} |", flush=True)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
