"""Same-process A/B of two trees of the native kernels' sources: each is built into its own library and
given to its own copy of the model; forwards of both alternate, so a drift of the host's bandwidth moves
both alike. Prints the median (and min) ms per forward and the ratio B/A.

    python scripts/kernel_ab.py MODEL (bf16|int4) ROWS CONTEXT DIR_A DIR_B [REPEATS]
    git show OLD:specdec/kernels/csrc/forward.c > /tmp/old/forward.c   # (and sd.h, sd_avx2.h, qmm.c, attention.c)
    python scripts/kernel_ab.py smollm2-135m int4 1,8 256 /tmp/old specdec/kernels/csrc 21
"""
import ctypes
import hashlib
import statistics
import subprocess
import sys
from pathlib import Path

import specdec.kernels as K
from specdec.tools.bench.step import load, time_forward


def build(d: str) -> ctypes.CDLL:
    d = Path(d).resolve()
    out = Path(f"/tmp/kernel_ab_{hashlib.sha1(str(d).encode()).hexdigest()[:8]}.so")
    flags = [f if not f.startswith("-I") else f"-I{d}" for f in K.FLAGS]
    sources = [str(d / p.name) for p in K.SOURCES if p.suffix == ".c"]  # the library's own list of sources
    subprocess.run(["gcc", *flags, *sources, "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    K._declare(lib)
    return lib


def main() -> None:
    name, q = sys.argv[1], (None if sys.argv[2] == "bf16" else sys.argv[2])
    rows, ctx = [int(r) for r in sys.argv[3].split(",")], int(sys.argv[4])
    repeats = int(sys.argv[7]) if len(sys.argv) > 7 else 15
    models = [load(name, q, True), load(name, q, True)]
    for m, d in zip(models, sys.argv[5:7]):
        m.native.lib = build(d)
    ready, res = {}, {}
    for _ in range(repeats):
        for t in rows:
            for i, m in enumerate(models):
                res.setdefault((i, t), []).append(time_forward(m, t, ctx, ready))
    for t in rows:
        a, b = (statistics.median(res[(i, t)]) * 1e3 for i in (0, 1))
        ma, mb = (min(res[(i, t)]) * 1e3 for i in (0, 1))
        print(f"{name} {q or 'bf16'} ctx={ctx} T={t}: A {a:.3f} ms, B {b:.3f} ms, B/A {b / a:.3f} "
              f"(min {ma:.3f} {mb:.3f} {mb / ma:.3f})")


if __name__ == "__main__":
    main()
