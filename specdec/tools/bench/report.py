"""Benchmark reports: summaries per category and config, terminal tables, results.json, PNG plots.

Speedup is tokens/s over the same engine's plain decoding on the same prompts (for greedy outputs,
which are identical, that is the time ratio). Mean accepted length counts the bonus token: tokens
emitted per target forward. The transformers peer gets the same figures where it exposes them.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from specdec.tools.bench.prompts import category_order
from specdec.errors import SpecdecError

ENGINE_LABEL = {"specdec": "specdec", "hf": "transformers", "llamacpp": "llama.cpp"}


def _tps(rs: list[dict]) -> float:
    t = sum(r["wall_seconds"] for r in rs)
    return sum(r["num_tokens"] for r in rs) / t if t > 0 else 0.0


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(records: list[dict]) -> dict[str, dict]:
    """``"{category}|{config}"`` -> figures, for every category and "overall"."""
    from specdec.metrics import aggregate  # noqa: PLC0415 (torch-free callers may only read JSON)
    from specdec.outputs import RequestMetrics  # noqa: PLC0415
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    base: dict[str, str] = {}
    for r in records:
        groups[(r["category"], r["config"])].append(r)
        groups[("overall", r["config"])].append(r)
        if r.get("method", "plain") == "plain":
            base.setdefault(r.get("engine", "specdec"), r["config"])
    out = {}
    for (cat, name), rs in groups.items():
        r0 = rs[0]
        engine = r0.get("engine", "specdec")
        tps = _tps(rs)
        own = _tps(groups[(cat, base[engine])]) if engine in base else None
        ours = _tps(groups[(cat, base["specdec"])]) if "specdec" in base else None
        twin = r0.get("counterpart")
        checks = [r["identical_to_plain"] for r in rs if r.get("identical_to_plain") is not None]
        entry = {
            "category": cat, "config": name, "engine": engine, "method": r0.get("method"), "k": r0.get("k"),
            "prompts": len(rs), "tokens": sum(r["num_tokens"] for r in rs),
            "seconds": sum(r["wall_seconds"] for r in rs), "tokens_per_second": tps,
            "speedup": _ratio(tps, own), "speedup_vs_specdec_plain": _ratio(tps, ours),
            "checked": len(checks), "mismatches": sum(not c for c in checks) if checks else None,
        }
        if engine == "specdec":
            agg = aggregate(RequestMetrics(**r["metrics"]) for r in rs)
            entry |= {"mean_accepted_length": agg.mean_accepted_length, "acceptance_rate": agg.acceptance_rate,
                      "acceptance_by_position": agg.acceptance_by_position,
                      "draft_seconds": agg.draft_seconds, "verify_seconds": agg.verify_seconds,
                      "other_seconds": agg.other_seconds}
        else:
            forwards = sum(r.get("num_target_forwards") or 0 for r in rs)
            entry |= {"mean_accepted_length": entry["tokens"] / forwards if forwards else None,
                      "acceptance_rate": None, "acceptance_by_position": [], "draft_seconds": None,
                      "verify_seconds": None, "other_seconds": None}
            if twin is not None and (cat, twin) in groups:
                entry["specdec_config"] = twin
                entry["specdec_config_tokens_per_second"] = _tps(groups[(cat, twin)])
        out[f"{cat}|{name}"] = entry
    return out


def config_names(summary: dict) -> list[str]:
    """Configs in run order, ours first, each engine's plain baseline first."""
    rows = [v for v in summary.values() if v["category"] == "overall"]
    rows.sort(key=lambda v: (v["engine"] != "specdec", v["method"] != "plain"))
    return [v["config"] for v in rows]


def categories(summary: dict) -> list[str]:
    return category_order([v["category"] for v in summary.values() if v["category"] != "overall"]) + ["overall"]


def mismatch_count(summary: dict) -> int:
    """Our outputs that differ from our plain decoding (the peer's differences are informational)."""
    return sum(v["mismatches"] or 0 for v in summary.values()
               if v["category"] == "overall" and v["engine"] == "specdec")


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _cell(v: dict) -> str:
    if v["method"] == "plain":
        return f"{v['tokens_per_second']:.2f} tok/s"
    return f"{_fmt(v['speedup'], '.2f', 'x')} / {_fmt(v['mean_accepted_length'], '.2f')}"


