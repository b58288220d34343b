"""Cost of one forward of T rows against the context length (verification at long contexts).

    python scripts/context_cost.py [--model qwen2.5-coder-1.5b] [--quantization int4] \
        [--contexts 64,512,2048,8192,16384] [--rows 1,4]

Times a forward of T tokens at positions P..P+T-1 over a cache of P slots that are not prefilled (the
values do not change the work: timing only), median of 5 after a warm-up; no 16k prefill needed.
"""
from __future__ import annotations

import argparse
import time

import torch

from specdec import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--contexts", default="64,512,2048,8192,16384")
    ap.add_argument("--rows", default="1,4")
    a = ap.parse_args()
    contexts = [int(x) for x in a.contexts.split(",")]
    rows = [int(x) for x in a.rows.split(",")]
    llm = LLM(model=a.model, quantization=a.quantization, progress=False, max_num_seqs=1,
              max_model_len=max(contexts) + max(rows) + 64)
    model = llm.runner.model
    cache = model.new_cache(1, max(contexts) + max(rows) + 32)
    print("| context | " + " | ".join(f"{t} row(s)" for t in rows) + " |")
    print("|---|" + "---|" * len(rows))
    with torch.inference_mode():
        for ctx in contexts:
            cells = []
            for t in rows:
                toks, pos = torch.zeros(1, t, dtype=torch.long), torch.arange(ctx, ctx + t)[None]
                ts = []
                for _ in range(6):
                    t0 = time.perf_counter()
                    model(toks, pos, cache)
                    ts.append(time.perf_counter() - t0)
                cells.append(f"{1000 * sorted(ts[1:])[2]:.1f} ms")
            print(f"| {ctx} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
