"""Acceptance counters of greedy chat runs counted both ways in one run (issue 33, item 4).

    PYTHONPATH=$PWD sd-heavy .venv/bin/python scripts/corrected_counters.py 2 '{"method": "suffix"}'

``engine.accounting.count_step`` gets (drafted, accepted by the verifier, taken by the sequence): the
engine before the fix counted ``accepted``, now ``min(accepted, taken)``. Old tokens per step is
(old accepted + steps) / steps (the old ``metrics`` formula), new is tokens / steps. SmolLM2-135M,
the first N Spec-Bench first turns of each category, 128 tokens, EOS on, K = 4; one JSON line per config.
"""
from __future__ import annotations

import collections
import json
import sys

import specdec.engine.step as step
from specdec import LLM, SamplingParams
from specdec.metrics import aggregate

PROMPTS = "/work/shared/data/spec_bench/question.jsonl"


def main(argv: list[str]) -> None:
    old: collections.Counter = collections.Counter()
    real = step.count_step

    def counting(c, drafted: int, accepted: int, taken: int, positions: int | None = None) -> int:
        old["accepted"] += accepted
        return real(c, drafted, accepted, taken, positions)

    step.count_step = counting  # what ``accept`` calls
    per_cat, configs = int(argv[0]), [json.loads(c) for c in argv[1:]]
    rows, seen = [], collections.Counter()
    with open(PROMPTS, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if seen[r["category"]] < per_cat:
                seen[r["category"]] += 1
                rows.append(r)
    params = SamplingParams(temperature=0.0, max_tokens=128)
    for cfg in configs:
        old.clear()
        llm = LLM(model="smollm2-135m", progress=False, speculative_config={"num_speculative_tokens": 4, **cfg})
        outs = [llm.chat([{"role": "user", "content": r["turns"][0]}], params)[0] for r in rows]
        m = aggregate(outs)
        print(json.dumps({"config": cfg, "requests": len(outs),
                          "ended_by_eos": sum(o.outputs[0].finish_reason == "stop" for o in outs),
                          "tokens": m.num_generated_tokens, "steps": m.num_steps, "drafted": m.num_draft_tokens,
                          "accepted_old": old["accepted"], "accepted_new": m.num_accepted_tokens,
                          "tokens_per_step_old": round((old["accepted"] + m.num_steps) / m.num_steps, 4),
                          "tokens_per_step_new": round(m.mean_accepted_length, 4),
                          "acceptance_old": round(old["accepted"] / max(m.num_draft_tokens, 1), 4),
                          "acceptance_new": round(m.acceptance_rate, 4)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
