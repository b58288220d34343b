"""Speculative vs plain decoding, side by side in one run, per category and draft length K.

    python -m specdec.bench.speculative --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --draft-quantization int4 --ks 1,2,3,4,5,6,7,8 --code 4 --spec-bench ../shared/data/spec_bench/question.jsonl \\
        --per-category 2 --max-tokens 128 --output results/spec_k.json

For every prompt, plain decoding and each K run back to back (their order rotated from prompt to
prompt, so machine drift falls on all alike) after one warm-up. Greedy outputs must be identical
to plain decoding: any mismatch is reported. Prints markdown tables for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from specdec.config import SamplingParams
from specdec.errors import SpecdecError

CODE_PROMPTS = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Write a binary search function in Python with type hints and a short test.",
    "Write a Python function that counts word frequencies in a text file and returns the top 10.",
    "Implement quicksort in Python and explain its complexity in a comment.",
    "Write a Python dataclass for a 2D point with distance and midpoint methods.",
    "Write a Python function that validates an email address with a regular expression.",
]


MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def spec_bench_category(cat: str) -> str:
    """Spec-Bench files label MT-bench questions by their MT-bench subcategory: fold them."""
    return "mt-bench" if cat in MT_BENCH else cat


def load_prompts(code: int, spec_bench: str | None, per_category: int) -> list[tuple[str, list[dict]]]:
    """(category, chat messages) pairs: built-in code prompts, then Spec-Bench first turns."""
    items = [("code", [{"role": "user", "content": p}]) for p in CODE_PROMPTS[:code]]
    if spec_bench:
        seen: dict[str, int] = defaultdict(int)
        try:
            lines = Path(spec_bench).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise SpecdecError(f"cannot read {spec_bench}: {e.strerror}") from e
        for line in lines:
            rec = json.loads(line)
            cat = spec_bench_category(rec["category"])
            if seen[cat] < per_category:
                seen[cat] += 1
                items.append((cat, [{"role": "user", "content": rec["turns"][0]}]))
    return items


def run(llm, prompts, ks: list[int], max_tokens: int, progress: bool = True) -> list[dict]:
    """One record per (prompt, config). Config 0 is plain decoding."""
    from tqdm import tqdm  # noqa: PLC0415
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat(prompts[0][1], SamplingParams(temperature=0.0, max_tokens=8), num_speculative_tokens=max(ks))
    llm.chat(prompts[0][1], SamplingParams(temperature=0.0, max_tokens=8), num_speculative_tokens=0)
    configs = [0, *ks]
    records = []
    bar = tqdm(total=len(prompts) * len(configs), disable=not progress, desc="bench")
    for i, (cat, msgs) in enumerate(prompts):
        order = configs[i % len(configs):] + configs[:i % len(configs)]
        outs = {}
        for k in order:
            t0 = time.perf_counter()
            out = llm.chat(msgs, params, num_speculative_tokens=k)[0]
            outs[k] = (time.perf_counter() - t0, out)
            bar.update(1)
        base_ids = outs[0][1].outputs[0].token_ids
        for k in configs:
            wall, out = outs[k]
            m = out.metrics
            records.append({"prompt_index": i, "category": cat, "k": k, "wall_seconds": wall,
                            "num_tokens": m.num_generated_tokens, "identical_to_plain": out.outputs[0].token_ids == base_ids,
                            "metrics": m.to_dict()})
    bar.close()
    return records


def summarize(records: list[dict]) -> dict:
    """Per (category, k) and per k overall: speedup = plain time / speculative time on the same prompts."""
    from specdec.metrics import aggregate  # noqa: PLC0415
    from specdec.outputs import RequestMetrics  # noqa: PLC0415
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["category"], r["k"])].append(r)
        groups[("overall", r["k"])].append(r)
    out = {}
    for (cat, k), rs in groups.items():
        plain = groups[(cat, 0)]
        t_plain = sum(r["wall_seconds"] for r in plain)
        t = sum(r["wall_seconds"] for r in rs)
        agg = aggregate(RequestMetrics(**r["metrics"]) for r in rs)
        out[f"{cat}|{k}"] = {
            "category": cat, "k": k, "prompts": len(rs), "tokens": sum(r["num_tokens"] for r in rs),
            "tokens_per_second": sum(r["num_tokens"] for r in rs) / t, "speedup": t_plain / t,
            "mean_accepted_length": agg.mean_accepted_length, "acceptance_rate": agg.acceptance_rate,
            "acceptance_by_position": agg.acceptance_by_position,
            "draft_seconds": agg.draft_seconds, "verify_seconds": agg.verify_seconds, "other_seconds": agg.other_seconds,
            "mismatches": sum(not r["identical_to_plain"] for r in rs),
        }
    return out


def tables(summary: dict, ks: list[int]) -> str:
    cats = list(dict.fromkeys(v["category"] for v in summary.values()))
    cats = [c for c in cats if c != "overall"] + ["overall"]
    lines = ["| K | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
    for k in ks:
        cells = [f"{summary[f'{c}|{k}']['speedup']:.2f}x / {summary[f'{c}|{k}']['mean_accepted_length']:.2f}"
                 for c in cats]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    plain = [f"{summary[f'{c}|0']['tokens_per_second']:.2f} tok/s" for c in cats]
    lines.append("| plain | " + " | ".join(plain) + " |")
    lines.append("")
    lines.append("| K | tok/s overall | acceptance | draft s | verify s | other s | mismatches |")
    lines.append("|---|---|---|---|---|---|---|")
    for k in [0, *ks]:
        v = summary[f"overall|{k}"]
        lines.append(f"| {k or 'plain'} | {v['tokens_per_second']:.2f} | {v['acceptance_rate']:.1%} | "
                     f"{v['draft_seconds']:.1f} | {v['verify_seconds']:.1f} | {v['other_seconds']:.1f} | {v['mismatches']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--draft-quantization", default="int4", help="int4 (default), int8 or none")
    ap.add_argument("--ks", default="1,2,3,4,5,6,8")
    ap.add_argument("--code", type=int, default=4, help="how many built-in code prompts")
    ap.add_argument("--spec-bench", default=None, help="Spec-Bench question.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--output", default="results/spec_k.json")
    a = ap.parse_args()
    from specdec.llm import LLM  # noqa: PLC0415
    ks = [int(k) for k in a.ks.split(",")]
    prompts = load_prompts(a.code, a.spec_bench, a.per_category)
    llm = LLM(model=a.model, progress=False,
              speculative_config={"method": "draft_model", "model": a.draft, "num_speculative_tokens": max(ks),
                                  "quantization": None if a.draft_quantization == "none" else a.draft_quantization})
    records = run(llm, prompts, ks, a.max_tokens)
    summary = summarize(records)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "records": records, "summary": summary}, indent=1))
    print("speedup over plain / mean accepted length (bonus included), per category:")
    print(tables(summary, ks))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
