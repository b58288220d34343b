/* Bit tests of specdec/kernels/csrc/arm/qmm_neon.c, the NEON (dotprod) quantized products, on fixed
 * pseudo-random inputs: every format (1: fp16 scale and offset per 32; 2: Q4_K's two levels; 3: Q6_K's
 * halves), both code widths, bf16 and fp32 outputs, with and without a bias, 37 columns (a partial last
 * tile) and 2304 inputs, which the small XCHUNK below splits into chunks of groups from 3 rows up (the
 * partial sums' path; the chunks end elsewhere for every row count). Checked bit for bit:
 *   - every row of every call against a scalar C reference of the same integer codes and the same
 *     float steps (fmaf, in qmm.c's order), written from the unpacked codes and scales;
 *   - every block of 1..8 rows (and 13: a block of 8 and one of 5), at two places in the batch, and the
 *     tiles computed one call each, against the rows' single-row calls;
 *   - the activations' int8 quantization (sd_quantize_rows) against a scalar one, and sd_linear.
 * Exits 0 and says how many checks passed, or 1 at the first difference.
 *
 *   aarch64-linux-gnu-gcc -O2 -march=armv8.2-a+dotprod -I specdec/kernels/csrc/arm \
 *       tests/kernels/csrc/test_qmm_neon.c -o /tmp/test_qmm_neon -lm
 *   qemu-aarch64 -L /usr/aarch64-linux-gnu /tmp/test_qmm_neon [--dump FILE]
 *
 * --dump FILE also writes each case's sd_linear call (inputs, packed weights, outputs) for
 * tests/kernels/test_neon.py, which gives the same inputs to the x86 library and compares the bits. */
#define XCHUNK (6 * 1024) /* groups per chunk: 192 at 1 row, 64 at 3, 24 at 8 (the library's XCHUNK: 256 KB) */
#include "qmm_neon.c"

#include <math.h>
#include <stdio.h>

#define MR 13 /* rows of the batch */

