/* qmm.c's quantized products (formats 1-3) for AArch64: NEON with the dot-product extension (sdot;
 * optional in Armv8.2-A, in every Armv8.4-A core: Neoverse N1 and later, Apple M1 and later, Graviton 2
 * and later). The same layouts as qmm.c's (its header comment says them), the same exact integer group
 * dots and the same float steps in the same order, so every result is bit for bit the x86 rungs'.
 *
 * The first piece of an Arm rung, not yet part of the library: the library's other kernels (attention,
 * the forward, experts, recurrent layers, bf16 products) have no NEON version, so aarch64 runs the PyTorch
 * path, and specdec.kernels only compiles this file (--check-all). tests/kernels/csrc/test_qmm_neon.c
 * checks it (tests/kernels/test_neon.py: cross-compiled and run under qemu-user on x86 machines).
 *
 * What changes from the x86 rungs is the shape of the registers, not the arithmetic:
 *   - a tile's 16 columns are four quads of 4 (one int32/float lane per column); the 16 bytes at
 *     64 j + 16 v of a group hold inputs 4j..4j+3 of columns 4v..4v+3, which is what sdot by lane takes;
 *   - sdot multiplies s8 by s8: 4-bit codes and format 3's (below 64) are s8 as they are; 8-bit codes
 *     enter as q - 128 (the top bit flipped) and the dot gets 128 * sum(x) back: exact, the same integer;
 *   - outputs round to bf16 to nearest even as sd_avx2.h's sd8_rne (a NaN becomes the quiet NaN 0x7fc0).
 */
#include <arm_neon.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if !defined(__aarch64__) || !defined(__ARM_FEATURE_DOTPROD)
#error "qmm_neon.c needs AArch64 with the dot-product extension (-march=armv8.2-a+dotprod or later)"
#endif

#define GS 32 /* inputs per group */
#define TN 16 /* columns per tile */
#define RB 8  /* rows per register block */
#define PFG 8 /* groups read ahead */
#define SB_BYTES2 320
#define SB_BYTES3 576

static inline int64_t st_tile_halves(int fmt, int64_t G) { /* in uint16 units */
    return fmt == 1 ? G * 32 : (G / 8) * (fmt == 2 ? SB_BYTES2 : SB_BYTES3) / 2;
}

static inline float32x4_t ld_f16x4(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

static inline float32x4_t ld_u8x4(const uint8_t *p) {
    uint32_t t;
    memcpy(&t, p, 4);
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(t))))));
}

static inline float32x4_t ld_s8x4(const uint8_t *p) {
    uint32_t t;
    memcpy(&t, p, 4);
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(t))))));
}

static inline float32x4_t ld_bf16x4(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }

/* v rounded to bf16, nearest even (sd_avx2.h's sd8_rne; a NaN -> 0x7fc0) */
static inline uint16x4_t bf16x4(float32x4_t v) {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t r = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), odd));
    return vshrn_n_u32(vbslq_u32(vceqq_f32(v, v), r, vdupq_n_u32(0x7fc00000u)), 16);
}

/* One group of 32 bf16 inputs -> int8 codes (symmetric, scale max|x| / 127, nearest even), *a and
 * *am = a * sum(codes): sd.h's sd_quantize_group, the same arithmetic. */
static inline void quantize_group(const uint16_t *p, int8_t *q, float *a, float *am) {
    float32x4_t x[8], mx = vdupq_n_f32(0.0f);
    for (int i = 0; i < 8; i++) {
        x[i] = ld_bf16x4(p + 4 * i);
        mx = vmaxq_f32(mx, vabsq_f32(x[i]));
    }
    const float amax = vmaxvq_f32(mx);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32x4_t sum = vdupq_n_s32(0);
    int16x4_t h[8];
    for (int i = 0; i < 8; i++) {
        const int32x4_t c = vcvtnq_s32_f32(vmulq_n_f32(x[i], inv)); /* nearest even */
        sum = vaddq_s32(sum, c);
        h[i] = vqmovn_s32(c);
    }
    for (int i = 0; i < 4; i++) vst1_s8(q + 8 * i, vqmovn_s16(vcombine_s16(h[2 * i], h[2 * i + 1])));
    const float sc = amax / 127.0f;
    *a = sc;
    *am = sc * (float)vaddvq_s32(sum);
}

