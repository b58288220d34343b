"""Acceptance and speedup against prompt length, for every drafter, in one process (issue 35, part 3).

Prompts: ``specdec.tools.bench.long_prompts`` (summarization and RAG styles built from the Python
standard library's docstrings) at each ``--lengths`` (tokens, chat template included). Per prompt,
plain greedy decoding runs first (cold: its time to first token is the target's prefill), then every
``--config`` in turn with the prompt's KV rows already in the target's prefix cache; a drafter's own
prefill of the prompt (a draft model's) is then its time to first token, counted end to end. Every speculative output is checked equal to plain decoding's.

Columns: acceptance, tokens per target step, decode speedup (decode tok/s over plain's on the same
prompt, prefills left out) and end-to-end speedup (plain: the target's prefill and decoding; a drafter:
the target's prefill, the drafter's own prefill of the prompt, and its decoding). A warm-up request runs
first, unmeasured. Each measurement is appended to ``--out`` (JSONL) as it ends, and a rerun
skips what is there: a stopped run resumes. ``--plot`` draws acceptance and speedup against length.

    python -m specdec.tools.bench.long_context --model qwen2.5-coder-1.5b --quantization int4 \\
        --lengths 512,2048,8192,16384 --out results/long_context.jsonl --plot docs/bench/long-context.png \\
        --config ngram='{"method": "ngram"}' --config 0.5b='{"method": "draft_model", "model": "qwen2.5-coder-0.5b"}'
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from specdec import LLM, SamplingParams
from specdec.tools.bench.long_prompts import STYLES, long_prompts


def parse_config(arg: str) -> tuple[str, dict]:
    name, sep, cfg = arg.partition("=")
    if not sep:
        raise SystemExit(f"--config takes name=JSON, got {arg!r}")
    return name, json.loads(cfg)


def done_keys(out: Path) -> dict[tuple[str, str], dict]:
    if not out.exists():
        return {}
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {(r["prompt"], r["config"]): r for r in rows}


def measure(llm: LLM, text: str, params: SamplingParams) -> tuple[dict, list[int]]:
    t0 = time.perf_counter()
    o = llm.chat([[{"role": "user", "content": text}]], params)[0]
    wall = time.perf_counter() - t0
    m = o.metrics
    return {"wall": wall, "prefill_s": m.prefill_seconds, "decode_s": m.decode_seconds,
            "generated": m.num_generated_tokens, "steps": m.num_steps, "drafted": m.num_draft_tokens,
            "accepted": m.num_accepted_tokens, "draft_s": m.draft_seconds,
            "prompt_tokens": m.num_prompt_tokens}, list(o.outputs[0].token_ids)


def summarize(rows: list[dict], names: list[str]) -> str:
    plain = {r["prompt"]: r for r in rows if r["config"] == "plain"}
    agg: dict[tuple[str, int], dict] = defaultdict(lambda: defaultdict(float))
    for r in rows:
        p = plain.get(r["prompt"])
        if p is None:
            continue
        a = agg[(r["config"], r["length"])]
        for k in ("drafted", "accepted", "generated", "steps", "decode_s", "prefill_s"):
            a[k] += r[k]
        a["plain_decode_s"] += p["decode_s"] * (r["generated"] - 1) / max(1, p["generated"] - 1)
        a["plain_prefill_s"] += p["prefill_s"]
        a["own_prefill_s"] += r["prefill_s"] if r["config"] != "plain" else 0.0  # the drafter's (target cached)
        a["mismatch"] += r.get("mismatch", False)
        a["n"] += 1
    lengths = sorted({length for _, length in agg})
    lines = ["| drafter | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for name in ["plain", *names]:
        cells = []
        for n in lengths:
            a = agg.get((name, n))
            if not a:
                cells.append("-")
            elif name == "plain":
                cells.append(f"{(a['generated'] - a['n']) / a['decode_s']:.1f} tok/s, prefill {a['prefill_s'] / a['n']:.0f} s")
            else:
                acc = a["accepted"] / a["drafted"] if a["drafted"] else 0.0
                tps = a["generated"] / a["steps"] if a["steps"] else 0.0
                dec = a["plain_decode_s"] / a["decode_s"]
                e2e = ((a["plain_prefill_s"] + a["plain_decode_s"])
                       / (a["plain_prefill_s"] + a["own_prefill_s"] + a["decode_s"]))
                cells.append(f"{acc:.2f} / {tps:.2f} / **{dec:.2f}x** / {e2e:.2f}x" + (" MISMATCH" if a["mismatch"] else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], names: list[str], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plain = {r["prompt"]: r for r in rows if r["config"] == "plain"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in names:
        by_len: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
        for r in rows:
            p = plain.get(r["prompt"])
            if r["config"] != name or p is None:
                continue
            b = by_len[r["length"]]
            b[0] += r["accepted"]
            b[1] += r["drafted"]
            b[2] += p["decode_s"] * (r["generated"] - 1) / max(1, p["generated"] - 1)
            b[3] += r["decode_s"]
        xs = sorted(by_len)
        if not xs:
            continue
        ax1.plot(xs, [by_len[x][0] / max(1, by_len[x][1]) for x in xs], marker="o", label=name)
        ax2.plot(xs, [by_len[x][2] / by_len[x][3] for x in xs], marker="o", label=name)
    for ax, title in ((ax1, "acceptance (accepted / drafted)"), (ax2, "decode speedup over plain")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--lengths", default="512,2048,8192,16384")
    ap.add_argument("--styles", default=",".join(STYLES))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--config", action="append", default=[], help="name=speculative_config JSON (repeatable)")
    ap.add_argument("--out", required=True, help="JSONL of measurements (appended; a rerun resumes)")
    ap.add_argument("--plot", default=None, help="a PNG of acceptance and speedup against length")
    ap.add_argument("--budget-seconds", type=float, default=None, help="start no new prompt after this long")
    ap.add_argument("--report", action="store_true", help="run nothing: the table (and plot) of --out as it is")
    args = ap.parse_args(argv)
    configs = [parse_config(c) for c in args.config]
    names = [n for n, _ in configs]
    if args.report:
        rows = list(done_keys(Path(args.out)).values())
        names = names or list(dict.fromkeys(r["config"] for r in rows if r["config"] != "plain"))
        print(summarize(rows, names))
        if args.plot:
            plot(rows, names, args.plot)
        return 0
    lengths = sorted(int(x) for x in args.lengths.split(","))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = done_keys(out)
    todo = [("plain", None), *configs]
    llm = LLM(model=args.model, quantization=args.quantization, progress=False, max_num_seqs=1,
              max_model_len=max(lengths) + args.max_tokens + 64)
    for _, c in configs:  # load every drafter before timing anything
        llm.set_speculative_config(c)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.set_speculative_config(None)
    llm.generate("def warm_up():", params)  # the first request of a process pays one-off costs
    prompts = long_prompts(llm.tokenizer, lengths, tuple(args.styles.split(",")))
    started = time.perf_counter()
    for p in prompts:
        if args.budget_seconds and time.perf_counter() - started > args.budget_seconds:
            print(f"budget spent: stopping before {p.question_id}")
            break
        length = int(p.question_id.rsplit("-", 1)[1])
        want = done.get((p.question_id, "plain"), {}).get("tokens")
        for name, cfg in todo:
            if (p.question_id, name) in done:
                continue
            llm.set_speculative_config(cfg)
            row, tokens = measure(llm, p.turns[0], params)
            row |= {"prompt": p.question_id, "length": length, "config": name, "spec": cfg}
            if name == "plain":
                row["tokens"] = want = tokens
            else:
                row["mismatch"] = tokens != want
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            acc = row["accepted"] / row["drafted"] if row["drafted"] else 0.0
            print(f"{p.question_id:>20} {name:>14}: prefill {row['prefill_s']:6.1f} s, decode {row['decode_s']:6.2f} s, "
                  f"acceptance {acc:.2f}{'  MISMATCH' if row.get('mismatch') else ''}", flush=True)
    rows = list(done_keys(out).values())
    print(f"\ntarget {args.model} {args.quantization or 'bf16'}, greedy, {args.max_tokens} new tokens; cells: "
          "acceptance / tokens per step / decode speedup / end-to-end speedup")
    print(summarize(rows, names))
    if args.plot:
        plot(rows, names, args.plot)
        print(f"plot -> {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
