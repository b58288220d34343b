"""Kernel benchmark: time per weight matrix for 1-16 rows, bf16 / int8 / int4 / ours, against bandwidth.

    python -m specdec.tools.bench.kernels --output results/kernels.json [--shape 8960x1536] [--rows 1,2,4,8,16]

Each kind gets enough copies of the matrix to fill ``--pool-gib`` and the timed loop cycles through
them, so no weight is in cache when it is read (the situation of a decode step). Reported: median
milliseconds per matrix, cost relative to one row of the same kind, and the weight bytes read per
second against the machine's read bandwidth measured in the same run. Not a test.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec import kernels
from specdec.tools.bench.runtime import read_bandwidth, read_bandwidth_avx512
from specdec.kernels import qmm
from specdec.quant.linear import Linear


def _bf16_linear(w: torch.Tensor):
    return (lambda x: F.linear(x, w)), w.numel() * 2


def _bf16_packed(w: torch.Tensor):
    lin = Linear(w.shape[1], w.shape[0], dtype=torch.bfloat16)
    lin.weight.data.copy_(w)
    if not lin.pack():
        return None
    return lin, w.numel() * 2


def _torch_int8(w: torch.Tensor):
    scale = w.float().abs().amax(1).clamp(min=1e-8) / 127
    codes = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    s = scale.to(torch.bfloat16)
    return (lambda x: torch.ops.aten._weight_int8pack_mm(x, codes, s)), codes.numel() + 2 * s.numel()


def _torch_int4(w: torch.Tensor):
    """PyTorch's own int4 kernel (asymmetric, group 32, bf16 scales and zeros (K/32, N, 2))."""
    n, k = w.shape
    g = w.float().reshape(n, k // 32, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-8) / 15
    codes = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    sz = torch.cat([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    return ((lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)),
            packed.numel() * packed.element_size() + sz.numel() * 2)


def _ours(bits: int):
    def make(w: torch.Tensor):
        qw = qmm.from_float(w, bits)
        return (lambda x: qmm.linear(x, qw)), qw.nbytes
    return make


KINDS = {
    "bf16 F.linear": _bf16_linear,
    "bf16 oneDNN packed": _bf16_packed,
    "int8 torch": _torch_int8,
    "int4 torch": _torch_int4,
    "int8 specdec": _ours(8),
    "int4 specdec": _ours(4),
}


def time_kind(make, shape: tuple[int, int], rows: list[int], pool_gib: float, repeats: int) -> dict | None:
    """Median ms per matrix for each row count, cycling through copies that overflow the caches."""
    n, k = shape
    first = make(torch.randn(n, k, dtype=torch.bfloat16) * 0.02)
    if first is None:
        return None
    fns, nbytes = [first[0]], first[1]
    copies = max(2, int(pool_gib * 2**30 / nbytes))
    fns += [make(torch.randn(n, k, dtype=torch.bfloat16) * 0.02)[0] for _ in range(copies - 1)]
    out = {}
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            for f in fns[:2]:
                f(x)
            per = []
            for _ in range(repeats):
                t = time.perf_counter()
                for f in fns:
                    f(x)
                per.append((time.perf_counter() - t) / len(fns) * 1e3)
            out[m] = statistics.median(per)
    return {"bytes": nbytes, "copies": copies, "ms": out}


def markdown(res: dict) -> str:
    rows = res["rows"]
    lines = [f"| kind | bytes/matrix | " + " | ".join(f"{m} row{'s' if m > 1 else ''}" for m in rows)
             + " | GB/s at 1 row |", "|---|---|" + "---|" * len(rows) + "---|"]
    for name, r in res["kinds"].items():
        if r is None:
            lines.append(f"| {name} | n/a |" + " |" * (len(rows) + 1))
            continue
        base = r["ms"][rows[0]]
        cells = [f"{r['ms'][m]:.3f} ms ({r['ms'][m] / base:.2f}x)" for m in rows]
        lines.append(f"| {name} | {r['bytes'] / 1e6:.1f} MB | " + " | ".join(cells)
                     + f" | {r['bytes'] / base / 1e6:.1f} |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in res["kinds"].items():
        if r is not None:
            ax.plot(res["rows"], [r["ms"][m] for m in res["rows"]], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(res["rows"], [str(m) for m in res["rows"]])
    ax.set_xlabel("rows (tokens) per product")
    ax.set_ylabel("ms per matrix")
    ax.set_title(f"{res['shape'][0]}x{res['shape'][1]} weight, cycled out of cache")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.tools.bench.kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8960x1536", help="out x in features of the weight (default 8960x1536)")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, from: " + ", ".join(KINDS))
    ap.add_argument("--pool-gib", type=float, default=0.5, help="weight copies cycled per kind (GiB)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--output", default=None, help="results JSON (a PNG plot is written beside it)")
    a = ap.parse_args(argv)
    try:
        n, k = (int(v) for v in a.shape.lower().split("x"))
        rows = [int(v) for v in a.rows.split(",")]
        qmm.check_shape(n, k)
        if any(m < 1 for m in rows):
            raise ValueError("rows must be positive")
        kinds = [s.strip() for s in a.kinds.split(",")]
        bad = [s for s in kinds if s not in KINDS]
        if bad:
            raise ValueError(f"unknown kind {bad[0]!r}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    res = {"shape": [n, k], "rows": rows, "threads": torch.get_num_threads(),
           "native_kernels": kernels.library() is not None, "native_reason": kernels.reason(),
           "bandwidth_gb_s_torch_sum": read_bandwidth(), "bandwidth_gb_s_avx512": read_bandwidth_avx512(),
           "command": "python -m specdec.tools.bench.kernels " + " ".join(argv if argv is not None else sys.argv[1:]),
           "kinds": {}}
    for name in kinds:
        print(f"timing {name} ...", file=sys.stderr, flush=True)
        res["kinds"][name] = time_kind(KINDS[name], (n, k), rows, a.pool_gib, a.repeats)
    print(f"read bandwidth: {res['bandwidth_gb_s_torch_sum']:.1f} GB/s (torch sum), "
          f"{res['bandwidth_gb_s_avx512'] or float('nan'):.1f} GB/s (AVX-512 loads)")
    print(markdown(res))
    if a.output:
        out = Path(a.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
        plot(res, out.with_suffix(".png"))
        print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
