/* The operations the native forward (forward.c) and the mixture of experts (moe.c) share: a product over a
 * range of column tiles (sd_product_tiles: bf16 weights on their native tiles here, quantized ones through
 * qmm.c's sd_qmm_range) and the MLP's activations (sd_act_mul). Declared in sd.h.
 *
 * bf16 products: the weights re-laid in tiles of 16 columns with input pairs interleaved, so one 64-byte
 * load feeds one vdpbf16ps per row (the weight read is paid once for up to 8 rows; on the avx512 rung,
 * without BF16, the load is widened once and feeds two FMAs per row: sd.h's sd_pairs); on the avx2 rung
 * the rows are widened to fp32 once and each input pair is two FMAs on the widened halves of a tile.
 * Batch invariance: a column is one chain of dpbf16 (or its two FMAs) over the inputs in order, whatever
 * the number of rows, the register block or the thread, so a row's bits never depend on the rows beside it.
 */
#include <stdlib.h>
#include <string.h>

#include "sd.h"

#ifndef SD_PF
#define SD_PF 0
#endif
#ifndef SD_PF_AVX2
#define SD_PF_AVX2 4096 /* AVX2 bf16 products: bytes each tile's weights are asked for ahead (0: none) */
#endif
#ifndef SD_TT1
#define SD_TT1 8
#endif

#ifdef SD_AVX512
/* ---- bf16 products ------------------------------------------------------------------------------ */

/* R rows x TT tiles; w: the first tile, tiles tstride elements apart. R, TT compile-time constants. */
static inline __attribute__((always_inline)) void
bf16_block(const int R, const int TT, const uint16_t *w, int64_t tstride, int64_t K, const uint16_t *x, int64_t ldx,
           const float *bias, int64_t n0, int64_t N, void *y, int64_t ldy, int out_f32) {
    __m512 acc[8][9];
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
    const int64_t P = K / 2;
    for (int64_t p = 0; p < P; p++) {
        sd_pairs wv[8];
        for (int t = 0; t < TT; t++) {
            wv[t] = sd_pairs_of(_mm512_loadu_si512((const void *)(w + t * tstride + p * 32)));
            /* the next group of tiles, one group ahead: the hardware's streams restart at every group */
            if (SD_PF) _mm_prefetch((const char *)(w + (TT + t) * tstride + p * 32), _MM_HINT_T0);
        }
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * p, 4);
            const sd_pairs xb = sd_pairs_set1(pair);
            for (int t = 0; t < TT; t++) acc[t][r] = sd_dot_pairs(acc[t][r], wv[t], xb);
        }
    }
    __m512 sums[8][9]; /* see the AVX2 twin: a copy keeps GCC from storing acc on every pass of the loop */
    for (int t = 0; t < TT; t++)
        for (int r = 0; r < R; r++) sums[t][r] = acc[t][r];
    for (int t = 0; t < TT; t++) {
        const int64_t n = n0 + 16 * t;
        const __mmask16 nm = N - n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n)) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(nm, bias + n) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m512 v = _mm512_add_ps(sums[t][r], b);
            if (out_f32)
                _mm512_mask_storeu_ps((float *)y + r * ldy + n, nm, v);
            else
                _mm256_mask_storeu_epi16((uint16_t *)y + r * ldy + n, nm, sd_cvt_bf16(v));
        }
    }
}

#define BF16_CASE(R, TT)                                                                                      \
    case R: bf16_block(R, TT, w, tstride, K, x + r0 * K, K, bias, n0, N, (char *)y + r0 * N * esz, N, out_f32); \
        break;

