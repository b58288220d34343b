"""Same-process A/B of two trees of the native kernels' sources on the products alone: both libraries
multiply the same weights (bf16 tiles and int4 codes of one shape, cycled out of cache), alternated, so
neither the host's drift nor where a model copy sits in memory favours one (scripts/kernel_ab.py gives
each library its own model copy; on an AVX2 Zen 1 that showed an 18-26% bias against the second copy).

    python scripts/products_ab.py DIR_A DIR_B [N K COPIES REPEATS [ROWS]]   # ROWS: e.g. 1,2,4,8 (default 1,4,8)
    git show OLD:specdec/kernels/csrc/qmm.c > /tmp/old/qmm.c   # (and sd.h, sd_avx2.h, attention.c, forward.c)
    python scripts/products_ab.py /tmp/old specdec/kernels/csrc
"""
import ctypes
import statistics
import sys
import time

import torch

from kernel_ab import build
from specdec.kernels import qmm
from specdec.kernels.tiles import bf16_mat
from specdec.models.linear import tile_bf16


def main() -> None:
    libs = [build(d) for d in sys.argv[1:3]]
    n, k, copies, repeats = (int(v) for v in (sys.argv[3:7] + ["8960", "1536", "12", "7"][len(sys.argv[3:7]):]))
    row_counts = [int(r) for r in sys.argv[7].split(",")] if len(sys.argv) > 7 else [1, 4, 8]
    tiled = [tile_bf16(torch.randn(n, k).bfloat16()) for _ in range(copies)]
    codes = [qmm.from_float(torch.randn(n, k), 4) for _ in range(copies)]
    res: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(repeats):
        for rows in row_counts:
            x = torch.randn(rows, k).bfloat16()
            y = torch.empty(rows, n, dtype=torch.bfloat16)
            for li, lib in enumerate(libs):
                t = time.perf_counter()
                for w in tiled:
                    lib.sd_matmul(ctypes.byref(bf16_mat(w, n, k, None)), x.data_ptr(), rows, y.data_ptr(), 0, None, 0)
                res.setdefault(("bf16", rows, li), []).append((time.perf_counter() - t) / copies)
                t = time.perf_counter()
                for w in codes:
                    lib.sd_linear(x.data_ptr(), rows, k, w.data.data_ptr(), w.scales.data_ptr(), n, 4, None,
                                  y.data_ptr(), 0)
                res.setdefault(("int4", rows, li), []).append((time.perf_counter() - t) / copies)
    for kind in ("bf16", "int4"):
        for rows in row_counts:
            a, b = (statistics.median(res[(kind, rows, i)]) * 1e3 for i in (0, 1))
            print(f"{kind} {n}x{k} rows={rows}: A {a:.3f} ms, B {b:.3f} ms, B/A {b / a:.3f}")


if __name__ == "__main__":
    main()
