"""One forward of T=1 on a random-weight slice of a public shape at several contexts, for an A/B of two source
trees: run it alternately with each tree first on the path, and compare the medians.

    git worktree add /tmp/old HEAD~1
    for i in 1 2 3; do PYTHONPATH=/tmp/old .venv/bin/python scripts/step_ab.py; \
                       PYTHONPATH=. .venv/bin/python scripts/step_ab.py; done

Prints the tree it imported specdec from and, per context, the median ms of ``--repeats`` forwards (the
context filled with random keys as ``specdec.tools.bench.step`` does).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec
from specdec.tools.bench.step import SHAPES, fill_context, random_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="gemma-3-4b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--quantization", choices=["int4", "int8", "none"], default="int4")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    model = random_model(a.shape, a.layers, None if a.quantization == "none" else a.quantization, native=True)
    out = [specdec.__file__.rsplit("/specdec/", 1)[0]]
    for ctx in (int(c) for c in a.contexts.split(",")):
        cache = model.new_cache(1, ctx + 64)
        toks = torch.randint(0, model.config.vocab_size, (1, ctx + 1), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            fill_context(model, cache, toks[:, :ctx])
            block, pos = toks[:, ctx:], torch.tensor([[ctx]])
            model(block, pos, cache)
            times = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                model(block, pos, cache)
                times.append(time.perf_counter() - t)
        out.append(f"context {ctx}: {statistics.median(times) * 1e3:.2f} ms")
        del cache
    print(" | ".join(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
