"""A hybrid's verification block against a dense model of its size, timed side by side in one run.

    python -m specdec.tools.bench.hybrid_step --rows 1,2,3,4,5,6,7,8,9 [--quantization int4] [--output F.json]

Builds two random-weight models at whole depth: Qwen3.5-0.8B's shape (18 gated delta-net layers, 6
attention layers) and the same shape with attention in every layer (``qwen3.5-0.8b-dense`` in the step
tool), on the path the engine runs them (native where it can). For each block of T = K + 1 tokens of one
sequence after ``--context`` tokens, the two forwards are timed interleaved (the step tool's ``measure``:
median of ``--repeats``); the hybrid's block writes the state after each of its tokens to the ring, as
verification does. Prints per T: ms of each, their ratio, the weight bytes each forward reads and the
fraction of the read limit each reaches (the machine's read bandwidth measured before and after).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from specdec.tools.bench.runtime import read_bandwidth_avx512, write_report
from specdec.tools.bench.step import block_bytes, measure, random_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,9")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--quantization", default=None, choices=[None, "int4", "int8"])
    ap.add_argument("--output", type=Path, default=None)
    a = ap.parse_args(argv)
    rows = [int(r) for r in a.rows.split(",")]
    bw = read_bandwidth_avx512()
    models = {name: random_model(shape, 24, a.quantization, native=True)
              for name, shape in (("hybrid", "qwen3.5-0.8b"), ("dense", "qwen3.5-0.8b-dense"))}
    paths = {name: "native" if m.native is not None else "PyTorch" for name, m in models.items()}
    times = measure(models, rows, a.context, a.repeats)
    after = read_bandwidth_avx512()
    bw = (bw + after) / 2 if bw and after else bw
    nbytes = {name: block_bytes(m, 1, a.context) for name, m in models.items()}
    fmt = a.quantization or "bf16"
    print(f"Qwen3.5-0.8B shape, random weights, 24 layers, {fmt}; hybrid ({paths['hybrid']} path) reads "
          f"{nbytes['hybrid'] / 1e6:.0f} MB of weights per forward, dense ({paths['dense']}) "
          f"{nbytes['dense'] / 1e6:.0f} MB; read bandwidth {bw:.1f} GB/s; context {a.context}")
    print("| T | hybrid ms | dense ms | hybrid / dense | hybrid fraction of read limit | dense fraction | "
          "hybrid T / T=1 | dense T / T=1 |")
    print("|---|---|---|---|---|---|---|---|")
    report = {"format": fmt, "paths": paths, "bytes": nbytes, "bandwidth_gbs": bw, "context": a.context, "rows": {}}
    for t in rows:
        h, d = times[("hybrid", t)] * 1e3, times[("dense", t)] * 1e3
        fh = nbytes["hybrid"] / (bw * 1e9) * 1e3 / h if bw else float("nan")
        fd = nbytes["dense"] / (bw * 1e9) * 1e3 / d if bw else float("nan")
        h1, d1 = times[("hybrid", rows[0])] * 1e3, times[("dense", rows[0])] * 1e3
        print(f"| {t} | {h:.1f} | {d:.1f} | {h / d:.2f} | {fh:.2f} | {fd:.2f} | {h / h1:.2f} | {d / d1:.2f} |")
        report["rows"][t] = {"hybrid_ms": h, "dense_ms": d, "ratio": h / d, "hybrid_fraction": fh,
                             "dense_fraction": fd}
    if a.output:
        write_report(a.output, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
