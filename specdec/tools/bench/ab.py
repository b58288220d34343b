"""Side-by-side A/B of two source trees, alternated so that a drift of the host's speed moves both alike.

    python -m specdec.tools.bench.ab attention A B [--shapes G,HEAD,R,KEYS ...] [--cold]
    python -m specdec.tools.bench.ab kernel MODEL (bf16|int4) ROWS CONTEXT DIR_A DIR_B [REPEATS]
    python -m specdec.tools.bench.ab products DIR_A DIR_B [N K COPIES REPEATS [ROWS]]
    python -m specdec.tools.bench.ab step TREE_A TREE_B [--layers 12] [--contexts 1024,8192]

What each measures:

- ``attention``: the native attention kernel alone (``sd_attn_rows`` in attention.c). Each kernel
  directory is built into a small C harness of its own, and for every shape both run alternately, keys
  in cache (or evicted before each call with ``--cold``): the best TSC ticks per key of one call (one kv
  head, its G query heads, R tokens), and whether the two trees' outputs are bit-identical. A shape is
  G,HEAD_SIZE,R,KEYS (a token r sees the first KEYS - R + 1 + r keys, as a verification block).
- ``kernel``: forwards of a real model. Each kernel directory is built into its own library and given
  to its own copy of the model; forwards of both alternate. Prints the median (and min) ms per forward
  and the ratio B/A.
- ``products``: the products alone. Both libraries multiply the same weights (bf16 tiles and int4 codes
  of one N x K shape, COPIES of each cycled out of cache), alternated, so neither the host's drift nor
  where a model copy sits in memory favours one (``kernel`` gives each library its own model copy; on
  an AVX2 Zen 1 that showed an 18-26% bias against the second copy). ROWS: e.g. 1,2,4,8 (default 1,4,8).
- ``step``: one forward of T=1 on a random-weight slice of a public shape at several contexts, the
  whole Python tree A against tree B (a checkout's root: ``git worktree add /tmp/old HEAD~1``). Each
  round runs the measurement once per tree, in a process of its own that imports specdec from that tree
  (PYTHONPATH, from a neutral directory), and prints the tree and, per context, the median ms of
  ``--repeats`` forwards (the context filled with random keys as ``specdec.tools.bench.step`` does).

The kernel directories of ``attention``, ``kernel`` and ``products`` hold the C sources, e.g.::

    mkdir /tmp/old && for f in attention.c forward.c qmm.c sd.h sd_avx2.h; do
        git show OLD:specdec/kernels/csrc/$f > /tmp/old/$f; done
    python -m specdec.tools.bench.ab kernel smollm2-135m int4 1,8 256 /tmp/old specdec/kernels/csrc 21

Formerly scripts/attention_ab.py, kernel_ab.py, products_ab.py and step_ab.py (the same measurements).
Not a test: the numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ATTENTION_HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <x86intrin.h>
void sd_attn_rows(const uint16_t *q, int64_t qtok, int64_t qstride, float scale, const uint16_t *k,
                  const uint16_t *v, const int64_t *tab, int64_t nkv, int64_t kh, int64_t bshift, int64_t hd,
                  int64_t G, const uint8_t *mask, int64_t mstride, const int64_t *nkeys, int64_t R, float *s,
                  int64_t *idx, float *o, uint16_t *out, int64_t otok, int64_t jfirst, const float *sinks,
                  float softcap);
int main(int argc, char **argv) {  /* G hd R L cold calls dump */
    const int64_t G = atoll(argv[1]), hd = atoll(argv[2]), R = atoll(argv[3]), L = atoll(argv[4]), nkv = 3, bshift = 4;
    const int cold = atoi(argv[5]), calls = atoi(argv[6]);
    const int64_t nblk = (L + 15) / 16 + 1, n = nblk * nkv * 16 * hd;
    uint16_t *k = aligned_alloc(64, n * 2), *v = aligned_alloc(64, n * 2), *q = aligned_alloc(64, R * G * hd * 2);
    uint16_t *out = aligned_alloc(64, R * G * hd * 2);
    srand(1);
    for (int64_t i = 0; i < n; i++) { k[i] = 0x3f80 + (rand() & 0x7f); v[i] = 0x3f00 + (rand() & 0xff); }
    for (int64_t i = 0; i < R * G * hd; i++) q[i] = (rand() & 1 ? 0xbc00 : 0x3c00) + (rand() & 0x7f);
    int64_t *tab = malloc(8 * nblk), nkeys[16];
    for (int64_t i = 0; i < nblk; i++) tab[i] = nblk - 1 - i; /* blocks out of order, as a pool hands them out */
    for (int64_t r = 0; r < R; r++) nkeys[r] = L - R + 1 + r;
    float *s = aligned_alloc(64, 4 * R * G * (L + 64)), *o = aligned_alloc(64, 4 * R * G * hd);
    int64_t *idx = aligned_alloc(64, 8 * R * (L + 64));
    const size_t fl = 64 << 20;
    char *flush = malloc(fl);
    memset(flush, 1, fl);
    volatile uint64_t sink = 0;
    uint64_t best = ~0ull;
    for (int it = 0; it < calls; it++) {
        if (cold) for (size_t i = 0; i < fl; i += 64) sink += flush[i];
        uint64_t t = __rdtsc();
        sd_attn_rows(q, G * hd, hd, 0.125f, k, v, tab, nkv, 1, bshift, hd, G, NULL, 0, nkeys, R, s, idx, o, out, G * hd, 0, NULL, 0.0f);
        t = __rdtsc() - t;
        if (t < best) best = t;
    }
    FILE *f = fopen(argv[7], "wb");
    fwrite(out, 2, R * G * hd, f);
    fclose(f);
    printf("%.2f\n", (double)best / L);
    return 0;
}
"""