/* y (M, N) = x (M, K) W^T over the tiles [t0, t1): column tiles in groups of TT, rows in blocks of 8 (9). */
static void bf16_range(const sd_mat *m, const uint16_t *x, int64_t M, void *y, int out_f32, int64_t t0, int64_t t1) {
    const int64_t K = m->K, N = m->N, tstride = 16 * K;
    const float *bias = m->bias;
    const int64_t esz = out_f32 ? 4 : 2;
    /* rows in blocks of 8, but nine (a K=8 verification) in one block: 27 accumulators, 3 weight vectors
     * and the broadcast fit the 32 registers, where 8 + 1 ran the last row at the dot products' latency
     * (in cache 48 -> 42 us for 9 rows of a 1024 x 1024 product) */
    const int64_t RB9 = M == 9 ? 9 : 8;
    const int64_t R0 = M < RB9 ? M : RB9;
    /* accumulators per block: 8-16 at one or two rows (latency), 16 at 3-4, 15-24 at 5-8 rows (3 tiles:
     * a block of 8 rows reached 0.80 of the dot products' peak with 2 tiles, 0.95 with 3, in cache).
     * Without BF16 a tile's weights take two registers (widened once, sd_pairs) and a row's pair two:
     * 8 tiles at one row, 4 at 2-4 rows, 2 at 5-9 rows keep the block within the 32 registers (not
     * timed yet). The blocking never changes a column's chain, so the bits are the same at any choice. */
#ifdef SD_BF16
    const int64_t TTmax = R0 <= 2 ? SD_TT1 : R0 <= 4 ? 4 : 3;
#else
    const int64_t TTmax = R0 == 1 ? SD_TT1 : R0 <= 4 ? 4 : 2;
#endif
    for (int64_t t = t0; t < t1;) {
        int64_t tt = t1 - t < TTmax ? t1 - t : TTmax;
        tt = tt >= 8 ? 8 : tt >= 4 ? 4 : tt >= 3 ? 3 : tt >= 2 ? 2 : 1;
        const uint16_t *w = (const uint16_t *)m->w + t * tstride;
        const int64_t n0 = t * 16;
        for (int64_t r0 = 0; r0 < M; r0 += RB9) {
            const int64_t R = M - r0 < RB9 ? M - r0 : RB9;
            if (tt == 8) {
                switch (R) { BF16_CASE(1, 8) BF16_CASE(2, 8) }
            } else if (tt == 4) {
                switch (R) { BF16_CASE(1, 4) BF16_CASE(2, 4) BF16_CASE(3, 4) BF16_CASE(4, 4) }
            } else if (tt == 3) {
                switch (R) {
                    BF16_CASE(1, 3) BF16_CASE(2, 3) BF16_CASE(3, 3) BF16_CASE(4, 3)
                    BF16_CASE(5, 3) BF16_CASE(6, 3) BF16_CASE(7, 3) BF16_CASE(8, 3) BF16_CASE(9, 3)
                }
            } else if (tt == 2) {
                switch (R) {
                    BF16_CASE(1, 2) BF16_CASE(2, 2) BF16_CASE(3, 2) BF16_CASE(4, 2)
                    BF16_CASE(5, 2) BF16_CASE(6, 2) BF16_CASE(7, 2) BF16_CASE(8, 2) BF16_CASE(9, 2)
                }
            } else {
                switch (R) {
                    BF16_CASE(1, 1) BF16_CASE(2, 1) BF16_CASE(3, 1) BF16_CASE(4, 1)
                    BF16_CASE(5, 1) BF16_CASE(6, 1) BF16_CASE(7, 1) BF16_CASE(8, 1) BF16_CASE(9, 1)
                }
            }
        }
        t += tt;
    }
}

#else
/* ---- bf16 products (AVX2: each input pair as two FMAs on the widened halves of a tile) -------------- */

/* R rows x TT tiles, a tile as two halves of 8 columns; xf: the R rows widened to fp32 (ldx apart), so
 * every input is one broadcast load. A column is one chain over the input pairs in order (the even
 * input's FMA, then the odd one's), whatever R, TT or the thread: a row's bits never depend on M. */
