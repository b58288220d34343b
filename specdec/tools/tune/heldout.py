"""Check a tuning on held-out prompts: the recommended config against every candidate's best, run
side by side by the benchmark (``specdec bench``'s ``run``: configs interleaved per prompt).

    python -m specdec.tools.tune.heldout --tuned tuned/ --prompts heldout.jsonl [--max-tokens 128]

Prints each config's tokens/s and speedup over plain decoding on those prompts, and how the
recommendation compares with the best of them (the tuner's promise: within 10%). Exit status 1
when a greedy output differs from plain decoding or the recommendation is more than 10% behind.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.errors import SpecdecError

TOLERANCE = 0.10


def configs(tuned: Path) -> list:
    """Plain, the recommendation, then each other candidate's fastest measured config."""
    from specdec.deploy import DeploymentConfig  # noqa: PLC0415
    from specdec.tools.bench.speculative import BenchConfig  # noqa: PLC0415
    from specdec.tools.tune.decide import Measured, ranked  # noqa: PLC0415

    cfg = DeploymentConfig.load(tuned)
    res = json.loads((tuned / "results.json").read_text())
    out = [BenchConfig("plain", None)]
    rec = cfg.speculative_config
    if rec is not None:
        out.append(BenchConfig("recommended", rec, rec.get("num_speculative_tokens")))
    for m in ranked([Measured(**r) for r in res["measurements"]]):
        spec = dict(m.spec, num_speculative_tokens=m.k)
        if spec != rec:
            out.append(BenchConfig(f"{m.name} K={m.k}", spec, m.k))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.tune.heldout", description=__doc__.split("\n\n")[0])
    p.add_argument("--tuned", required=True, help="the directory `specdec tune --output` wrote (required)")
    p.add_argument("--prompts", required=True, help="held-out prompts, JSONL as for tune (required)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    a = p.parse_args(argv)
    try:
        from specdec.deploy import DeploymentConfig  # noqa: PLC0415
        from specdec.llm import LLM  # noqa: PLC0415
        from specdec.tools.bench.prompts import load_prompts  # noqa: PLC0415
        from specdec.tools.bench.speculative import run  # noqa: PLC0415

        tuned = Path(a.tuned)
        runs = configs(tuned)
        prompts = load_prompts(a.prompts, None, None)
        cfg = DeploymentConfig.load(tuned)
        llm = LLM(model=cfg.model, dtype=cfg.dtype, quantization=cfg.quantization)
        records = run(llm, prompts, runs, a.max_tokens)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokens: dict[str, int] = {}
    seconds: dict[str, float] = {}
    bad = 0
    for r in records:
        tokens[r["config"]] = tokens.get(r["config"], 0) + r["num_tokens"]
        seconds[r["config"]] = seconds.get(r["config"], 0.0) + r["wall_seconds"]
        bad += r["identical_to_plain"] is False
    rate = {c: tokens[c] / seconds[c] for c in tokens}
    rate.setdefault("recommended", rate["plain"])  # recommended: plain decoding
    print(f"held-out: {len(prompts)} prompts from {a.prompts}, {a.max_tokens} tokens, configs interleaved per prompt")
    for c in (r.name for r in runs):
        print(f"  {c:40s} {rate[c]:6.2f} tok/s  {rate[c] / rate['plain']:.2f}x")
    spec = [c.name for c in runs if c.spec is not None]
    ok = not bad
    if spec:
        best = max(spec, key=lambda c: rate[c])
        gap = 1 - rate["recommended"] / rate[best]
        print(f"recommended: {rate['recommended'] / rate['plain']:.2f}x; best here: {best} "
              f"{rate[best] / rate['plain']:.2f}x; the recommendation is {max(gap, 0):.1%} behind "
              f"(promise: within {TOLERANCE:.0%})")
        ok = ok and gap <= TOLERANCE
    print("greedy outputs identical to plain decoding" if not bad else f"ERROR: {bad} greedy outputs differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
