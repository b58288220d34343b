"""Acceptance of Gumbel-max verification against rejection sampling, per method, at T = 0.7 and 1.0.

    python -m specdec.tools.bench.gumbel_acceptance [--model smollm2-135m] [--temperature 0.7 1.0] [--prompts 6]

Counts only (acceptance is not a timing): for each method and verify mode, seeded sampled requests
over the first turns of Spec-Bench prompts (the first of each category, at most ``--prompts``; chat
template), batch 1, K = 5. Prints
one markdown row per (method, T): draft tokens, accepted share and emitted tokens per target step
for each mode, and whether every Gumbel-verified output equals plain decoding with the same seed
(the mode's guarantee, checked on the real model).
"""
from __future__ import annotations

import argparse
import json

from specdec import LLM, SamplingParams

SPEC_BENCH = "/work/shared/data/spec_bench/question.jsonl"
METHODS = {
    "ngram": {"method": "ngram"},
    "suffix": {"method": "suffix"},
    "layer_skip int4": {"method": "layer_skip", "quantization": "int4"},
    "layer_skip int4 tree": {"method": "layer_skip", "quantization": "int4", "tree_topk": 2, "tree_depth": 5},
    "eagle": {"method": "eagle"},
    "eagle tree": {"method": "eagle", "tree_topk": 2, "tree_depth": 5},
    "medusa": {"method": "medusa"},
    "cascade-self": {"method": "cascade-self"},
}


def prompts(path: str, per_category: int) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for line in open(path, encoding="utf-8"):
        rec = json.loads(line)
        cat = rec.get("category", "")
        if seen.get(cat, 0) < per_category:
            seen[cat] = seen.get(cat, 0) + 1
            out.append(rec["turns"][0])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=6, help="at most this many prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    a = ap.parse_args(argv)
    llm = LLM(model=a.model, progress=False)
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
           for p in prompts(SPEC_BENCH, a.per_category)[:a.prompts]]
    print(f"{a.model}, {len(ids)} Spec-Bench prompts (first turns), {a.max_tokens} tokens each, batch 1, K = {a.k}")
    print("| method | T | drafted (rej / gumbel) | accepted share (rej / gumbel) | tokens per step (rej / gumbel) "
          "| gumbel == plain |")
    print("|---|---|---|---|---|---|")
    for T in a.temperature:
        params = [SamplingParams(temperature=T, max_tokens=a.max_tokens, ignore_eos=True, seed=1000 + i)
                  for i in range(len(ids))]
        llm.set_speculative_config(None)
        plain = [llm.generate([p], q)[0].outputs[0].token_ids for p, q in zip(ids, params)]
        for name in a.methods:
            row = {}
            for verify in ("rejection", "gumbel"):
                llm.set_speculative_config(METHODS[name] | {"num_speculative_tokens": a.k, "verify": verify})
                outs = [llm.generate([p], q)[0] for p, q in zip(ids, params)]
                drafted = sum(o.metrics.num_draft_tokens for o in outs)
                accepted = sum(o.metrics.num_accepted_tokens for o in outs)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                steps = sum(o.metrics.num_steps for o in outs)
                same = sum(o.outputs[0].token_ids == r for o, r in zip(outs, plain))
                row[verify] = (drafted, accepted / max(drafted, 1), tokens / max(steps, 1), same)
            r, g = row["rejection"], row["gumbel"]
            print(f"| {name} | {T} | {r[0]} / {g[0]} | {r[1]:.3f} / {g[1]:.3f} | {r[2]:.2f} / {g[2]:.2f} "
                  f"| {g[3]}/{len(ids)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