static inline __attribute__((always_inline)) void
bf16_block(const int R, const int TT, const uint16_t *w, int64_t tstride, int64_t K, const float *xf, int64_t ldx,
           const float *bias, int64_t n0, int64_t N, void *y, int64_t ldy, int out_f32) {
    __m256 acc[4][2][4];
    const __m256i hi16 = _mm256_set1_epi32((int)0xffff0000u);
    for (int t = 0; t < TT; t++)
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < R; r++) acc[t][h][r] = _mm256_setzero_ps();
    const int64_t P = K / 2;
    for (int64_t p = 0; p < P; p++) {
        /* each tile's weights SD_PF_AVX2 bytes ahead (a line per pair), at any R: a block of rows keeps the
         * FMA pipes busy, and the hardware's prefetcher alone then left the stream at 0.6 of the read limit
         * (at one row, `ab products` found neither gain nor loss) */
        if (SD_PF_AVX2)
            for (int t = 0; t < TT; t++) _mm_prefetch((const char *)(w + t * tstride + p * 32) + SD_PF_AVX2, _MM_HINT_T0);
        if (TT == 1) { /* up to 4 rows on one tile: its two halves widened once, each row's inputs broadcast
                        * just before their FMAs (8 accumulators, 4 weights, 2 inputs: no spills) */
            __m256 we[2], wo[2];
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + p * 32 + 16 * h));
                we[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                wo[h] = _mm256_castsi256_ps(_mm256_and_si256(v, hi16));
            }
            for (int r = 0; r < R; r++) {
                const __m256 xe = _mm256_broadcast_ss(xf + r * ldx + 2 * p);
                const __m256 xo = _mm256_broadcast_ss(xf + r * ldx + 2 * p + 1);
                for (int h = 0; h < 2; h++) {
                    acc[0][h][r] = _mm256_fmadd_ps(we[h], xe, acc[0][h][r]);
                    acc[0][h][r] = _mm256_fmadd_ps(wo[h], xo, acc[0][h][r]);
                }
            }
            continue;
        }
        __m256 xe[4], xo[4];
        for (int r = 0; r < R; r++) {
            xe[r] = _mm256_broadcast_ss(xf + r * ldx + 2 * p);
            xo[r] = _mm256_broadcast_ss(xf + r * ldx + 2 * p + 1);
        }
        for (int t = 0; t < TT; t++)
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + t * tstride + p * 32 + 16 * h));
                const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(v, hi16));
                for (int r = 0; r < R; r++) {
                    acc[t][h][r] = _mm256_fmadd_ps(we, xe[r], acc[t][h][r]);
                    acc[t][h][r] = _mm256_fmadd_ps(wo, xo[r], acc[t][h][r]);
                }
            }
    }
    /* The epilogue reads a copy: reading acc itself, GCC keeps the array in memory and stores every
     * accumulator on each pass of the loop above (8 stores per 16 FMAs in its assembly, on the pipe the
     * widening shifts use); with the copy the loop holds them in registers. */
    __m256 sums[4][2][4];
    for (int t = 0; t < TT; t++)
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < R; r++) sums[t][h][r] = acc[t][h][r];
    for (int t = 0; t < TT; t++)
        for (int h = 0; h < 2; h++) {
            const int64_t n = n0 + 16 * t + 8 * h;
            if (n >= N) continue;
            const int nv = N - n >= 8 ? 8 : (int)(N - n);
            const __m256 b = bias ? sd8_load_n(bias + n, nv) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                const __m256 v = _mm256_add_ps(sums[t][h][r], b);
                if (out_f32) {
                    sd8_store_n((float *)y + r * ldy + n, v, nv);
                } else {
                    uint16_t tmp[8];
                    sd8_st_bf16(tmp, v);
                    memcpy((uint16_t *)y + r * ldy + n, tmp, sizeof(uint16_t) * (size_t)nv);
                }
            }
        }
}

#define BF16_CASE(R, TT)                                                                                    \
    case R: bf16_block(R, TT, w, tstride, K, xf, K, bias, n0, N, (char *)y + r0 * N * esz, N, out_f32); \
        break;