/* x (M, K) bf16 -> xq (M, K) int8, a (M, K/32) scales, am (M, K/32) = a * sum(xq) per group. */
void sd_quantize_rows(const uint16_t *x, int64_t M, int64_t K, int8_t *xq, float *a, float *am) {
    const int64_t G = K / GS;
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < G; g++) quantize_group(x + r * K + g * GS, xq + r * K + g * GS, a + r * G + g, am + r * G + g);
}

/* sdot of code vector C (4 columns x 4 inputs) with inputs 4L..4L+3 of X into ACC */
#define SDOT(acc, c, x, L) acc = vdotq_laneq_s32(acc, c, x, L)

/* One register block of R rows (r0..r0+R-1) against one column tile (nv of its 16 columns are real);
 * always inlined with R constant. */
static inline __attribute__((always_inline)) void
tile_block(const int R, const int bits, const int fmt, const int8_t *xq, const float *a, const float *am, int64_t K,
           const uint8_t *wt, const uint16_t *st, const float *bias, void *y, int64_t ldy, int out_f32,
           int64_t r0, int64_t n0, int nv, int64_t g0, int64_t g1, float *part) {
    const int64_t G = K / GS;
    const int64_t gbytes = bits == 4 ? 256 : bits == 6 ? 384 : 512;
    const uint8_t *sb8 = (const uint8_t *)st;
    float32x4_t acc[RB][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = g0 == 0 ? vdupq_n_f32(0.0f) : vld1q_f32(part + 16 * r + 4 * v);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *wp = wt + g * gbytes;
        for (int j = 0; j < gbytes / 64; j++) __builtin_prefetch(wp + PFG * gbytes + 64 * j);
        __builtin_prefetch(sb8 + (g + PFG) * (fmt == 1 ? 64 : fmt == 2 ? 40 : 72));
        /* each row's 32 inputs and the sums of its halves (format 3's half sums; 8-bit codes' 128 * sum) */
        int8x16_t xl[RB], xh[RB];
        int32_t sl[RB], sh[RB];
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + (r0 + r) * K + g * GS;
            xl[r] = vld1q_s8(xr);
            xh[r] = vld1q_s8(xr + 16);
            sl[r] = vaddlvq_s8(xl[r]);
            sh[r] = vaddlvq_s8(xh[r]);
        }
        for (int v = 0; v < 4; v++) { /* columns 4v..4v+3 */
            float32x4_t s, m, s2 = vdupq_n_f32(0.0f), m2 = vdupq_n_f32(0.0f); /* format 3: s, m the low half's */
            if (fmt == 1) {
                s = ld_f16x4(st + g * 32 + 4 * v);
                m = ld_f16x4(st + g * 32 + 16 + 4 * v);
            } else {
                const uint8_t *sb = sb8 + (g >> 3) * (fmt == 2 ? SB_BYTES2 : SB_BYTES3);
                const float32x4_t d = ld_f16x4((const uint16_t *)sb + 4 * v);
                const float32x4_t dm = ld_f16x4((const uint16_t *)(sb + 32) + 4 * v);
                if (fmt == 2) {
                    const uint8_t *gp = sb + 64 + (g & 7) * 32 + 4 * v;
                    s = vmulq_f32(d, ld_u8x4(gp));
                    m = vmulq_f32(dm, ld_u8x4(gp + 16));
                } else {
                    const uint8_t *gp = sb + 64 + (g & 7) * 64 + 4 * v;
                    s = vmulq_f32(d, ld_s8x4(gp));
                    s2 = vmulq_f32(d, ld_s8x4(gp + 16));
                    m = vmulq_f32(dm, ld_s8x4(gp + 32));
                    m2 = vmulq_f32(dm, ld_s8x4(gp + 48));
                }
            }
            /* c[j]: inputs 4j..4j+3 of the quad's 4 columns, as s8 */
            int8x16_t c[8];
            if (bits == 4) {
                for (int j = 0; j < 4; j++) {
                    const uint8x16_t raw = vld1q_u8(wp + 64 * j + 16 * v);
                    c[j] = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0f)));
                    c[j + 4] = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
                }
            } else if (bits == 6) { /* qmm.c's 6-bit layout: the nibbles, then the high bit pairs */
                for (int j = 0; j < 8; j++) {
                    const uint8x16_t raw = vld1q_u8(wp + 64 * (j & 3) + 16 * v);
                    const uint8x16_t nib = j < 4 ? vandq_u8(raw, vdupq_n_u8(0x0f)) : vshrq_n_u8(raw, 4);
                    const uint8x16_t hb = vld1q_u8(wp + 256 + 64 * (j >> 2) + 16 * v);
                    const uint8x16_t hi = vandq_u8(vshlq_u8(hb, vdupq_n_s8((int8_t)(-2 * (j & 3)))), vdupq_n_u8(3));
                    c[j] = vreinterpretq_s8_u8(vorrq_u8(nib, vshlq_n_u8(hi, 4)));
                }
            } else {
                for (int j = 0; j < 8; j++) {
                    const uint8x16_t raw = vld1q_u8(wp + 64 * j + 16 * v);
                    c[j] = vreinterpretq_s8_u8(fmt == 3 ? raw : veorq_u8(raw, vdupq_n_u8(0x80)));
                }
            }
            for (int r = 0; r < R; r++) {
                const float ar = a[(r0 + r) * G + g];
                int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);
                SDOT(lo, c[0], xl[r], 0);
                SDOT(hi, c[4], xh[r], 0);
                SDOT(lo, c[1], xl[r], 1);
                SDOT(hi, c[5], xh[r], 1);
                SDOT(lo, c[2], xl[r], 2);
                SDOT(hi, c[6], xh[r], 2);
                SDOT(lo, c[3], xl[r], 3);
                SDOT(hi, c[7], xh[r], 3);
                if (fmt == 3) { /* qmm.c's four steps, in its order */
                    acc[r][v] = vfmaq_f32(acc[r][v], m, vdupq_n_f32(ar * (float)sl[r]));
                    acc[r][v] = vfmaq_f32(acc[r][v], m2, vdupq_n_f32(ar * (float)sh[r]));
                    acc[r][v] = vfmaq_f32(acc[r][v], vcvtq_f32_s32(lo), vmulq_n_f32(s, ar));
                    acc[r][v] = vfmaq_f32(acc[r][v], vcvtq_f32_s32(hi), vmulq_n_f32(s2, ar));
                    continue;
                }
                int32x4_t d = vaddq_s32(lo, hi);
                if (bits == 8) d = vaddq_s32(d, vdupq_n_s32(128 * (sl[r] + sh[r]))); /* the codes' -128 back */
                acc[r][v] = vfmaq_f32(acc[r][v], m, vdupq_n_f32(am[(r0 + r) * G + g]));
                acc[r][v] = vfmaq_f32(acc[r][v], vcvtq_f32_s32(d), vmulq_n_f32(s, ar));
            }
        }
    }
    if (g1 < G) { /* a partial sum over this chunk of groups: kept for the next chunk */
        for (int r = 0; r < R; r++)
            for (int v = 0; v < 4; v++) vst1q_f32(part + 16 * r + 4 * v, acc[r][v]);
        return;
    }
    float bb[TN] = {0};
    if (bias) memcpy(bb, bias + n0, sizeof(float) * (size_t)nv);
    for (int r = 0; r < R; r++) {
        if (out_f32) {
            float o[TN];
            for (int v = 0; v < 4; v++) vst1q_f32(o + 4 * v, vaddq_f32(acc[r][v], vld1q_f32(bb + 4 * v)));
            memcpy((float *)y + (r0 + r) * ldy + n0, o, sizeof(float) * (size_t)nv);
        } else {
            uint16_t o[TN];
            for (int v = 0; v < 4; v++) vst1_u16(o + 4 * v, bf16x4(vaddq_f32(acc[r][v], vld1q_f32(bb + 4 * v))));
            memcpy((uint16_t *)y + (r0 + r) * ldy + n0, o, sizeof(uint16_t) * (size_t)nv);
        }
    }
}

