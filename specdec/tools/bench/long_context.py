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
Progress lines go to stderr, one per measurement.

``specdec bench --long`` runs the same loop (``run_long``) with the drafters of the bench's flags
(``cmd_long``) and ``--plots DIR`` draws decode speedup and time to first token against length
(``plot_length_curves``).

    python -m specdec.tools.bench.long_context --model qwen2.5-coder-1.5b --quantization int4 \\
        --lengths 512,2048,8192,16384 --out results/long_context.jsonl --plot docs/bench/long-context.png \\
        --config ngram='{"method": "ngram"}' --config 0.5b='{"method": "draft_model", "model": "qwen2.5-coder-0.5b"}'
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from specdec.config import SamplingParams
from specdec.errors import SpecdecError
from specdec.tools.bench.long_prompts import STYLES, long_prompts

MIN_LENGTH = 256  # long_prompt's shortest
PLOTS = ("decode_speedup_by_length.png", "ttft_by_length.png")  # what `specdec bench --long --plots DIR` writes
DEFAULT_LENGTHS = "2048,8192"  # `specdec bench --long`'s
DEFAULT_OUTPUT = "results/bench_long.jsonl"


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


def measure(llm, text: str, params: SamplingParams) -> tuple[dict, list[int]]:
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


def style_of(row: dict) -> str:
    return row.get("style") or row["prompt"].rsplit("-", 1)[0]  # rows written before "style" was a column


