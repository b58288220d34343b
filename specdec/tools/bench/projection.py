"""What speculation would give a bigger target on this machine (issue 32's projection), from measured costs.

    python -m specdec.tools.bench.projection results/step-qwen2.5-7b-int4.json results/step-qwen2.5-7b-bf16.json ... \
        --draft results/step-qwen2.5-coder-0.5b-int4.json --accept 3=2.79 5=3.45 8=3.93

Inputs are `python -m specdec.tools.bench.step --output` reports: the target's (a `--shape` run: random
weights of a public shape) with T = 1 and T = K + 1 rows, and the draft's (T = 1: one drafted token).
``--accept K=TOKENS`` gives the tokens emitted per target step measured at draft length K on the real
pair (qwen2.5-coder-1.5b drafted for by the 0.5B at int4): the projection assumes the bigger target
accepts the 0.5B's drafts as the 1.5B does. For each target and K it prints the step costs and the
decode speedup they give: tokens per step x T1 / (K x draft + verify(K + 1)).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def ms(report: dict, rows: int) -> float | None:
    row = report["rows"].get(f"native/{rows}")
    return row["ms"] if row else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="+", type=Path, help="step reports of the targets")
    ap.add_argument("--draft", type=Path, required=True, help="step report of the draft (T = 1 used)")
    ap.add_argument("--accept", nargs="+", required=True, help="K=TOKENS_PER_STEP measured on the real pair")
    a = ap.parse_args(argv)
    accept = {int(k): float(v) for k, v in (x.split("=") for x in a.accept)}
    draft_report = json.loads(a.draft.read_text())
    draft = ms(draft_report, 1)
    print(f"draft: {draft_report['model']} at {draft:.1f} ms a token")
    print("| target | weights | plain step ms (fraction of the read limit) | K | verify K+1 rows ms (x plain) "
          "| draft ms (K tokens) | draft / plain step | tokens per step | projected decode speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in a.targets:
        rep = json.loads(path.read_text())
        one = ms(rep, 1)
        name = rep["model"].split(" (")[0]
        for k, tokens in sorted(accept.items()):
            verify = ms(rep, k + 1)
            if verify is None:
                continue
            step = k * draft + verify
            print(f"| {name} | {rep['format']} | {one:.1f} ({rep['limit_ms'] / one:.2f}) | {k} | {verify:.1f} "
                  f"({verify / one:.2f}) | {k * draft:.1f} | {draft / one:.3f} | {tokens:.2f} "
                  f"| **{tokens * one / step:.2f}x** |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