#define BLOCK_CASE(R, BITS, FMT) \
    case R: tile_block(R, BITS, FMT, xq, a, am, K, wt, st, bias, y, N, out_f32, r0, n0, nv, g0, g1, part + 16 * r0); break;

#define ROW_BLOCKS(BITS, FMT)                                                                             \
    switch (M - r0 < RB ? M - r0 : RB) {                                                                  \
        BLOCK_CASE(1, BITS, FMT) BLOCK_CASE(2, BITS, FMT) BLOCK_CASE(3, BITS, FMT) BLOCK_CASE(4, BITS, FMT) \
        BLOCK_CASE(5, BITS, FMT) BLOCK_CASE(6, BITS, FMT) BLOCK_CASE(7, BITS, FMT) BLOCK_CASE(8, BITS, FMT) \
    }

/* All rows against one tile, in register blocks of up to RB rows (R and bits compile-time constants). */
static void tile_rows(int bits, int fmt, const int8_t *xq, const float *a, const float *am, int64_t M, int64_t K,
                      const uint8_t *wt, const uint16_t *st, const float *bias, void *y, int64_t N,
                      int out_f32, int64_t n0, int nv, int64_t g0, int64_t g1, float *part) {
    for (int64_t r0 = 0; r0 < M; r0 += RB) {
        if (fmt == 3) {
            if (bits == 6) {
                ROW_BLOCKS(6, 3)
            } else {
                ROW_BLOCKS(8, 3)
            }
        } else if (fmt == 2) {
            if (bits == 4) {
                ROW_BLOCKS(4, 2)
            } else if (bits == 6) {
                ROW_BLOCKS(6, 2)
            } else {
                ROW_BLOCKS(8, 2)
            }
        } else if (bits == 4) {
            ROW_BLOCKS(4, 1)
        } else if (bits == 6) {
            ROW_BLOCKS(6, 1)
        } else {
            ROW_BLOCKS(8, 1)
        }
    }
}

