"""`specdec distill`'s report: acceptance before and after per prompt set, the training curve."""
from __future__ import annotations

from pathlib import Path

from specdec.args import command_line


def write_report(result: dict, history: list, out: Path) -> Path:
    """``out/report.md`` with ``out/plots/*.png`` (matplotlib is a dependency of specdec)."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    (out / "plots").mkdir(exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    if history:
        tokens = [h[1] for h in history]
        ax1.plot(tokens, [h[2] for h in history], lw=1)
        ax1.set(xlabel="target tokens trained on", ylabel="cross-entropy", title="Training loss")
        ax1b = ax1.twinx()
        ax1b.plot(tokens, [h[3] for h in history], color="tab:orange", lw=1)
        ax1b.set_ylabel("top-1 = target's token", color="tab:orange")
    k = 0  # the longest draft plotted
    for name, style in (("heldout", "-"), ("others", "--")):
        for when, color in (("before", "tab:grey"), ("after", "tab:green")):
            by = result[when].get(name, {}).get("acceptance_by_position")
            if by:
                ax2.plot(range(1, len(by) + 1), by, style, color=color, marker="o", label=f"{name}, {when}")
                k = max(k, len(by))
    ax2.set_xticks(range(1, k + 1))
    ax2.set(xlabel="draft position", ylabel="accepted / drafted", title="Acceptance by position", ylim=(0, 1))
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "plots" / "distill.png", dpi=110)
    plt.close(fig)
    command = command_line("distill")
    t = result["training"]
    lines = [f"# specdec distill: {result['draft']} for {result['target']}", "", f"`{command}`", "",
             f"Trained ({t['config']['mode']}) on {result['prompts']['train']} prompts' target outputs, "
             f"{t['tokens']} tokens seen in {t['steps']} optimizer steps, {t['seconds'] / 60:.1f} minutes.", "",
             f"Greedy acceptance at K={result['k']} on prompts never trained on (computed exactly from the "
             "target's greedy outputs):", "",
             "| prompts | n | acceptance before | after | change | tokens per step before | after |",
             "|---|---|---|---|---|---|---|"]
    for name, label in (("heldout", "held out, same source"), ("others", "other domains")):
        b, a = result["before"].get(name), result["after"].get(name)
        if b and a:
            change = a["acceptance_rate"] / b["acceptance_rate"] - 1 if b["acceptance_rate"] else 0.0
            lines.append(f"| {label} | {b['sequences']} | {b['acceptance_rate']:.1%} | {a['acceptance_rate']:.1%} | "
                         f"{change:+.0%} | {b['mean_accepted_length']:.2f} | {a['mean_accepted_length']:.2f} |")
    speed = result.get("speed")
    if speed:
        lines += ["", f"Speed at K={speed['k']}, {speed['max_tokens']} tokens per prompt (plain, the original and "
                  "the fine-tuned draft interleaved per prompt; greedy outputs "
                  + ("identical to plain decoding" if not speed["mismatches"] else
                     f"DIFFERENT from plain decoding on {speed['mismatches']} runs") + "):", "",
                  "| prompts | n | plain tok/s | before tok/s | after tok/s | speedup before | after |",
                  "|---|---|---|---|---|---|---|"]
        for name, label in (("heldout", "held out, same source"), ("others", "other domains")):
            v = speed.get(name)
            if v:
                t = v["tok_s"]
                lines.append(f"| {label} | {v['prompts']} | {t['plain']:.2f} | {t['before']:.2f} | {t['after']:.2f} | "
                             f"{v['speedup']['before']:.2f}x | {v['speedup']['after']:.2f}x |")
    lines += ["", "![training and acceptance](plots/distill.png)", "",
              f"Use it: `specdec generate --model {result['target']} --speculative-model {out / 'draft'} ...`", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def plot_training(history: list[dict], path: Path, title: str, final: dict | None = None) -> Path:
    """A head's training curve from its checkpoint history (``train.train``'s entries): loss and top-1
    per training-time-test step against tokens trained on; beside it the acceptance length measured
    at each checkpoint (``--eval-prompts``) and at the end (``final``: eval.json), when measured."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    tokens = [h["tokens"] for h in history]
    ax1.plot(tokens, [h["loss"] for h in history], color="tab:grey", marker=".", lw=1, label="loss")
    ax1.set(xlabel="tokens trained on", ylabel="loss (grey)", title=title)
    ax1b = ax1.twinx()
    for j in range(max((len(h.get("top1") or []) for h in history), default=0)):
        ax1b.plot(tokens, [(h.get("top1") or [None] * (j + 1))[j] for h in history], marker=".", lw=1,
                  label=f"top-1, step {j + 1}")
    ax1b.set(ylabel="top-1 = target's token", ylim=(0, 1))
    ax1b.legend(fontsize=7, loc="upper left")
    measured = [(h["tokens"], h["mean_accepted_length"]) for h in history if h.get("mean_accepted_length")]
    if measured:
        ax2.plot(*zip(*measured), marker="o", lw=1, label="checkpoints (--eval-prompts)")
    final = final or {}
    if final.get("mean_accepted_length") and tokens:
        measured_final = [final["mean_accepted_length"]]
        ax2.plot([tokens[-1]], measured_final, "s", color="tab:red",
                 label=f"final, {final.get('eval_prompts', '?')} held-out prompts")
    else:
        measured_final = []
    ax2.set(xlabel="tokens trained on", ylabel="tokens per step (K = %s)" % final.get("k", "?"),
            title="Acceptance length on held-out prompts")
    values = [v for _, v in measured] + measured_final
    if values:
        ax2.set_ylim(1.0, max(values) + 0.5)
        ax2.legend(fontsize=7)
    else:
        ax2.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax2.transAxes)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