# the step measurement, run by each tree's own interpreter process: it needs only what every tree's
# specdec.tools.bench.step has (SHAPES, fill_context, random_model), so an old tree measures as it is
STEP_HARNESS = r"""
import json, statistics, sys, time
import torch
import specdec
from specdec.tools.bench.step import fill_context, random_model
a = json.loads(sys.argv[1])
model = random_model(a["shape"], a["layers"], None if a["quantization"] == "none" else a["quantization"], native=True)
out = [specdec.__file__.rsplit("/specdec/", 1)[0]]
for ctx in (int(c) for c in a["contexts"].split(",")):
    cache = model.new_cache(1, ctx + 64)
    toks = torch.randint(0, model.config.vocab_size, (1, ctx + 1), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        fill_context(model, cache, toks[:, :ctx])
        block, pos = toks[:, ctx:], torch.tensor([[ctx]])
        model(block, pos, cache)
        times = []
        for _ in range(a["repeats"]):
            t = time.perf_counter()
            model(block, pos, cache)
            times.append(time.perf_counter() - t)
    out.append(f"context {ctx}: {statistics.median(times) * 1e3:.2f} ms")
    del cache
print(" | ".join(out), flush=True)
"""


def build_attention(src: Path, work: Path, tag: str) -> Path:
    (work / "harness.c").write_text(ATTENTION_HARNESS)
    exe = work / f"attn_{tag}"
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-std=gnu11", f"-I{src}", str(work / "harness.c"),
                    str(src / "attention.c"), "-o", str(exe), "-lm"], check=True)
    return exe


