"""What speculation would give a mixture-of-experts target, and the K the engine's cost-aware policy picks,
from the step tool's measured costs (scripts/moe_step.sh) and an acceptance rate.

    python -m specdec.tools.bench.moe_projection docs/bench/moe/*.json --alpha 0.763 --batches 1,4,16

A batch of B sequences each verifying K + 1 tokens is costed as one block of B (K + 1) rows of the
step report (the experts a block touches depend on its rows, not on which sequence they belong to; the
attention's extra context reads of B sequences are left out: small at the reports' context of 256).
Plain decoding of the batch costs the block of B rows. The policy's choice is ``engine.budget.best_k`` on
those costs (the same function the engine runs), drafts free (n-gram / suffix lookup) unless
``--draft-ms`` gives a drafted token's cost. ``--alpha``: the per-token acceptance rate; 0.763 is what
the 0.5B int4 draft reaches on the real Qwen2.5-Coder-1.5B (2.79 tokens per step at K = 3,
BENCHMARKS.md), assumed to hold.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.engine.budget import best_k, expected_tokens, interpolate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--alpha", type=float, default=0.763)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--draft-ms", type=float, default=0.0, help="ms of one drafted token for the whole batch")
    a = ap.parse_args(argv)
    print(f"acceptance per token {a.alpha}; drafts cost {a.draft_ms} ms a token\n")
    print("| target | batch | plain step ms | K the policy picks | verify ms at that K (x plain) | tokens per step "
          "| projected speedup | K=4 fixed: speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for path in a.reports:
        rep = json.loads(path.read_text())
        rows = {int(k.split("/")[1]): v["ms"] for k, v in rep["rows"].items() if k.startswith("native/")}
        name = rep["model"].split(" (")[0]
        for b in (int(x) for x in a.batches.split(",")):
            if b not in rows and b > max(rows):
                continue
            ks = [k for k in range(0, a.k_max + 1) if b * (k + 1) <= max(rows)]
            costs = {k + 1: interpolate(rows, b * (k + 1)) for k in ks}
            k = best_k(costs, a.alpha, max(ks), a.draft_ms)
            plain = costs[1]

            def speedup(k: int) -> float:
                return expected_tokens(a.alpha, k) * plain / (costs[k + 1] + k * a.draft_ms)
            fixed = f"{speedup(4):.2f}x" if 5 in costs else "-"
            print(f"| {name} | {b} | {plain:.1f} | {k} | {costs[k + 1]:.1f} ({costs[k + 1] / plain:.2f}) "
                  f"| {expected_tokens(a.alpha, k):.2f} | **{speedup(k):.2f}x** | {fixed} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