static uint64_t rng_state = 0x5eed5eed5eedull;
static uint64_t rnd(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static int rnd_int(int lo, int hi) { return lo + (int)(rnd() % (uint64_t)(hi - lo + 1)); } /* [lo, hi] */

/* an fp16 bit pattern: mostly normal numbers in [2^-7, 2^3), sometimes subnormal or zero */
static uint16_t rnd_f16(int signed_) {
    const int kind = rnd_int(0, 15);
    const uint16_t sign = signed_ && (rnd() & 1) ? 0x8000 : 0;
    if (kind == 0) return sign;
    const int mant = rnd_int(0, 1023);
    const int e = kind == 1 ? 0 : rnd_int(8, 17);
    return (uint16_t)(sign | (e << 10) | mant);
}

static float h2f(uint16_t h) { /* exact: no inf or NaN is made */
    const int e = (h >> 10) & 31, m = h & 1023;
    const float v = e ? ldexpf((float)(1024 + m), e - 25) : ldexpf((float)m, -24);
    return h & 0x8000 ? -v : v;
}

static uint16_t f2bf(float f) { /* nearest even (finite f) */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

typedef struct {
    int fmt, bits, N, K, out_f32, has_bias;
} Case;

typedef struct { /* the unpacked weights: what the reference reads */
    uint8_t *codes;          /* N x K */
    uint16_t *scale, *off;   /* format 1: N x G fp16 */
    uint16_t *d, *dm;        /* formats 2, 3: N x K/256 fp16 */
    int *sc, *mn;            /* format 2: N x G u8; format 3: N x 2G s8 */
    float *bias;             /* N, or NULL */
} Fields;

typedef struct { /* the packed weights: what the kernel reads (qmm.c's layout, qmm.py's pack) */
    uint8_t *w;
    uint16_t *st;
    size_t wbytes, stbytes;
} Packed;

static Fields make_fields(const Case *c) {
    const int N = c->N, K = c->K, G = K / GS, S = K / 256;
    Fields f = {0};
    f.codes = malloc((size_t)N * K);
    const int top = c->fmt == 3 ? 63 : (1 << c->bits) - 1; /* 6 bits: codes below 64 */
    for (int64_t i = 0; i < (int64_t)N * K; i++) f.codes[i] = (uint8_t)rnd_int(0, top);
    if (c->fmt == 1) {
        f.scale = malloc(sizeof(uint16_t) * N * G);
        f.off = malloc(sizeof(uint16_t) * N * G);
        for (int i = 0; i < N * G; i++) {
            f.scale[i] = rnd_f16(0);
            f.off[i] = rnd_f16(1);
        }
    } else {
        const int per = c->fmt == 2 ? G : 2 * G;
        f.d = malloc(sizeof(uint16_t) * N * S);
        f.dm = malloc(sizeof(uint16_t) * N * S);
        f.sc = malloc(sizeof(int) * N * per);
        f.mn = malloc(sizeof(int) * N * per);
        for (int i = 0; i < N * S; i++) {
            f.d[i] = rnd_f16(0);
            f.dm[i] = rnd_f16(1);
        }
        for (int i = 0; i < N * per; i++) {
            f.sc[i] = c->fmt == 2 ? rnd_int(0, 255) : rnd_int(-128, 127);
            f.mn[i] = c->fmt == 2 ? rnd_int(0, 255) : rnd_int(-128, 127);
        }
    }
    if (c->has_bias) {
        f.bias = malloc(sizeof(float) * N);
        for (int i = 0; i < N; i++) f.bias[i] = ldexpf((float)rnd_int(-1000000, 1000000), -18);
    }
    return f;
}

static Packed pack(const Case *c, const Fields *f) {
    const int N = c->N, K = c->K, G = K / GS, T = (N + TN - 1) / TN;
    const int gbytes = c->bits == 4 ? 256 : c->bits == 6 ? 384 : 512;
    Packed p;
    p.wbytes = (size_t)T * G * gbytes;
    p.w = calloc(p.wbytes, 1);
    for (int n = 0; n < N; n++) {
        const int t = n / TN, col = n % TN;
        for (int g = 0; g < G; g++) {
            uint8_t *gp = p.w + ((size_t)t * G + g) * gbytes;
            const uint8_t *q = f->codes + (size_t)n * K + g * GS;
            for (int j = 0; j < (c->bits == 8 ? 8 : 4); j++)
                for (int i = 0; i < 4; i++)
                    gp[64 * j + 4 * col + i] = c->bits == 8 ? q[4 * j + i]
                                                            : (uint8_t)((q[4 * j + i] & 15) | (q[16 + 4 * j + i] & 15) << 4);
            if (c->bits == 6) /* the high bit pairs: byte (col, i) of vector h, bits 2j: input 16h + 4j + i */
                for (int h = 0; h < 2; h++)
                    for (int i = 0; i < 4; i++) {
                        uint8_t v = 0;
                        for (int j = 0; j < 4; j++) v |= (uint8_t)((q[16 * h + 4 * j + i] >> 4) << (2 * j));
                        gp[256 + 64 * h + 4 * col + i] = v;
                    }
        }
    }
    p.stbytes = (size_t)T * 2 * st_tile_halves(c->fmt, G);
    p.st = calloc(p.stbytes, 1);
    for (int n = 0; n < N; n++) {
        const int t = n / TN, col = n % TN;
        uint8_t *tile = (uint8_t *)p.st + (size_t)t * 2 * st_tile_halves(c->fmt, G);
        if (c->fmt == 1) {
            for (int g = 0; g < G; g++) {
                ((uint16_t *)tile)[g * 32 + col] = f->scale[n * G + g];
                ((uint16_t *)tile)[g * 32 + 16 + col] = f->off[n * G + g];
            }
            continue;
        }
        const int sbytes = c->fmt == 2 ? SB_BYTES2 : SB_BYTES3;
        for (int s = 0; s < K / 256; s++) {
            uint8_t *sb = tile + (size_t)s * sbytes;
            memcpy(sb + 2 * col, &f->d[n * (K / 256) + s], 2);
            memcpy(sb + 32 + 2 * col, &f->dm[n * (K / 256) + s], 2);
            for (int gi = 0; gi < 8; gi++) {
                const int g = 8 * s + gi;
                if (c->fmt == 2) {
                    sb[64 + 32 * gi + col] = (uint8_t)f->sc[n * G + g];
                    sb[64 + 32 * gi + 16 + col] = (uint8_t)f->mn[n * G + g];
                } else {
                    for (int h = 0; h < 2; h++) {
                        sb[64 + 64 * gi + 16 * h + col] = (uint8_t)(int8_t)f->sc[n * 2 * G + 2 * g + h];
                        sb[64 + 64 * gi + 32 + 16 * h + col] = (uint8_t)(int8_t)f->mn[n * 2 * G + 2 * g + h];
                    }
                }
            }
        }
    }
    return p;
}

/* the scalar reference: row xr (its scales ar, amr) against column n, qmm.c's steps in its order */
__attribute__((optimize("fp-contract=off"))) static float reference(const Case *c, const Fields *f, const int8_t *xr,
                                                                    const float *ar, const float *amr, int n) {
    const int K = c->K, G = K / GS;
    float acc = 0.0f;
    for (int g = 0; g < G; g++) {
        const uint8_t *q = f->codes + (size_t)n * K + g * GS;
        const int8_t *x = xr + g * GS;
        int dot[2] = {0, 0}, sum[2] = {0, 0};
        for (int i = 0; i < GS; i++) {
            dot[i / 16] += (int)q[i] * (int)x[i];
            sum[i / 16] += x[i];
        }
        if (c->fmt == 3) {
            const float d = h2f(f->d[n * (K / 256) + g / 8]), dm = h2f(f->dm[n * (K / 256) + g / 8]);
            const float s = d * (float)f->sc[n * 2 * G + 2 * g], s2 = d * (float)f->sc[n * 2 * G + 2 * g + 1];
            const float m = dm * (float)f->mn[n * 2 * G + 2 * g], m2 = dm * (float)f->mn[n * 2 * G + 2 * g + 1];
            acc = fmaf(m, ar[g] * (float)sum[0], acc);
            acc = fmaf(m2, ar[g] * (float)sum[1], acc);
            acc = fmaf((float)dot[0], s * ar[g], acc);
            acc = fmaf((float)dot[1], s2 * ar[g], acc);
            continue;
        }
        float s, m;
        if (c->fmt == 1) {
            s = h2f(f->scale[n * G + g]);
            m = h2f(f->off[n * G + g]);
        } else {
            s = h2f(f->d[n * (K / 256) + g / 8]) * (float)f->sc[n * G + g];
            m = h2f(f->dm[n * (K / 256) + g / 8]) * (float)f->mn[n * G + g];
        }
        acc = fmaf(m, amr[g], acc);
        acc = fmaf((float)(dot[0] + dot[1]), s * ar[g], acc);
    }
    return acc + (f->bias ? f->bias[n] : 0.0f);
}

/* the scalar quantization of one row of activations (qmm.py's quantize_rows) */
__attribute__((optimize("fp-contract=off"))) static void ref_quantize(const uint16_t *x, int K, int8_t *q, float *a,
                                                                      float *am) {
    for (int g = 0; g < K / GS; g++) {
        float v[GS], amax = 0.0f;
        for (int i = 0; i < GS; i++) {
            const uint32_t u = (uint32_t)x[g * GS + i] << 16;
            memcpy(&v[i], &u, 4);
            amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < GS; i++) {
            const int r = (int)nearbyintf(v[i] * inv); /* nearest even */
            q[g * GS + i] = (int8_t)r;
            sum += r;
        }
        a[g] = amax / 127.0f;
        am[g] = a[g] * (float)sum;
    }
}

static long checks;
static int failed;

static void expect_same(const void *got, const void *want, size_t bytes, const char *what, const Case *c, int row) {
    checks++;
    if (failed || !memcmp(got, want, bytes)) return;
    failed = 1;
    if (c->fmt)
        fprintf(stderr, "MISMATCH: %s (format %d, %d-bit codes, N %d, K %d, %s output%s), row %d\n", what, c->fmt,
                c->bits, c->N, c->K, c->out_f32 ? "fp32" : "bf16", c->has_bias ? ", bias" : "", row);
    else
        fprintf(stderr, "MISMATCH: %s, values %d and %d of the list\n", what, row, row + 1);
    for (size_t i = 0; i < bytes; i++)
        if (((const uint8_t *)got)[i] != ((const uint8_t *)want)[i]) {
            fprintf(stderr, "  first difference at byte %zu: %02x, expected %02x\n", i, ((const uint8_t *)got)[i],
                    ((const uint8_t *)want)[i]);
            break;
        }
}

/* rows [r0, r0 + R) of the batch through sd_qmm_range, all tiles at once (tile < 0) or tile by tile */
static void run_rows(const Case *c, const Packed *p, const int8_t *xq, const float *a, const float *am, int r0, int R,
                     int by_tile, void *y, float *part) {
    const int K = c->K, G = K / GS, T = (c->N + TN - 1) / TN;
    for (int t0 = 0; t0 < T; t0 += by_tile ? 1 : T)
        sd_qmm_range(xq + (size_t)r0 * K, a + r0 * G, am + r0 * G, R, K, p->w, p->st, c->N, c->bits, c->fmt,
                     NULL, y, c->out_f32, part, t0, by_tile ? t0 + 1 : T);
}

static void run_case(const Case *c, FILE *dump) {
    const int N = c->N, K = c->K, G = K / GS, T = (N + TN - 1) / TN;
    const size_t esz = c->out_f32 ? 4 : 2, ybytes = (size_t)N * esz;
    Fields f = make_fields(c);
    Packed p = pack(c, &f);
    int8_t *xq = malloc((size_t)MR * K);
    float *a = malloc(sizeof(float) * MR * G), *am = malloc(sizeof(float) * MR * G);
    for (int r = 0; r < MR; r++)
        for (int g = 0; g < G; g++) {
            int sum = 0;
            for (int i = 0; i < GS; i++) sum += xq[(size_t)r * K + g * GS + i] = (int8_t)rnd_int(-127, 127);
            a[r * G + g] = ldexpf(1.0f + (float)rnd_int(0, 1 << 20) / (float)(1 << 20), -rnd_int(4, 12));
            am[r * G + g] = a[r * G + g] * (float)sum;
        }
    uint8_t *want = malloc(MR * ybytes), *one = malloc(MR * ybytes), *got = malloc(MR * ybytes);
    float *part = malloc(sizeof(float) * T * MR * 16);
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < N; n++) {
            const float v = reference(c, &f, xq + (size_t)r * K, a + r * G, am + r * G, n);
            if (c->out_f32)
                memcpy(want + r * ybytes + 4 * n, &v, 4);
            else {
                const uint16_t h = f2bf(v);
                memcpy(want + r * ybytes + 2 * n, &h, 2);
            }
        }
    /* the reference holds the bias; the products are checked without it, then with it below */
    Case nob = *c;
    nob.has_bias = 0;
    Fields fb = f;
    fb.bias = NULL;
    uint8_t *want0 = malloc(MR * ybytes);
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < N; n++) {
            const float v = reference(&nob, &fb, xq + (size_t)r * K, a + r * G, am + r * G, n);
            if (c->out_f32)
                memcpy(want0 + r * ybytes + 4 * n, &v, 4);
            else {
                const uint16_t h = f2bf(v);
                memcpy(want0 + r * ybytes + 2 * n, &h, 2);
            }
        }
    for (int r = 0; r < MR; r++) { /* single rows */
        run_rows(c, &p, xq, a, am, r, 1, 0, one + r * ybytes, part);
        expect_same(one + r * ybytes, want0 + r * ybytes, ybytes, "a single row against the scalar reference", c, r);
    }
    const int sizes[] = {1, 2, 3, 4, 5, 6, 7, 8, MR};
    for (int si = 0; si < (int)(sizeof(sizes) / sizeof(sizes[0])); si++) {
        const int R = sizes[si];
        const int starts[2] = {0, MR - R};
        for (int k = 0; k < (R == MR ? 1 : 2); k++) {
            run_rows(c, &p, xq, a, am, starts[k], R, 0, got, part);
            for (int i = 0; i < R; i++)
                expect_same(got + i * ybytes, one + (starts[k] + i) * ybytes, ybytes, "a row of a block against its single-row call",
                            c, starts[k] + i);
        }
    }
    run_rows(c, &p, xq, a, am, 0, MR, 1, got, part); /* tile by tile */
    for (int r = 0; r < MR; r++)
        expect_same(got + r * ybytes, one + r * ybytes, ybytes, "a row computed tile by tile against its single-row call", c, r);
    /* the whole call from bf16 activations: sd_quantize_rows and sd_linear (with the bias, if any) */
    uint16_t *x = malloc(sizeof(uint16_t) * MR * K);
    for (int i = 0; i < MR * K; i++) {
        const float v = ldexpf((float)rnd_int(-(1 << 16), 1 << 16), -16 - rnd_int(0, 6));
        x[i] = f2bf(v);
    }
    int8_t *xq2 = malloc((size_t)MR * K), *rq = malloc((size_t)MR * K);
    float *a2 = malloc(sizeof(float) * MR * G * 2), *ra = malloc(sizeof(float) * MR * G * 2);
    sd_quantize_rows(x, MR, K, xq2, a2, a2 + MR * G);
    for (int r = 0; r < MR; r++) ref_quantize(x + (size_t)r * K, K, rq + (size_t)r * K, ra + r * G, ra + MR * G + r * G);
    expect_same(xq2, rq, (size_t)MR * K, "sd_quantize_rows' codes against the scalar quantization", c, -1);
    expect_same(a2, ra, sizeof(float) * MR * G * 2, "sd_quantize_rows' scales against the scalar quantization", c, -1);
    for (int r = 0; r < MR; r++)
        for (int n = 0; n < N; n++) {
            const float v = reference(c, &f, rq + (size_t)r * K, ra + r * G, ra + MR * G + r * G, n);
            if (c->out_f32)
                memcpy(want + r * ybytes + 4 * n, &v, 4);
            else {
                const uint16_t h = f2bf(v);
                memcpy(want + r * ybytes + 2 * n, &h, 2);
            }
        }
    for (int M = 1; M <= MR; M += MR - 1) {
        for (int r0 = 0; r0 < MR; r0 += M) {
            if (sd_linear(x + (size_t)r0 * K, M, K, p.w, p.st, N, c->bits, c->fmt, f.bias, got, c->out_f32) != 0) {
                fprintf(stderr, "sd_linear: out of memory\n");
                exit(1);
            }
            for (int i = 0; i < M; i++)
                expect_same(got + i * ybytes, want + (r0 + i) * ybytes, ybytes, "sd_linear against the scalar reference", c, r0 + i);
        }
    }
    if (dump) { /* the last sd_linear call (all MR rows): what the x86 library is given in test_neon.py */
        const int64_t head[10] = {c->fmt, c->bits, MR, N, K, c->out_f32, c->has_bias, (int64_t)p.wbytes, (int64_t)p.stbytes,
                                  (int64_t)(MR * ybytes)};
        fwrite(head, sizeof(head), 1, dump);
        fwrite(x, sizeof(uint16_t), (size_t)MR * K, dump);
        fwrite(p.w, 1, p.wbytes, dump);
        fwrite(p.st, 1, p.stbytes, dump);
        if (f.bias) fwrite(f.bias, sizeof(float), N, dump);
        fwrite(got, 1, MR * ybytes, dump);
    }
    free(x), free(xq2), free(rq), free(a2), free(ra), free(want0);
    free(want), free(one), free(got), free(part), free(xq), free(a), free(am), free(p.w), free(p.st);
    free(f.codes), free(f.scale), free(f.off), free(f.d), free(f.dm), free(f.sc), free(f.mn), free(f.bias);
}

