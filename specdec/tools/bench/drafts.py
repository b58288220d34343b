"""Drafters side by side on one target, in one process: acceptance, tokens per step, draft cost.

Every prompt runs plain decoding and then each speculative config in turn (the ratios come from one
run, interleaved), greedy. Per config it prints the acceptance rate, tokens emitted per target step,
the drafter's milliseconds per drafted token, tokens per second and the speedup over plain decoding.

    python -m specdec.tools.bench.drafts --model qwen2.5-coder-1.5b \
        --questions /work/shared/data/spec_bench/question.jsonl --per-category 1 --code 3 \
        --config '{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "quantization": "int4"}' ...
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdec import LLM, SamplingParams
from specdec.tools.bench.speculative import CODE_PROMPTS


def prompts(questions: str | None, per_category: int, code: int) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if questions:
        seen: dict[str, int] = {}
        for line in Path(questions).read_text().splitlines():
            q = json.loads(line)
            if seen.get(q["category"], 0) < per_category:
                seen[q["category"]] = seen.get(q["category"], 0) + 1
                out.append((q["category"], q["turns"][0]))
    return out + [("code", p) for p in CODE_PROMPTS[:code]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--questions", default=None)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--code", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budget-seconds", type=float, default=480.0,
                    help="start no new prompt after this many seconds (the table covers the prompts run)")
    ap.add_argument("--config", action="append", default=[], help="a speculative_config as JSON (repeatable)")
    args = ap.parse_args(argv)
    llm = LLM(model=args.model, quantization=args.quantization, progress=False)
    configs = [json.loads(c) for c in args.config]
    for c in configs:  # build every proposer (load drafts, cut heads) before timing anything
        llm.set_speculative_config(c)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    ps = prompts(args.questions, args.per_category, args.code)
    stats = {i: {"wall": 0.0, "gen": 0, "steps": 0, "draft": 0, "acc": 0, "dsec": 0.0} for i in range(-1, len(configs))}
    by_kind: dict[tuple[int, str], list[int]] = {}
    started, done = time.perf_counter(), 0
    for kind, text in ps:
        if time.perf_counter() - started > args.budget_seconds:
            break
        done += 1
        chat = [{"role": "user", "content": text}]
        want = None
        for i in range(-1, len(configs)):
            llm.set_speculative_config(configs[i] if i >= 0 else None)
            t0 = time.perf_counter()
            o = llm.chat([chat], params)[0]
            s = stats[i]
            s["wall"] += time.perf_counter() - t0
            m = o.metrics
            s["gen"] += m.num_generated_tokens
            s["steps"] += m.num_steps
            s["draft"] += m.num_draft_tokens
            s["acc"] += m.num_accepted_tokens
            s["dsec"] += m.draft_seconds
            k = by_kind.setdefault((i, "code" if kind == "code" else "spec-bench"), [0, 0, 0])
            k[0] += m.num_accepted_tokens
            k[1] += m.num_draft_tokens
            k[2] += m.num_steps
            if i < 0:
                want = o.outputs[0].token_ids
            elif o.outputs[0].token_ids != want:
                print(f"MISMATCH config {i} on {kind}")
    base = stats[-1]["gen"] / stats[-1]["wall"]
    print(f"{done} of {len(ps)} prompts ({', '.join(k for k, _ in ps[:done])}), {args.max_tokens} new tokens each, target {args.model} {args.quantization or 'bf16'}")
    print("| config | acceptance | tokens/step | acceptance spec-bench / code | draft ms/token | tok/s | speedup |")
    print("|---|---|---|---|---|---|---|")
    for i in range(-1, len(configs)):
        s = stats[i]
        name = "plain" if i < 0 else json.dumps({k: v for k, v in configs[i].items()})
        acc = s["acc"] / s["draft"] if s["draft"] else 0.0
        tps = s["gen"] / s["steps"] if s["steps"] else 0.0
        split = " / ".join(f"{a / d:.2f}" if d else "-" for a, d, _ in (by_kind.get((i, c), [0, 0, 0])
                                                                          for c in ("spec-bench", "code")))
        dms = 1000 * s["dsec"] / s["draft"] if s["draft"] else 0.0
        rate = s["gen"] / s["wall"]
        print(f"| `{name}` | {acc:.2f} | {tps:.2f} | {split} | {dms:.1f} | {rate:.2f} | {rate / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