def markdown(summary: dict) -> str:
    """Spec-Bench's layout: categories as columns; plain rows give tok/s, the others speedup / mean
    accepted tokens (bonus included), each over its own engine's plain decoding."""
    cats, names = categories(summary), config_names(summary)
    lines = ["| engine | config | " + " | ".join(cats) + " |", "|---|---|" + "---|" * len(cats)]
    for name in names:
        v0 = summary[f"overall|{name}"]
        cells = [_cell(summary[f"{c}|{name}"]) if f"{c}|{name}" in summary else "-" for c in cats]
        label = name.removeprefix("hf ") if v0["engine"] == "hf" else name
        lines.append(f"| {ENGINE_LABEL[v0['engine']]} | {label} | " + " | ".join(cells) + " |")
    lines += ["", "| engine | config | tok/s | speedup | vs specdec plain | mean accepted | acceptance | "
              "draft s | verify s | other s (incl. prefill) | identical to plain |", "|---" * 11 + "|"]
    for name in names:
        v = summary[f"overall|{name}"]
        lines.append(f"| {ENGINE_LABEL[v['engine']]} | {name} | {v['tokens_per_second']:.2f} | "
                     f"{_fmt(v['speedup'], '.2f', 'x')} | {_fmt(v['speedup_vs_specdec_plain'], '.2f', 'x')} | "
                     f"{_fmt(v['mean_accepted_length'], '.2f')} | {_fmt(v['acceptance_rate'], '.1%')} | "
                     f"{_fmt(v['draft_seconds'], '.1f')} | {_fmt(v['verify_seconds'], '.1f')} | "
                     f"{_fmt(v['other_seconds'], '.1f')} | {_identity(v)} |")
    return "\n".join(lines)


def _identity(v: dict) -> str:
    if v["mismatches"] is None:
        return "not checked"
    if v["mismatches"] == 0:
        return f"yes ({v['checked']})"
    kind = "MISMATCH" if v["engine"] == "specdec" else "differ (info)"
    return f"{v['mismatches']}/{v['checked']} {kind}"


def print_tables(summary: dict, notes: list[str], console=None) -> None:
    """The terminal report (rich): per-category table, then the overall details."""
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415
    console = console or Console()
    cats, names = categories(summary), config_names(summary)
    t = Table(title="plain: tok/s; speculative: speedup over its engine's plain / mean accepted tokens")
    t.add_column("engine")
    t.add_column("config")
    for c in cats:
        t.add_column(c, justify="right")
    for name in names:
        v0 = summary[f"overall|{name}"]
        cells = []
        for c in cats:
            v = summary.get(f"{c}|{name}")
            bad = v is not None and v["engine"] == "specdec" and v["mismatches"]
            cells.append("-" if v is None else f"[bold red]MISMATCH {v['mismatches']}[/]" if bad else _cell(v))
        t.add_row(ENGINE_LABEL[v0["engine"]], name, *cells)
    console.print(t)
    d = Table(title="overall")
    for col in ("engine", "config", "tok/s", "speedup", "vs specdec plain", "mean accepted", "acceptance",
                "draft s", "verify s", "other s (incl. prefill)", "identical to plain"):
        d.add_column(col, justify="left" if col in ("engine", "config") else "right")
    for name in names:
        v = summary[f"overall|{name}"]
        ident = _identity(v)
        if v["engine"] == "specdec" and v["mismatches"]:
            ident = f"[bold red]{ident}[/]"
        d.add_row(ENGINE_LABEL[v["engine"]], name, f"{v['tokens_per_second']:.2f}", _fmt(v["speedup"], ".2f", "x"),
                  _fmt(v["speedup_vs_specdec_plain"], ".2f", "x"), _fmt(v["mean_accepted_length"], ".2f"),
                  _fmt(v["acceptance_rate"], ".1%"), _fmt(v["draft_seconds"], ".1f"),
                  _fmt(v["verify_seconds"], ".1f"), _fmt(v["other_seconds"], ".1f"), ident)
    console.print(d)
    for n in notes:
        console.print(n, highlight=False)