/* A thread's scratch for its widened rows (the AVX2 build's bf16 products; AVX-512 needs none): M x K x 4
 * bytes per thread for the largest product it has run (18 MB at a 512-row block through the 1.5B's down
 * product, K = 8960), grown on demand and never freed (kept for the thread's life). Where it cannot
 * grow, the thread skips its share and raises sd_xf_failed: sd_forward / sd_matmul then return -4. */
static __thread float *xf_buf;
static __thread int64_t xf_cap;
int sd_xf_failed;

/* y (M, N) = x (M, K) W^T over the tiles [t0, t1): the rows widened to fp32 once; for each group of
 * tiles (4 at one row, else 2), the rows in blocks of 2, so the group's weights come from memory once
 * and from cache for the other blocks. AVX2 has 16 vector registers: 8 accumulators, the block's inputs
 * held across the group's tiles (a broadcast per input per block, not per tile). */
static void bf16_range(const sd_mat *m, const uint16_t *x, int64_t M, void *y, int out_f32, int64_t t0, int64_t t1) {
    const int64_t K = m->K, N = m->N, tstride = 16 * K;
    const float *bias = m->bias;
    const int64_t esz = out_f32 ? 4 : 2;
    if (xf_cap < M * K) {
        free(xf_buf);
        xf_buf = (float *)aligned_alloc(64, sizeof(float) * (size_t)((M * K + 15) & ~(int64_t)15));
        xf_cap = xf_buf ? M * K : 0; /* M x K floats per thread (see above) */
        if (!xf_buf) {
            __atomic_store_n(&sd_xf_failed, 1, __ATOMIC_RELAXED);
            return;
        }
    }
    for (int64_t i = 0; i < M * K; i++) {
        const uint32_t u = (uint32_t)x[i] << 16;
        memcpy(xf_buf + i, &u, 4);
    }
    const int64_t TTmax = M == 1 ? 4 : M == 2 ? 2 : 1, RB = M <= 2 ? 2 : 4;
    for (int64_t t = t0; t < t1;) {
        const int64_t tt = t1 - t < TTmax ? t1 - t : TTmax;
        const uint16_t *w = (const uint16_t *)m->w + t * tstride;
        const int64_t n0 = t * 16;
        const int64_t step = tt == 4 ? 4 : tt >= 2 ? 2 : 1;
        for (int64_t r0 = 0; r0 < M; r0 += RB) {
            const int64_t R = M - r0 < RB ? M - r0 : RB;
            const float *xf = xf_buf + r0 * K;
            if (step == 4) {
                switch (R) { BF16_CASE(1, 4) }
            } else if (step == 2) {
                switch (R) { BF16_CASE(1, 2) BF16_CASE(2, 2) }
            } else {
                switch (R) { BF16_CASE(1, 1) BF16_CASE(2, 1) BF16_CASE(3, 1) BF16_CASE(4, 1) }
            }
        }
        t += step;
    }
}
#endif

/* bf16_range with bf16 out: a copy of its own without the fp32 stores */
static __attribute__((noinline)) void bf16_range_bf16(const sd_mat *m, const uint16_t *x, int64_t M, void *y, int64_t t0,
                                                      int64_t t1) {
    bf16_range(m, x, M, y, 0, t0, t1);
}

/* The tiles [t0, t1) of y (M, N) = x W^T; x bf16 (M, K) for bf16 weights, or quantized (xq, xa, xam)
 * for quantized ones. No barrier inside. The bf16 products are called with out_f32 a constant, so the
 * compiler makes the forward's bf16-out form of bf16_range its own copy without the fp32 stores (as it did
 * when the forward called bf16_range itself). */
