"""The families' step table in Markdown from the reports `scripts/families_step.sh` wrote (one JSON per row).

    python -m specdec.tools.bench.families_table docs/bench/families-whole

One line per report in the order the script ran them (DIR/order.txt, else the files' times): the shape, its weights,
MB of weights and of cached keys and values a T=1 forward reads, the read probe of that run, T=1 ms, the
fraction of the read limit, T=4 / T=1, and the same ratio of the reference row (``qwen2.5-1.5b``) run
nearest in time with the same weights, so each family sits beside a reference measured on the same host
minutes apart.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.tools.bench.projection import ms  # a report's ms at T rows

REFERENCE = "qwen2.5-1.5b"


def load(directory: Path) -> list[tuple[str, dict, float]]:
    """(name, report, when) per report, in the order they ran: by the last line naming each in order.txt
    (families_step.sh writes one as each row ends), else by the files' modification times."""
    files = {p.stem: p for p in directory.glob("*.json")}
    order = directory / "order.txt"
    if order.is_file():
        last = {name: i for i, name in enumerate(order.read_text().split())}
        when = {name: float(last.get(name, -1)) for name in files}
    else:
        when = {name: p.stat().st_mtime for name, p in files.items()}
    return [(name, json.loads(files[name].read_text()), when[name]) for name in sorted(files, key=when.get)]


def ratio(report: dict) -> float | None:
    one, four = ms(report, 1), ms(report, 4)
    return four / one if one and four else None


def shape(report: dict) -> str:
    return report["model"].split(" (")[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="the reports of scripts/families_step.sh (its OUT_DIR)")
    a = ap.parse_args(argv)
    if not a.dir.is_dir():
        print(f"error: {a.dir} is not a directory", file=sys.stderr)
        return 2
    reports = load(a.dir)
    if not reports:
        print(f"no reports (*.json) in {a.dir}", file=sys.stderr)
        return 2
    refs = [(name, r, t) for name, r, t in reports if shape(r) == REFERENCE]
    print("| shape | weights | MB of weights | MB of keys read | read probe | T=1 ms | fraction of the read limit "
          "| T=4 / T=1 | reference's T=4 / T=1 beside it |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r, t in reports:
        q = ratio(r)
        if q is None:
            continue
        one = r["rows"]["native/1"]
        kv = r["kv_bytes_by_rows"]["1"] / 1e6
        beside = ""
        if shape(r) != REFERENCE:
            same = [(rt, rn, rr) for rn, rr, rt in refs if rr["format"] == r["format"]]
            near = [v for v in same if v[0] < t][-1:] + [v for v in same if v[0] > t][:1]  # just before, after
            beside = " / ".join(f"{ratio(rr):.2f} ({rn})" for _, rn, rr in near)
        print(f"| {name} | {r['format']} | {r['bytes'] / 1e6:,.0f} | {kv:,.0f} | {r['bandwidth_gbs']:.1f} GB/s "
              f"| {one['ms']:.1f} | {one['fraction']:.2f} | {q:.2f} | {beside} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