/* the outputs' rounding to bf16 on the values where it matters: ties (to even, both ways), just off
 * them, the largest finite floats, infinities and NaN (-> 0x7fc0, as the AVX2 rung) */
static void check_rounding(void) {
    const uint32_t u[] = {0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u, 0xbf808000u, 0xbf818000u, 0x00008000u,
                          0x00018000u, 0x7f7f7fffu, 0x7f7f8000u, 0xff7f7fffu, 0x7f800000u, 0xff800000u, 0x7fc00001u,
                          0xffc00000u, 0x80000000u, 0x00000000u, 0x12345678u};
    const Case c = {0, 0, 0, 0, 0, 0};
    for (size_t i = 0; i < sizeof(u) / sizeof(u[0]); i += 2) {
        float f[4] = {0};
        uint16_t got[4], want[4] = {0};
        for (int k = 0; k < 2; k++) memcpy(&f[k], &u[i + k < sizeof(u) / sizeof(u[0]) ? i + k : i], 4);
        vst1_u16(got, bf16x4(vld1q_f32(f)));
        for (int k = 0; k < 4; k++) want[k] = f[k] != f[k] ? 0x7fc0 : f2bf(f[k]);
        expect_same(got, want, sizeof(got), "the rounding of outputs to bf16", &c, (int)i);
    }
}

int main(int argc, char **argv) {
    FILE *dump = NULL;
    if (argc == 3 && !strcmp(argv[1], "--dump")) {
        if (!(dump = fopen(argv[2], "wb"))) {
            perror(argv[2]);
            return 2;
        }
    } else if (argc != 1) {
        fprintf(stderr, "usage: %s [--dump FILE]\n", argv[0]);
        return 2;
    }
    const int kinds[8][2] = {{1, 4}, {1, 6}, {1, 8}, {2, 4}, {2, 6}, {2, 8}, {3, 6}, {3, 8}}; /* (format, bits) */
    check_rounding();
    int cases = 0;
    for (int k = 0; k < 8 && !failed; k++)
        for (int out_f32 = 0; out_f32 < 2; out_f32++)
            for (int has_bias = 0; has_bias < 2; has_bias++) {
                const Case c = {kinds[k][0], kinds[k][1], 37, 2304, out_f32, has_bias};
                run_case(&c, dump);
                cases++;
            }
    if (dump) fclose(dump);
    if (failed) return 1;
    printf("test_qmm_neon: %d cases, %ld checks, all bit-identical\n", cases, checks);
    return 0;
}