void sd_product_tiles(const sd_mat *m, const uint16_t *x, const int8_t *xq, const float *xa, const float *xam,
                      int64_t M, void *y, int out_f32, float *part, int64_t t0, int64_t t1) {
    if (t0 >= t1) return;
    if (m->kind == 0 && !out_f32)
        bf16_range_bf16(m, x, M, y, t0, t1);
    else if (m->kind == 0)
        bf16_range(m, x, M, y, out_f32, t0, t1);
    else
        sd_qmm_range(xq, xa, xam, M, m->K, (const uint8_t *)m->w, m->st, m->N, (int)m->bits, (int)m->kind, m->bias, y, out_f32,
                     part, t0, t1);
}

/* ---- activations (sd_act_mul; one body for both widths: SDV, sd.h) ------------------------------- */

/* gelu(g) with the tanh approximation (PyTorch's approximate="tanh"): 0.5 g (1 + tanh(k (g + 0.044715 g^3))),
 * tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2|u|) (an exponential of a non-positive argument only) */
static inline SDV_T gelu_tanh(SDV_T g) {
    const SDV_T u = SDV(mul_ps)(SDV(set1_ps)(0.7978845608028654f),
                                SDV(fmadd_ps)(SDV(mul_ps)(SDV(set1_ps)(0.044715f), SDV(mul_ps)(g, g)), g, g));
    const SDV_T sign = SDV(and_ps)(u, SDV(set1_ps)(-0.0f));
    const SDV_T au = SDV(andnot_ps)(SDV(set1_ps)(-0.0f), u);
    const SDV_T e = sdv_exp_neg(SDV(mul_ps)(SDV(set1_ps)(-2.0f), au));
    const SDV_T one = SDV(set1_ps)(1.0f);
    const SDV_T t = SDV(or_ps)(SDV(div_ps)(SDV(sub_ps)(one, e), SDV(add_ps)(one, e)), sign);
    return SDV(mul_ps)(SDV(mul_ps)(SDV(set1_ps)(0.5f), g), SDV(add_ps)(one, t));
}

/* o[c] = gelu_tanh(gate[c]) * up[c] for c in [c0, c1), each step rounded to bf16 as the reference's */
static inline void gelu_mul(uint16_t *o, const uint16_t *gp, const uint16_t *up, int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; c += SDV_W)
        sdv_st_bf16(o + c, SDV(mul_ps)(sdv_round_bf16(gelu_tanh(sdv_ld_bf16(gp + c))), sdv_ld_bf16(up + c)));
}

/* sd.h: o = act(gate) * up over columns [c0, c1), as models/moe.py activate rounds (gpt-oss's: gate and up
 * clamped, (up + 1) * (gate * sigmoid(alpha gate)), each op rounded to bf16) */
void sd_act_mul(int act, float limit, float alpha, uint16_t *o, const uint16_t *gp, const uint16_t *up, int64_t c0,
                int64_t c1) {
    if (act == 1) {
        gelu_mul(o, gp, up, c0, c1);
    } else if (act == 2) {
        const SDV_T lim = SDV(set1_ps)(limit), nlim = SDV(set1_ps)(-limit), one = SDV(set1_ps)(1.0f), a = SDV(set1_ps)(alpha);
        for (int64_t c = c0; c < c1; c += SDV_W) {
            const SDV_T g = sdv_round_bf16(SDV(min_ps)(lim, sdv_ld_bf16(gp + c))); /* min(lim, x): x when NaN */
            const SDV_T u = sdv_round_bf16(SDV(max_ps)(nlim, SDV(min_ps)(lim, sdv_ld_bf16(up + c))));
            const SDV_T sg = sdv_round_bf16(sigmoid_v(sdv_round_bf16(SDV(mul_ps)(g, a))));
            sdv_st_bf16(o + c, SDV(mul_ps)(sdv_round_bf16(SDV(add_ps)(u, one)), sdv_round_bf16(SDV(mul_ps)(g, sg))));
        }
    } else { /* SiLU */
        for (int64_t c = c0; c < c1; c += SDV_W)
            sdv_st_bf16(o + c, SDV(mul_ps)(sdv_round_bf16(silu_v(sdv_ld_bf16(gp + c))), sdv_ld_bf16(up + c)));
    }
}

