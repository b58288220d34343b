"""Side-by-side A/B of two trees of the native attention kernel (``sd_attn_rows`` in attention.c): each
is built into a small C harness of its own, and for every shape both run alternately, keys in cache (or
evicted before each call with ``--cold``): the best TSC ticks per key of one call (one kv head, its G query
heads, R tokens), and whether the two trees' outputs are bit-identical.

    git show OLD:specdec/kernels/csrc/attention.c > /tmp/old/attention.c   # (and sd.h, sd_avx2.h)
    python scripts/attention_ab.py /tmp/old specdec/kernels/csrc --shapes 3,64,1,256 7,128,4,256

A shape is G,HEAD_SIZE,R,KEYS (a token r sees the first KEYS - R + 1 + r keys, as a verification block).
"""
import argparse
import subprocess
import tempfile
from pathlib import Path

HARNESS = r"""
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


def build(src: Path, work: Path, tag: str) -> Path:
    (work / "harness.c").write_text(HARNESS)
    exe = work / f"attn_{tag}"
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-std=gnu11", f"-I{src}", str(work / "harness.c"),
                    str(src / "attention.c"), "-o", str(exe), "-lm"], check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--shapes", nargs="+", default=["3,64,1,256", "7,64,1,256", "6,128,1,256", "7,128,1,256",
                                                     "2,64,1,256", "3,64,4,256", "7,128,4,256", "7,128,8,300"])
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two builds per shape")
    ap.add_argument("--calls", type=int, default=60, help="calls per run (the best one counts)")
    ap.add_argument("--cold", action="store_true", help="evict the cache (64 MB read) before every call")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        exes = [build(args.a.resolve(), work, "a"), build(args.b.resolve(), work, "b")]
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


if __name__ == "__main__":
    main()