/* qmm.c's sd_qmm_range: the tiles [t0, t1) of y (M, N), in chunks of groups past XCHUNK bytes of the
 * rows' codes (part: ceil(N/16) * M * 16 floats of partial sums; exact, so a row's bits do not depend
 * on M nor on where the chunks end). */
#ifndef XCHUNK
#define XCHUNK (256 * 1024)
#endif
static inline int64_t kchunk(int64_t M) { return XCHUNK / GS / (M < RB ? (M > 0 ? M : 1) : RB); }
void sd_qmm_range(const int8_t *xq, const float *a, const float *am, int64_t M, int64_t K, const uint8_t *w,
                  const uint16_t *st, int64_t N, int bits, int fmt, const float *bias, void *y, int out_f32,
                  float *part, int64_t t0, int64_t t1) {
    const int64_t G = K / GS;
    const int64_t gbytes = bits == 4 ? 256 : bits == 6 ? 384 : 512;
    const int64_t chunk = kchunk(M);
    for (int64_t g0 = 0; g0 < G; g0 += chunk) {
        const int64_t g1 = g0 + chunk < G ? g0 + chunk : G;
        for (int64_t t = t0; t < t1; t++) {
            const int64_t n0 = t * TN;
            const int nv = N - n0 >= TN ? TN : (int)(N - n0);
            tile_rows(bits, fmt, xq, a, am, M, K, w + t * G * gbytes, st + t * st_tile_halves(fmt, G), bias, y, N,
                      out_f32, n0, nv, g0, g1, part + t * M * 16);
        }
    }
}

void sd_qmm(const int8_t *xq, const float *a, const float *am, int64_t M, int64_t K, const uint8_t *w,
            const uint16_t *st, int64_t N, int bits, int fmt, const float *bias, void *y, int out_f32, float *part) {
    const int64_t tiles = (N + TN - 1) / TN;
#ifdef _OPENMP
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        sd_qmm_range(xq, a, am, M, K, w, st, N, bits, fmt, bias, y, out_f32, part, tiles * id / nt, tiles * (id + 1) / nt);
    }
#else
    sd_qmm_range(xq, a, am, M, K, w, st, N, bits, fmt, bias, y, out_f32, part, 0, tiles);
#endif
}

/* qmm.c's sd_linear: both steps with scratch of its own. Returns 0, or -1 without memory. */
int sd_linear(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *st, int64_t N,
              int bits, int fmt, const float *bias, void *y, int out_f32) {
    const int64_t G = K / GS, tiles = (N + TN - 1) / TN;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *a = (float *)malloc(sizeof(float) * (size_t)(M * G) * 2);
    const int chunked = G > kchunk(M);
    float *part = chunked ? (float *)malloc(sizeof(float) * (size_t)(tiles * M * 16)) : NULL;
    if (!xq || !a || (chunked && !part)) {
        free(xq);
        free(a);
        free(part);
        return -1;
    }
    sd_quantize_rows(x, M, K, xq, a, a + M * G);
    sd_qmm(xq, a, a + M * G, M, K, w, st, N, bits, fmt, bias, y, out_f32, part);
    free(xq);
    free(a);
    free(part);
    return 0;
}
