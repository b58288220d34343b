"""What `specdec tune` leaves behind: the config to deploy, a report a person reads in a minute
(markdown and PNG plots) and every measured figure (results.json)."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from specdec.args import command_line
from specdec.tools.tune.decide import Decision, Measured, best_per_candidate


def write(out: Path, a: argparse.Namespace, llm, result: dict) -> list[Path]:
    from specdec.deploy import DeploymentConfig  # noqa: PLC0415

    d: Decision = result["decision"]
    command = command_line("tune")
    cfg = DeploymentConfig(model=a.model, dtype=a.dtype, quantization=a.quantization, speculative_config=d.spec,
                           spec_max_batch=d.spec_max_batch,
                           report={"reasons": d.reasons, "command": command,
                                   "tuned_seconds": round(result["seconds"], 1)})
    paths = [cfg.save(out)]
    results = {"command": command, "baseline": result["baseline"], "seconds": result["seconds"],
               "measurements": [dataclasses.asdict(m) for m in result["results"]],
               "plain_by_batch": result["plain_by_batch"], "spec_by_batch": result["spec_by_batch"],
               "decision": dataclasses.asdict(d), "skipped": result["skipped"], "mismatches": result["mismatches"]}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    paths.append(out / "results.json")
    plots, note = _plots(out / "plots", result)
    (out / "report.md").write_text(markdown(a.model, command, result, [p.relative_to(out) for p in plots], note))
    return paths + [out / "report.md", *plots]


def markdown(model: str, command: str, result: dict, plots: list[Path], plot_note: str | None = None) -> str:
    d: Decision = result["decision"]
    b = result["baseline"]
    lines = [f"# specdec tune: {model}", "", f"`{command}` ({result['seconds'] / 60:.1f} minutes)", "",
             "## Recommendation", ""]
    if d.spec is None:
        lines.append("**Plain decoding** (no speculation).")
    else:
        cut, window = d.spec.get("draft_confidence_threshold"), d.spec.get("draft_context")
        lines.append(f"**{d.name}**, K={d.spec.get('num_speculative_tokens')}"
                     + (f", confidence cut-off {cut}" if cut else "")
                     + (f", the draft reading the last {window} prompt tokens" if window else "")
                     + (f", drafting off above batch {d.spec_max_batch}" if d.spec_max_batch else "") + ".")
    lines += [""] + [f"- {r}" for r in d.reasons]
    lines += ["", "Run it: `specdec serve --config specdec-config.json` (or `generate --config`, "
              "`LLM(config=...)`).", "", "## Baseline (plain decoding, one request at a time)", "",
              "| time to first token | time per token | tokens/s | weights | KV cache per token |", "|---|---|---|---|---|",
              f"| {b['ttft_seconds'] * 1000:.0f} ms | {b['seconds_per_token'] * 1000:.1f} ms | "
              f"{b['tokens_per_second']:.2f} | {b['weights_bytes'] / 1e9:.2f} GB | {b['kv_bytes_per_token'] / 1024:.1f} kB |",
              "", "## Candidates (batch 1, same prompts)", "",
              "| drafter | K | cut-off | draft context | tokens/s | speedup | acceptance | tokens/step | draft cost "
              "| memory added |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m in result["results"]:
        if m.spec is None or m.batch != 1:
            continue
        lines.append(f"| {m.name} | {m.k} | {m.spec.get('draft_confidence_threshold', '-')} | "
                     f"{m.spec.get('draft_context') or 'all'} | "
                     f"{m.tokens_per_second:.2f} | {m.speedup:.2f}x | {m.acceptance:.0%} | {m.tokens_per_step:.2f} | "
                     f"{m.draft_cost:.2f} | {m.memory_bytes / 1e9:.2f} GB |")
    if result["plain_by_batch"]:
        lines += ["", "## Batch sizes (tokens/s over the batch)", "", "| batch | plain | speculative | ratio |",
                  "|---|---|---|---|"]
        for n in sorted(result["plain_by_batch"]):
            p, s = result["plain_by_batch"][n], result["spec_by_batch"].get(n)
            if s is not None:
                lines.append(f"| {n} | {p:.2f} | {s:.2f} | {s / p:.2f}x |")
    if result["skipped"]:
        lines += ["", "## Not measured", ""] + [f"- {s}" for s in result["skipped"]]
    lines += ["", "Draft cost: drafting seconds per drafted token over plain decoding's seconds per token. "
              "Memory added: the process's resident memory before and after the drafter loaded.",
              "Every speculative configuration's greedy output was compared token by token with plain decoding: "
              + ("identical everywhere." if not result["mismatches"] else
                 "MISMATCH in " + ", ".join(result["mismatches"]) + " (an engine bug).")]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.as_posix()})" for p in plots]
    elif plot_note:
        lines += ["", plot_note]
    return "\n".join(lines) + "\n"


def _plots(where: Path, result: dict) -> tuple[list[Path], str | None]:
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return [], "(no plots: matplotlib is not installed; `pip install matplotlib`)"
    where.mkdir(parents=True, exist_ok=True)
    paths = []
    runs: list[Measured] = [m for m in result["results"] if m.spec is not None and m.batch == 1
                            and not m.spec.get("draft_confidence_threshold") and not m.spec.get("draft_context")]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(m.name for m in runs):
        pts = sorted((m.k, m.speedup) for m in runs if m.name == name)
        ax.plot([k for k, _ in pts], [s for _, s in pts], marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="draft length K", ylabel="speedup over plain (batch 1)", title="Speedup vs K")
    ax.legend(fontsize=8)
    paths.append(_save(fig, where / "speedup_vs_k.png", plt))
    if result["plain_by_batch"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        sizes = sorted(n for n in result["plain_by_batch"] if n in result["spec_by_batch"])
        ax.plot(sizes, [result["spec_by_batch"][n] / result["plain_by_batch"][n] for n in sizes], marker="o",
                label=result["decision"].name or "winner")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(xlabel="batch size", ylabel="speculative / plain tokens/s", title="Speedup vs batch size", xscale="log",
               xticks=sizes, xticklabels=[str(s) for s in sizes])
        ax.legend(fontsize=8)
        paths.append(_save(fig, where / "speedup_vs_batch.png", plt))
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in best_per_candidate(result["results"]).values():
        if m.acceptance_by_position:
            ax.plot(range(1, len(m.acceptance_by_position) + 1), m.acceptance_by_position, marker="o",
                    label=f"{m.name} K={m.k}")
    ax.set(xlabel="draft position", ylabel="acceptance", title="Acceptance by position (best K each)", ylim=(0, 1.02))
    ax.legend(fontsize=8)
    paths.append(_save(fig, where / "acceptance_by_position.png", plt))
    return paths, None


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