def machine_info() -> dict:
    """What ran the benchmark: CPU, cores, memory, library versions, git commit."""
    import torch  # noqa: PLC0415
    info = {"platform": platform.platform(), "python": platform.python_version(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    try:
        import transformers  # noqa: PLC0415
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        # aarch64's /proc/cpuinfo has no model name (its CPU part is a number): the architecture at least
        info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("model name")),
                           platform.processor() or platform.machine())
        mem = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()
        info["memory_gib"] = round(int(mem[1]) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        info["cpu"] = platform.processor() or platform.machine()
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                            cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info


def write_results(path: str | Path, records: list[dict], summary: dict, command: str | None = None,
                  **extra: object) -> Path:
    """results.json: the command line, machine, notes, every record and the summaries."""
    p = Path(path)
    doc = {"command": command or shlex.join(sys.argv), "argv": list(sys.argv),
           "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine_info(),
           **extra, "markdown": markdown(summary), "records": records, "summary": summary}
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc, indent=1, ensure_ascii=False), encoding="utf-8")
    except OSError as e:
        raise SpecdecError(f"cannot write results to '{p}': {e.strerror}") from e
    return p


def _palette(n: int) -> list:
    """``n`` distinct colours: matplotlib's tab10, or tab20 past ten (tab10 repeats after ten)."""
    from matplotlib import colormaps  # noqa: PLC0415
    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def plots(summary: dict, out_dir: str | Path) -> list[Path]:
    """PNG plots (matplotlib, Agg): speedup by category, acceptance by draft position, and, when K was
    swept, speedup and mean accepted length against K."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cats, names = categories(summary), config_names(summary)
    spec = [n for n in names if summary[f"overall|{n}"]["method"] != "plain"]
    written = []

    def save(fig: Figure, name: str) -> None:
        FigureCanvasAgg(fig)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        written.append(out / name)

    fig = Figure(figsize=(min(18.0, max(6.0, 1.2 * len(cats) * max(1, len(spec)) ** 0.5 + 2)), 4.6))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(spec))
    colors = _palette(len(spec))
    for i, name in enumerate(spec):
        ys = [summary.get(f"{c}|{name}", {}).get("speedup") or 0.0 for c in cats]
        hf = summary[f"overall|{name}"]["engine"] == "hf"
        ax.bar([j + (i - (len(spec) - 1) / 2) * width for j in range(len(cats))], ys, width, color=colors[i],
               label=f"{ENGINE_LABEL[summary[f'overall|{name}']['engine']]} {name.removeprefix('hf ')}",
               hatch="//" if hf else None, edgecolor="black", linewidth=0.4)
    ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cats)), cats, rotation=20)
    ax.set_ylabel("speedup over plain decoding (same engine)")
    ax.set_title("Speedup by category")
    if spec:  # beside the bars, not over them
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save(fig, "speedup_by_category.png")

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    for name in spec:
        acc = summary[f"overall|{name}"].get("acceptance_by_position") or []
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
    width_k = max((len(summary[f"overall|{n}"].get("acceptance_by_position") or []) for n in spec), default=0)
    if width_k:
        ax.set_xticks(range(1, width_k + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (accepted / drafted there)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position (all prompts)")
    if ax.lines:
        ax.legend(fontsize=8)
    save(fig, "acceptance_by_position.png")

    by_method: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for n in spec:
        v = summary[f"overall|{n}"]
        if v["k"] is not None:  # one line per method and shape (a chain and a tree of it: two lines)
            by_method[(v["engine"], re.sub(r" K=\d+", "", n.removeprefix("hf ")))].append(v)
    swept = {key: sorted(vs, key=lambda v: v["k"]) for key, vs in by_method.items() if len(vs) > 1}
    if swept:
        fig = Figure(figsize=(11, 4.2))
        a1, a2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        colors = _palette(len(swept))
        for i, ((engine, method), vs) in enumerate(swept.items()):
            label = f"{ENGINE_LABEL[engine]} {method}"
            ks = [v["k"] for v in vs]
            style = {"marker": "o", "label": label, "linestyle": "--" if engine == "hf" else "-", "color": colors[i]}
            a1.plot(ks, [v["speedup"] or 0.0 for v in vs], **style)
            a2.plot(ks, [v["mean_accepted_length"] or 0.0 for v in vs], **style)
        all_ks = sorted({v["k"] for vs in swept.values() for v in vs})
        a1.set_xticks(all_ks)
        a2.set_xticks(all_ks)
        a1.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
        a1.set(xlabel="K (draft tokens per step)", ylabel="speedup over plain", title="Speedup against K")
        a2.set(xlabel="K (draft tokens per step)", ylabel="tokens per target forward",
               title="Mean accepted length against K")
        a1.legend(fontsize=8)
        a2.legend(fontsize=8)
        save(fig, "speedup_vs_k.png")
    return written