def plot_length_curves(rows: list[dict], names: list[str], out_dir: str | Path) -> list[Path]:
    """Two PNGs in ``out_dir`` (``PLOTS``), one line per (drafter, style): decode speedup over plain
    (decode tok/s, prefills left out) against prompt length, and time to first token against prompt
    length (plain: the target's prefill of the prompt, cold; a drafter: that prefill plus the drafter's
    own first token with the target's KV rows of the prompt cached, i.e. end to end)."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    plain = {r["prompt"]: r for r in rows if r["config"] == "plain"}
    styles = list(dict.fromkeys(style_of(r) for r in rows))
    colors = {name: f"C{i}" for i, name in enumerate(["plain", *names])}
    markers = dict(zip(styles, "osD^v<>"))
    figs = [plt.subplots(figsize=(7, 4.2)) for _ in PLOTS]
    (_, speed), (_, ttft) = figs
    for name in ["plain", *names]:
        for style in styles:
            pts = sorted((r["length"], r, plain[r["prompt"]]) for r in rows
                         if r["config"] == name and style_of(r) == style and r["prompt"] in plain)
            if not pts:
                continue
            xs = [n for n, _, _ in pts]
            kw = {"marker": markers[style], "color": colors[name], "label": f"{name}, {style}",
                  "linestyle": "--" if name == "plain" else "-"}
            ttft.plot(xs, [p["prefill_s"] + (r["prefill_s"] if name != "plain" else 0.0) for _, r, p in pts], **kw)
            if name != "plain":
                speed.plot(xs, [p["decode_s"] * (r["generated"] - 1) / max(1, p["generated"] - 1) / r["decode_s"]
                                for _, r, p in pts], **kw)
    speed.axhline(1.0, color="grey", lw=0.8)
    speed.set_title("decode speedup over plain decoding (prefill left out)")
    ttft.set_title("time to first token (drafters: with the target's prefill)")
    ttft.set_ylabel("seconds")
    lengths = sorted({r["length"] for r in rows})
    paths = []
    for (fig, ax), name in zip(figs, PLOTS):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
        ax.minorticks_off()
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(Path(out_dir) / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def parse_lengths(text: str) -> list[int]:
    """``--lengths`` (token counts, comma-separated) sorted; SpecdecError for a word or a length under 256."""
    try:
        lengths = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SpecdecError(f"--lengths takes token counts separated by commas (e.g. 2048,8192), got {text!r}") from None
    if not lengths:
        raise SpecdecError("--lengths is empty: give token counts separated by commas (e.g. 2048,8192)")
    if lengths[0] < MIN_LENGTH:
        raise SpecdecError(f"--lengths: a long prompt needs at least {MIN_LENGTH} tokens, got {lengths[0]}")
    return lengths


def parse_styles(text: str) -> tuple[str, ...]:
    styles = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [x for x in styles if x not in STYLES]
    if bad or not styles:
        raise SpecdecError(f"--styles: unknown long-prompt style {(bad or [text])[0]!r}: one or more of "
                           f"{', '.join(STYLES)}, comma-separated")
    return styles


def context_needed(lengths: list[int], max_tokens: int) -> int:
    """Positions the longest prompt (within long_prompt's 0.5%) and its answer take."""
    return max(lengths) + max(2, max(lengths) // 200) + max_tokens


# `specdec bench` flags that --long has no use for (its prompts are its own, greedy, no peer)
NOT_WITH_LONG = {"prompts": "--prompts", "peer": "--peer", "limit": "--limit", "categories": "--categories",
                 "all_turns": "--all-turns"}


def cmd_long(a: argparse.Namespace) -> int:
    """`specdec bench --long`: ``run_long`` on the drafters of the bench's flags, every measurement in
    --output (JSONL, resumed), the table on stdout, --plots DIR: ``plot_length_curves``. 1 if a
    drafter's output differed from plain decoding's."""
    from specdec.tools.bench.speculative import sweep_configs  # noqa: PLC0415
    given = [flag for key, flag in NOT_WITH_LONG.items() if getattr(a, key, None)]
    if given:
        raise SpecdecError(f"{given[0]} does not go with --long (its prompts are its own: --lengths, --styles)")
    if a.temperature != 0.0:
        raise SpecdecError("--long measures greedy decoding (outputs checked against plain): drop --temperature")
    if a.max_tokens < 2:
        raise SpecdecError(f"--long needs --max-tokens of at least 2 (decoding is timed after the first token), "
                           f"got {a.max_tokens}")
    lengths = parse_lengths(a.lengths or DEFAULT_LENGTHS)
    styles = parse_styles(a.styles or ",".join(STYLES))
    needed = context_needed(lengths, a.max_tokens)
    if a.max_model_len is not None and needed > a.max_model_len:
        raise SpecdecError(f"--lengths {lengths[-1]} with --max-tokens {a.max_tokens} needs {needed} tokens of "
                           f"context, above --max-model-len {a.max_model_len}")
    configs = [(c.name, c.spec) for c in sweep_configs(a)[1:]]  # [0] is plain: run_long measures it first
    names = [n for n, _ in configs]
    out = Path(a.output or DEFAULT_OUTPUT)
    if a.plots:
        try:
            import matplotlib  # noqa: F401, PLC0415
        except ImportError as e:
            raise SpecdecError("--plots needs matplotlib: pip install matplotlib") from e
    for d in ([Path(a.plots)] if a.plots else []) + [out.parent]:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpecdecError(f"cannot create directory '{d}': {e.strerror}") from e
    meta = {"model": a.model, "quantization": a.quantization, "dtype": a.dtype, "max_tokens": a.max_tokens}
    try:
        done = done_keys(out)
    except (ValueError, KeyError) as e:
        raise SpecdecError(f"--output {out} is not a JSONL file of this benchmark ({e}): "
                           "give another --output") from None
    check_resumable(done, dict(configs), meta, out)
    wanted = {(prompt_id(s, n), name) for n in lengths for s in styles for name in ["plain", *names]}
    if wanted - set(done):
        from specdec.llm import LLM  # noqa: PLC0415
        llm = LLM(model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len, seed=a.seed,
                  quantization=a.quantization, progress=not a.no_progress, max_num_seqs=1,
                  kv_cache_memory=a.kv_cache_memory)
        if needed > llm.max_model_len:
            raise SpecdecError(f"--lengths {lengths[-1]} with --max-tokens {a.max_tokens} needs {needed} tokens of "
                               f"context, above the model's {llm.max_model_len}: drop the longer lengths")
        stderr(f"{len(wanted - set(done))} of {len(wanted)} measurements to run ({len(wanted & set(done))} already in "
               f"{out}); a prompt's plain run first (its prefill: time to first token), then "
               + ", ".join(names))
        run_long(llm, configs, lengths, styles, out, a.max_tokens, meta=meta)
    else:
        stderr(f"nothing to measure: all {len(wanted)} measurements are in {out} already")
    rows = [r for key, r in done_keys(out).items() if key in wanted]
    bad = sorted({(r["config"], r["prompt"]) for r in rows if r.get("mismatch")})
    quant = f" ({a.quantization})" if a.quantization else ""
    print(f"target {a.model}{quant}, greedy, {a.max_tokens} new tokens, styles {', '.join(styles)}; cells: "
          "acceptance / tokens per step / decode speedup / end-to-end speedup")
    print(summarize(rows, names))
    if bad:
        print(f"ERROR: {len(bad)} greedy output(s) differ from plain decoding (a bug in the engine, please report "
              "it): " + ", ".join(f"{c} on {q}" for c, q in bad[:10]))
    if a.plots:
        for path in plot_length_curves(rows, names, a.plots):
            print(f"wrote {path}")
    print(f"wrote {out}")
    return 1 if bad else 0


def check_resumable(done: dict[tuple[str, str], dict], configs: dict[str, dict], meta: dict, out: Path) -> None:
    """SpecdecError when ``out`` holds measurements of another model, answer length or drafter under a name
    this run uses: resuming would mix them."""
    for (_, name), r in done.items():
        for key, value in meta.items():
            if key in r and r[key] != value:
                raise SpecdecError(f"--output {out} holds measurements with {key} {r[key]!r}, not {value!r}: "
                                   "give another --output (or the same flags) to resume")
        if name in configs and json.loads(json.dumps(configs[name])) != r.get("spec"):
            raise SpecdecError(f"--output {out} holds {name!r} measured with another speculative config "
                               f"({json.dumps(r.get('spec'))}): give another --output")


def prompt_id(style: str, length: int) -> str:
    return f"{style}-{length}"  # long_prompt's question_id


def stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_long(llm, configs: list[tuple[str, dict]], lengths: list[int], styles: tuple[str, ...], out: Path,
             max_tokens: int, *, budget_seconds: float | None = None, meta: dict | None = None,
             log: Callable[[str], None] = stderr) -> list[dict]:
    """Every prompt of ``styles`` x ``lengths``: plain greedy decoding first, then each drafter of
    ``configs`` ((name, speculative_config) pairs), each measurement appended to ``out`` (JSONL) as it
    ends, with ``meta`` in its row; those ``out`` holds already are skipped (a stopped run resumes).
    A drafter's output differing from plain's is marked ``mismatch``. One ``log`` line per measurement.
    Returns the rows measured now."""
    done = done_keys(out)
    todo = [("plain", None), *configs]
    pending = [(s, n) for n in sorted(lengths) for s in styles
               if any((prompt_id(s, n), name) not in done for name, _ in todo)]
    if not pending:
        return []
    for _, c in configs:  # load every drafter before timing anything
        llm.set_speculative_config(c)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.set_speculative_config(None)
    llm.generate("def warm_up():", params.replace(max_tokens=min(8, max_tokens)))  # a process's first request
    # pays one-off costs
    measured = []
    started = time.perf_counter()
    for i, (style, length) in enumerate(pending):
        if budget_seconds and time.perf_counter() - started > budget_seconds:
            log(f"budget spent: stopping before {prompt_id(style, length)}")
            break
        p = long_prompts(llm.tokenizer, [length], (style,))[0]
        want = done.get((p.question_id, "plain"), {}).get("tokens")
        log(f"[{i + 1}/{len(pending)}] {p.question_id}: measuring "
            + ", ".join(name for name, _ in todo if (p.question_id, name) not in done))
        for name, cfg in todo:
            if (p.question_id, name) in done:
                continue
            llm.set_speculative_config(cfg)
            row, tokens = measure(llm, p.turns[0], params)
            row |= {"prompt": p.question_id, "style": style, "length": length, "config": name, "spec": cfg,
                    **(meta or {})}
            if name == "plain":
                row["tokens"] = want = tokens
            else:
                row["mismatch"] = tokens != want
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            measured.append(row)
            acc = row["accepted"] / row["drafted"] if row["drafted"] else 0.0
            log(f"{p.question_id:>20} {name:>14}: prefill {row['prefill_s']:6.1f} s, decode {row['decode_s']:6.2f} s, "
                f"acceptance {acc:.2f}{'  MISMATCH' if row.get('mismatch') else ''}")
    llm.set_speculative_config(None)
    return measured


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
    try:
        return run_main(args)
    except SpecdecError as e:  # bad input (a length, a style, a model): one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2


def run_main(args: argparse.Namespace) -> int:
    """The module entry point's run: the lengths and styles checked, then ``run_long`` (or ``--report``)."""
    configs = [parse_config(c) for c in args.config]
    names = [n for n, _ in configs]
    if args.report:
        rows = list(done_keys(Path(args.out)).values())
        names = names or list(dict.fromkeys(r["config"] for r in rows if r["config"] != "plain"))
        print(summarize(rows, names))
        if args.plot:
            plot(rows, names, args.plot)
        return 0
    lengths, styles = parse_lengths(args.lengths), parse_styles(args.styles)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from specdec import LLM  # noqa: PLC0415
    llm = LLM(model=args.model, quantization=args.quantization, progress=False, max_num_seqs=1,
              max_model_len=max(lengths) + args.max_tokens + 64)
    run_long(llm, configs, lengths, styles, out, args.max_tokens,
             budget_seconds=args.budget_seconds)
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