def attention(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        exes = [build_attention(args.a.resolve(), work, "a"), build_attention(args.b.resolve(), work, "b")]
        print("| G, head size, R, keys | A ticks/key | B ticks/key | B / A | outputs |")
        print("|---|---|---|---|---|")
        for shape in args.shapes:
            best = [float("inf"), float("inf")]
            for _ in range(args.rounds):
                for i, exe in enumerate(exes):
                    out = subprocess.run([str(exe), *shape.split(","), str(int(args.cold)), str(args.calls),
                                          str(work / f"out{i}")], check=True, capture_output=True, text=True)
                    best[i] = min(best[i], float(out.stdout))
            same = (work / "out0").read_bytes() == (work / "out1").read_bytes()
            print(f"| {shape.replace(',', ', ')} | {best[0]:.1f} | {best[1]:.1f} | {best[1] / best[0]:.2f} | "
                  f"{'identical' if same else 'DIFFER'} |", flush=True)
    return 0


def build_library(d: str):
    """The native kernels' library built from the sources in ``d`` (the flags and the list of sources
    the package's own build uses), declared as the package declares its own."""
    import ctypes

    import specdec.kernels as K

    d = Path(d).resolve()
    out = Path(f"/tmp/kernel_ab_{hashlib.sha1(str(d).encode()).hexdigest()[:8]}.so")
    flags = [f if not f.startswith("-I") else f"-I{d}" for f in K.FLAGS]
    sources = [str(d / p.name) for p in K.SOURCES if p.suffix == ".c"]  # the library's own list of sources
    subprocess.run(["gcc", *flags, *sources, "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    K._declare(lib)
    return lib


def kernel(args: argparse.Namespace) -> int:
    from specdec.tools.bench.step import load, time_forward

    name, q = args.model, (None if args.format == "bf16" else args.format)
    rows, ctx = [int(r) for r in args.rows.split(",")], args.context
    models = [load(name, q, True), load(name, q, True)]
    for m, d in zip(models, (args.dir_a, args.dir_b)):
        m.native.lib = build_library(d)
    ready, res = {}, {}
    for _ in range(args.repeats):
        for t in rows:
            for i, m in enumerate(models):
                res.setdefault((i, t), []).append(time_forward(m, t, ctx, ready))
    for t in rows:
        a, b = (statistics.median(res[(i, t)]) * 1e3 for i in (0, 1))
        ma, mb = (min(res[(i, t)]) * 1e3 for i in (0, 1))
        print(f"{name} {q or 'bf16'} ctx={ctx} T={t}: A {a:.3f} ms, B {b:.3f} ms, B/A {b / a:.3f} "
              f"(min {ma:.3f} {mb:.3f} {mb / ma:.3f})")
    return 0


def products(args: argparse.Namespace) -> int:
    import ctypes

    import torch

    from specdec.kernels import qmm
    from specdec.kernels.tiles import bf16_mat
    from specdec.quant.linear import tile_bf16

    libs = [build_library(d) for d in (args.dir_a, args.dir_b)]
    n, k, copies = args.n, args.k, args.copies
    row_counts = [int(r) for r in args.rows.split(",")]
    tiled = [tile_bf16(torch.randn(n, k).bfloat16()) for _ in range(copies)]
    codes = [qmm.from_float(torch.randn(n, k), 4) for _ in range(copies)]
    res: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(args.repeats):
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
                    lib.sd_linear(x.data_ptr(), rows, k, w.data.data_ptr(), w.scales.data_ptr(), n, w.bits, w.fmt,
                                  None, y.data_ptr(), 0)
                res.setdefault(("int4", rows, li), []).append((time.perf_counter() - t) / copies)
    for kind in ("bf16", "int4"):
        for rows in row_counts:
            a, b = (statistics.median(res[(kind, rows, i)]) * 1e3 for i in (0, 1))
            print(f"{kind} {n}x{k} rows={rows}: A {a:.3f} ms, B {b:.3f} ms, B/A {b / a:.3f}")
    return 0


def step(args: argparse.Namespace) -> int:
    trees = [str(Path(t).resolve()) for t in args.trees]
    for t in trees:
        if not (Path(t) / "specdec" / "__init__.py").is_file():
            print(f"error: {t} is not a source tree (no specdec/__init__.py in it)", file=sys.stderr)
            return 2
    spec = json.dumps({"shape": args.shape, "layers": args.layers, "quantization": args.quantization,
                       "contexts": args.contexts, "repeats": args.repeats})
    with tempfile.TemporaryDirectory() as neutral:  # not a checkout: nothing shadows PYTHONPATH's tree
        for _ in range(args.rounds):
            for tree in trees:
                env = os.environ | {"PYTHONPATH": tree}
                rc = subprocess.run([sys.executable, "-c", STEP_HARNESS, spec], cwd=neutral, env=env).returncode
                if rc:
                    return rc
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specdec.tools.bench.ab", description=__doc__.split("\n\n")[0],
                                 epilog="python -m specdec.tools.bench.ab SUBCOMMAND --help: its arguments")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("attention", help="the attention kernel alone, two kernel directories (ticks per key)")
    p.add_argument("a", type=Path, help="kernel directory A (attention.c, sd.h, sd_avx2.h)")
    p.add_argument("b", type=Path, help="kernel directory B")
    p.add_argument("--shapes", nargs="+", default=["3,64,1,256", "7,64,1,256", "6,128,1,256", "7,128,1,256",
                                                    "2,64,1,256", "3,64,4,256", "7,128,4,256", "7,128,8,300"],
                   help="G,HEAD_SIZE,R,KEYS each")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two builds per shape")
    p.add_argument("--calls", type=int, default=60, help="calls per run (the best one counts)")
    p.add_argument("--cold", action="store_true", help="evict the cache (64 MB read) before every call")
    p.set_defaults(run=attention)

    p = sub.add_parser("kernel", help="a model's forwards, two kernel directories (ms per forward)")
    p.add_argument("model")
    p.add_argument("format", help="bf16, int4, int8 (the step tool's load)")
    p.add_argument("rows", help="rows per forward, e.g. 1,8")
    p.add_argument("context", type=int, help="cached tokens")
    p.add_argument("dir_a")
    p.add_argument("dir_b")
    p.add_argument("repeats", type=int, nargs="?", default=15)
    p.set_defaults(run=kernel)

    p = sub.add_parser("products", help="the bf16 and int4 products alone, two kernel directories")
    p.add_argument("dir_a")
    p.add_argument("dir_b")
    p.add_argument("n", type=int, nargs="?", default=8960, help="output features")
    p.add_argument("k", type=int, nargs="?", default=1536, help="input features")
    p.add_argument("copies", type=int, nargs="?", default=12, help="copies of the weights cycled")
    p.add_argument("repeats", type=int, nargs="?", default=7)
    p.add_argument("rows", nargs="?", default="1,4,8")
    p.set_defaults(run=products)

    p = sub.add_parser("step", help="one forward of a random-weight slice, two Python trees (ms per forward)")
    p.add_argument("trees", nargs="+", help="checkout roots, each measured in a process of its own")
    p.add_argument("--shape", default="gemma-3-4b")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--quantization", choices=["int4", "int8", "none"], default="int4")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rounds", type=int, default=3, help="alternations of the trees")
    p.set_defaults(run=step)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
