/* Grouped-query attention of a few new tokens over the KV cache, bf16 in and out, fp32 inside.
 *
 *   out[b, t, h, :] = sum_j softmax_j(scale * q[b, h, t, :] . K[row_b, h / G, j, :]) V[row_b, h / G, j, :]
 *   over the keys j < L with mask[b, t, j] set (the native forward's Gemma 2 layers: each scaled score
 *   soft-capped, cap * tanh(score / cap), before the softmax).
 *
 * One work item is (b, kv head, t): its G query heads read each key and value once (in the native
 * forward an item is a group of tokens of one row and some of a kv head's query heads). Items are
 * independent and each runs front to back over the keys in one thread, so a query's result does not
 * depend on how many queries, rows or masked keys share the call (batch-invariant, as exact
 * verification needs). Reads the paged cache in place through the block table: no gathered copy of
 * the keys per step.
 *
 * The visible keys of a query are listed first (compacted, in slot order) and every reduction runs
 * over that list, so a query also gives the same bits wherever its keys sit: a token-tree node
 * whose ancestors are spread among its siblings' slots attends exactly as its own branch would as
 * a chain in consecutive slots (lossless tree verification).
 *
 * The rungs: exp, the soft-capping and the slot arithmetic are written once (SDV, sd.h); sd_attn_rows is
 * each width's own, two algorithms with their own summation orders (AVX-512: 16 keys transposed into bf16
 * pairs, a dot-product chain per key over its pairs, the values widened per block of 16 keys; AVX2: 8 keys
 * widened even/odd, a chain per (row, key) over 8-column pieces reduced by a fixed tree of horizontal adds,
 * the values in chunks that stay in L2), so one body for both would change one rung's bits.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sd.h"

/* exp(x) for x <= 0 (softmax after subtracting the max): range reduction by ln 2 and a degree-6
 * polynomial, relative error about 2e-7; x below -87 gives 0. The same operations on both widths. */
static inline SDV_T exp_neg_v(SDV_T x) {
    const SDV_T lo = SDV(set1_ps)(-87.0f);
    const sdv_mask tiny = sdv_lt(x, lo);
    x = SDV(max_ps)(x, lo);
    const SDV_T n = sdv_round_nearest(SDV(mul_ps)(x, SDV(set1_ps)(1.44269504088896341f)));
    SD_EXP_STEPS(x, n, p, e);
    return sdv_mul_unless(tiny, p, sdv_as_float(e));
}

#ifdef SD_AVX512
__m512 sd_exp_neg(__m512 x) { return exp_neg_v(x); }
#else
__m256 sd8_exp_neg(__m256 x) { return exp_neg_v(x); }
#endif

/* Offset of slot j of kv head kh in a paged layer (blocks, nkv, 1 << bshift, hd): tab is the row's
 * block table. */
static inline int64_t slot(const int64_t *tab, int64_t j, int64_t nkv, int64_t kh, int64_t bshift, int64_t hd) {
    return (((tab[j >> bshift] * nkv + kh) << bshift) | (j & (((int64_t)1 << bshift) - 1))) * hd;
}

/* cap * tanh(s / cap) lane by lane (Gemma 2's attention soft-capping; models/llama.py attention, in fp32:
 * s / cap, tanh, times cap). tanh(|x|) as Cephes' tanhf: an odd polynomial below 0.625, above it
 * (1 - e) / (1 + e) with e = exp(-2|x|) (1 exactly past |x| = 43.5); within a few ulp; the sign put back.
 * The same operations in every lane and on both widths, so a score's bits depend on it and cap alone. */
static inline SDV_T softcap_v(SDV_T s, SDV_T cap) {
    const SDV_T x = SDV(div_ps)(s, cap), a = sdv_abs(x), one = SDV(set1_ps)(1.0f);
    const SDV_T z = SDV(mul_ps)(a, a);
    SDV_T p = SDV(set1_ps)(-5.70498872745e-3f);
    p = SDV(fmadd_ps)(p, z, SDV(set1_ps)(2.06390887954e-2f));
    p = SDV(fmadd_ps)(p, z, SDV(set1_ps)(-5.37397155531e-2f));
    p = SDV(fmadd_ps)(p, z, SDV(set1_ps)(1.33314422036e-1f));
    p = SDV(fmadd_ps)(p, z, SDV(set1_ps)(-3.33332819422e-1f));
    const SDV_T small = SDV(fmadd_ps)(SDV(mul_ps)(p, z), a, a);
    const SDV_T e = sdv_exp_neg(SDV(mul_ps)(a, SDV(set1_ps)(-2.0f)));
    const SDV_T big = SDV(div_ps)(SDV(sub_ps)(one, e), SDV(add_ps)(one, e));
    const SDV_T t = sdv_select_gt(a, SDV(set1_ps)(0.625f), small, big);
    return SDV(mul_ps)(sdv_sign_of(t, x), cap);
}

#ifdef SD_AVX512
#ifndef SD_ATT_AHEAD
#define SD_ATT_AHEAD 32
#endif

/* Asks for the 16 slots from p (one kv head's, consecutive within a cache block: 16 divides the block)
 * ahead of their use: one query's pass over the keys is one stream of 2-4 KB pieces that the hardware
 * prefetchers pick up late (in a forward the cache was evicted by the weights since the last layer). */
#define prefetch_keys(p, hd, hint)                                                                             \
    do {                                                                                                   \
        for (int64_t b_ = 0; b_ < 16 * (hd) * 2; b_ += 64) _mm_prefetch((const char *)(p) + b_, hint);         \
    } while (0)

/* The 16 keys kp[0..15] (hd bf16 each) as pairs by column: kt[16 p + u] = pair p (elements 2p, 2p+1) of
 * key u. A 16 x 16 transpose of 32-bit pairs per 32 elements of the head (4 rounds of 16 shuffles);
 * with hd % 32 == 16 the last round reads 8 pairs (zeros after). */
static inline void transpose_keys(const uint16_t *const *kp, int64_t hd, uint32_t *kt) {
    for (int64_t c = 0; c < hd; c += 32) {
        const __mmask32 on = hd - c >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)0xFFFFu;
        __m512i r[16], t[16], u[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_maskz_loadu_epi16(on, kp[i] + c);
        for (int i = 0; i < 8; i++) {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        /* u[4i + k], 128-bit lane l: pair 4l + k of keys 4i .. 4i + 3 */
        for (int i = 0; i < 4; i++) {
            u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        uint32_t *o = kt + (c / 2) * 16;
        const int npairs = hd - c >= 32 ? 16 : 8;
        for (int k = 0; k < 4; k++) {
            const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
            const __m512i w0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
            /* pair 4l + k of all 16 keys, for l = 0 .. 3 */
            const __m512i p[4] = {_mm512_shuffle_i32x4(v0, w0, 0x88), _mm512_shuffle_i32x4(v1, w1, 0x88),
                                  _mm512_shuffle_i32x4(v0, w0, 0xDD), _mm512_shuffle_i32x4(v1, w1, 0xDD)};
            for (int l = 0; l < 4; l++)
                if (4 * l + k < npairs) _mm512_store_si512((void *)(o + (4 * l + k) * 16), p[l]);
        }
    }
}

/* The lanes of v set in vis, packed to the front, at p (the register form of compress: the one that
 * stores to memory is microcoded on AMD Zen 4, ~100 cycles). */
static inline void store_visible(float *p, __mmask16 vis, __m512 v) {
    if (vis == 0xFFFF)
        _mm512_storeu_ps(p, v);
    else
        _mm512_mask_storeu_ps(p, (__mmask16)((1u << __builtin_popcount(vis)) - 1u), _mm512_maskz_compress_ps(vis, v));
}

/* sc[b] = the 16 keys' dot products with query row qr[b]: one dot-product chain per key over its pairs
 * in order (P = hd / 2), whatever the number of rows NB (a compile-time constant). */
static inline __attribute__((always_inline)) void scores_block(const int NB, const uint32_t *kt, int64_t P,
                                                                const uint16_t *const *qr, __m512 *sc) {
    __m512 acc[8];
    for (int b = 0; b < NB; b++) acc[b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; p++) {
        const sd_pairs kv = sd_pairs_of(_mm512_load_si512((const void *)(kt + 16 * p)));
        for (int b = 0; b < NB; b++) {
            int32_t pair;
            memcpy(&pair, qr[b] + 2 * p, 4);
            acc[b] = sd_dot_pairs(acc[b], kv, sd_pairs_set1(pair));
        }
    }
    for (int b = 0; b < NB; b++) sc[b] = acc[b];
}

/* R query tokens of one cache row against one kv head, each key block read once for all of them
 * (a verification block of K + 1 tokens, or a prompt chunk, reads the cache once, not K + 1 times).
 * Token r: its G query heads at q + r * qtok + g * qstride; its keys: the slots j with
 * mask[r * mstride + j] set or, mask NULL, j < nkeys[r]. Scratch: s R * G * Lmax floats, idx R * Lmax
 * int64 (Lmax = mstride with a mask, else the largest nkeys), o R * G * hd floats (64-byte aligned).
 * out: token r's G heads at out + r * otok, contiguous.
 *
 * Each token's result is what it alone would get, bit for bit: a key's score is one chain of dot
 * products over its pairs in order, in its own lane, whatever rows share the block (scores_block), a
 * token's softmax runs over the list of its own visible keys in slot order, and its values are
 * accumulated in that order. So results do not depend on R, on the
 * other tokens, or on where a token's keys sit (tree verification). */
void sd_attn_rows(const uint16_t *q, int64_t qtok, int64_t qstride, float scale, const uint16_t *k,
                  const uint16_t *v, const int64_t *tab, int64_t nkv, int64_t kh, int64_t bshift, int64_t hd,
                  int64_t G, const uint8_t *mask, int64_t mstride, const int64_t *nkeys, int64_t R, float *s,
                  int64_t *idx, float *o, uint16_t *out, int64_t otok, int64_t jfirst, const float *sinks,
                  float softcap) {
    const int64_t nv = hd / 16;
    const __m512 vscale = _mm512_set1_ps(scale);
    /* rows i0 .. i0 + NB - 1 of the block (row i: token i / G, head i % G), stored where visible */
#define SCORE_CASE(NB)                                                                                        \
    case NB: {                                                                                                \
        const uint16_t *qr[NB];                                                                               \
        for (int b = 0; b < NB; b++) qr[b] = q + ((i0 + b) / G) * qtok + ((i0 + b) % G) * qstride;            \
        __m512 sc[NB];                                                                                        \
        scores_block(NB, kt, hd / 2, qr, sc);                                                                 \
        for (int b = 0; b < NB; b++) {                                                                        \
            const int64_t r = (i0 + b) / G;                                                                   \
            store_visible(s + (i0 + b) * Lmax + n[r], vis[r], _mm512_mul_ps(sc[b], vscale));                   \
        }                                                                                                     \
        break;                                                                                                \
    }
    int64_t Lmax = mask ? mstride : 0, n[SD_MAXR], at[SD_MAXR];
    for (int64_t r = 0; r < R; r++) {
        n[r] = 0;
        if (!mask && nkeys[r] > Lmax) Lmax = nkeys[r];
    }
    /* the visible keys of token r among slots j0 .. j0 + m - 1, as bits */
#define VISIBLE(r, j0, m)                                                                                         \
    (mask ? (__mmask16)(_mm_cmpneq_epi8_mask(_mm_maskz_loadu_epi8((__mmask16)((1u << (m)) - 1u),               \
                                                                 mask + (r) * mstride + (j0)), _mm_setzero_si128())) \
          : (__mmask16)(nkeys[r] - (j0) >= (m) ? (1u << (m)) - 1u : (nkeys[r] > (j0) ? (1u << (nkeys[r] - (j0))) - 1u : 0u)))
    /* scores, compressed into each token's list of visible keys: the block's 16 keys transposed into
     * pairs (kt[p] holds pair p of every key), so one load of kt[p] feeds a dot product for every
     * (token, head) row, and a key's score is one chain over its pairs in order, in its own lane */
    uint32_t kt[SD_MAXHD / 2 * 16] __attribute__((aligned(64)));
    const int64_t rows = R * G;
    for (int64_t j0 = jfirst; j0 < Lmax; j0 += 16) {
        const int64_t m = Lmax - j0 < 16 ? Lmax - j0 : 16;
        __mmask16 vis[SD_MAXR], any = 0;
        for (int64_t r = 0; r < R; r++) any |= vis[r] = VISIBLE(r, j0, m);
        if (j0 + SD_ATT_AHEAD < Lmax) {
            prefetch_keys(k + slot(tab, j0 + SD_ATT_AHEAD, nkv, kh, bshift, hd), hd, _MM_HINT_T0);
            /* one token (memory-bound): the values too, into L2 for the pass after the softmax, when
             * they fit (64 KB). Measured on smollm2-135m int4: a token 3% faster, a block of 8 2% slower */
            if (R == 1 && Lmax * hd <= 32768) prefetch_keys(v + slot(tab, j0 + SD_ATT_AHEAD, nkv, kh, bshift, hd), hd, _MM_HINT_T1);
        }
        if (!any) continue;
        const uint16_t *kp[16];
        for (int u = 0; u < 16; u++) kp[u] = k + slot(tab, j0 + (u < m ? u : 0), nkv, kh, bshift, hd);
        transpose_keys(kp, hd, kt);
        for (int64_t i0 = 0; i0 < rows; i0 += 8) {
            const int64_t nb = rows - i0 < 8 ? rows - i0 : 8;
            switch (nb) {
                SCORE_CASE(1) SCORE_CASE(2) SCORE_CASE(3) SCORE_CASE(4)
                SCORE_CASE(5) SCORE_CASE(6) SCORE_CASE(7) SCORE_CASE(8)
            }
        }
        for (int64_t r = 0; r < R; r++)
            for (int u = 0; u < 16; u++)
                if (vis[r] >> u & 1) idx[r * Lmax + n[r]++] = j0 + u;
    }
#undef SCORE_CASE
    /* probabilities in place, 16 listed keys per vector */
    float sum[SD_MAXR * SD_MAXG];
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < G; g++) {
            float *sg = s + (r * G + g) * Lmax;
            const int64_t nr = n[r];
            if (softcap != 0.0f) /* Gemma 2: each listed score to cap * tanh(score / cap), before the softmax */
                for (int64_t i = 0; i < nr; i += 16) {
                    const __mmask16 on = nr - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nr - i)) - 1u);
                    _mm512_mask_storeu_ps(sg + i, on, softcap_v(_mm512_maskz_loadu_ps(on, sg + i), _mm512_set1_ps(softcap)));
                }
            __m512 vm = _mm512_set1_ps(-INFINITY);
            for (int64_t i = 0; i < nr; i += 16) {
                const __mmask16 on = nr - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nr - i)) - 1u);
                vm = _mm512_mask_max_ps(vm, on, vm, _mm512_maskz_loadu_ps(on, sg + i));
            }
            float mxs = _mm512_reduce_max_ps(vm);
            if (sinks && sinks[g] > mxs) mxs = sinks[g]; /* a sink: one more logit in the softmax */
            const __m512 mx = _mm512_set1_ps(mxs);
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = 0; i < nr; i += 16) {
                const __mmask16 on = nr - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nr - i)) - 1u);
                __m512 e = _mm512_maskz_mov_ps(on, sd_exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(on, sg + i), mx)));
                _mm512_mask_storeu_ps(sg + i, on, e);
                acc = _mm512_add_ps(acc, e);
            }
            sum[r * G + g] = _mm512_reduce_add_ps(acc);
            if (sinks) sum[r * G + g] += expf(sinks[g] - mxs); /* in the denominator only: no value */
        }
    /* the weighted sum of values: each block widened once, every token's keys in its listed order */
    float v16[16 * SD_MAXHD] __attribute__((aligned(64)));
    for (int64_t x = 0; x < R * G * hd; x += 16) _mm512_store_ps(o + x, _mm512_setzero_ps());
    for (int64_t r = 0; r < R; r++) at[r] = 0;
    for (int64_t j0 = jfirst; j0 < Lmax; j0 += 16) {
        const int64_t m = Lmax - j0 < 16 ? Lmax - j0 : 16;
        __mmask16 any = 0, vis[SD_MAXR];
        for (int64_t r = 0; r < R; r++) any |= vis[r] = VISIBLE(r, j0, m);
        if (j0 + SD_ATT_AHEAD < Lmax) prefetch_keys(v + slot(tab, j0 + SD_ATT_AHEAD, nkv, kh, bshift, hd), hd, _MM_HINT_T0);
        if (!any) continue;
        for (int64_t u = 0; u < m; u++)
            if (any >> u & 1) {
                const uint16_t *vp = v + slot(tab, j0 + u, nkv, kh, bshift, hd);
                for (int64_t c = 0; c < nv; c++) _mm512_store_ps(v16 + u * hd + 16 * c, sd_ld_bf16(vp + 16 * c));
            }
        for (int64_t r = 0; r < R; r++) {
            if (!vis[r]) continue;
            int us[16], cnt = 0;
            for (int u = 0; u < 16; u++)
                if (vis[r] >> u & 1) us[cnt++] = u;
            for (int64_t g = 0; g < G; g++) {
                const float *p = s + (r * G + g) * Lmax + at[r];
                float *og = o + (r * G + g) * hd;
                int64_t c = 0;
                for (; c + 4 <= nv; c += 4) {
                    __m512 a0 = _mm512_load_ps(og + 16 * c), a1 = _mm512_load_ps(og + 16 * c + 16);
                    __m512 a2 = _mm512_load_ps(og + 16 * c + 32), a3 = _mm512_load_ps(og + 16 * c + 48);
                    for (int e = 0; e < cnt; e++) {
                        const __m512 w = _mm512_set1_ps(p[e]);
                        const float *vu = v16 + us[e] * hd + 16 * c;
                        a0 = _mm512_fmadd_ps(w, _mm512_load_ps(vu), a0);
                        a1 = _mm512_fmadd_ps(w, _mm512_load_ps(vu + 16), a1);
                        a2 = _mm512_fmadd_ps(w, _mm512_load_ps(vu + 32), a2);
                        a3 = _mm512_fmadd_ps(w, _mm512_load_ps(vu + 48), a3);
                    }
                    _mm512_store_ps(og + 16 * c, a0);
                    _mm512_store_ps(og + 16 * c + 16, a1);
                    _mm512_store_ps(og + 16 * c + 32, a2);
                    _mm512_store_ps(og + 16 * c + 48, a3);
                }
                for (; c < nv; c++) {
                    __m512 a0 = _mm512_load_ps(og + 16 * c);
                    for (int e = 0; e < cnt; e++)
                        a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[e]), _mm512_load_ps(v16 + us[e] * hd + 16 * c), a0);
                    _mm512_store_ps(og + 16 * c, a0);
                }
            }
            at[r] += cnt;
        }
    }
#undef VISIBLE
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < G; g++) {
            const __m512 inv = _mm512_set1_ps(1.0f / sum[r * G + g]);
            for (int64_t c = 0; c < nv; c++)
                sd_st_bf16(out + r * otok + g * hd + 16 * c, _mm512_mul_ps(_mm512_load_ps(o + (r * G + g) * hd + 16 * c), inv));
        }
}

#else
#ifndef SD_SPREAD_BYTES
#define SD_SPREAD_BYTES (256 << 10) /* a kv head's keys and values past which attention streams them (below: in L2) */
#endif
#ifndef VCHUNK
#define VCHUNK 65536 /* bytes of one kv head's values the AVX2 values passes take at a time (in L2); streamed: half */
#endif
/* One head (hd bf16, a multiple of 16) widened in the order the AVX2 kernels below use: per 16 columns,
 * the 8 even ones, then the 8 odd ones (a shift and an AND per 16 columns, not two shifts and a
 * shuffle). Queries and keys are laid out alike, so a dot product is the same sum in another order. */
static inline __m256 even_bf16(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 odd_bf16(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u))); }

static inline void widen_eo(const uint16_t *p, int64_t hd, float *f) {
    for (int64_t c = 0; c < hd; c += 16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + c));
        _mm256_store_ps(f + c, even_bf16(v));
        _mm256_store_ps(f + c + 8, odd_bf16(v));
    }
}

/* Lane u of the result: the sum of a[u]'s eight lanes, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)) whatever
 * the other vectors hold (eight keys' scores from their eight chains, one reduction for all of them). */
static inline __m256 sum8x8(const __m256 *a) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67); /* halves: keys 0-3 | 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

/* Lane u (of 4) of the result: the sum of a[u]'s eight lanes in sum8x8's order (the same bits). */
static inline __m128 sum4x8(const __m256 *a) {
    const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
}

/* Scores (unscaled) of 4 consecutive keys of one cache block (key u at kb + u * hd, bf16) with NH query
 * rows widened at qs[h] (even/odd layout): res[h] lane u. Each key is widened in registers once for the
 * NH rows (no scratch block: on a CPU with 128-bit units the widened block's stores and reloads cost more
 * than the FMAs), one chain per (row, key) over the 8-column pieces in order, reduced as sum8x8: the bits
 * of the widened-block form. HD: the head size, a compile-time constant where it is a common one (the
 * keys' addresses then need one register). */
static inline __attribute__((always_inline)) void
scores4(const int NH, const int64_t HD, const uint16_t *kb, const float *const *qs, __m128 *res, const char *pf, const char *pv) {
    __m256 a[2][4];
    for (int h = 0; h < NH; h++)
        for (int u = 0; u < 4; u++) a[h][u] = _mm256_setzero_ps();
    for (int64_t c = 0; c < HD; c += 16) {
        if (pf) { /* streaming: 4 later keys' bytes, two lines per 16 columns (a steady stream, not bursts) */
            _mm_prefetch(pf + c * 8, _MM_HINT_T0);
            _mm_prefetch(pf + c * 8 + 64, _MM_HINT_T0);
        }
        if (pv) { /* and as many of the first values the values passes will read */
            _mm_prefetch(pv + c * 8, _MM_HINT_T0);
            _mm_prefetch(pv + c * 8 + 64, _MM_HINT_T0);
        }
        __m256 qe[2], qo[2];
        for (int h = 0; h < NH; h++) {
            qe[h] = _mm256_load_ps(qs[h] + c);
            qo[h] = _mm256_load_ps(qs[h] + c + 8);
        }
        for (int u = 0; u < 4; u++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(kb + u * HD + c));
            const __m256 ke = even_bf16(x), ko = odd_bf16(x);
            for (int h = 0; h < NH; h++) {
                a[h][u] = _mm256_fmadd_ps(qe[h], ke, a[h][u]);
                a[h][u] = _mm256_fmadd_ps(qo[h], ko, a[h][u]);
            }
        }
    }
    for (int h = 0; h < NH; h++) res[h] = sum4x8(a[h]);
}

/* The 8 keys from kb (one cache block's) against NH rows: lo[h] keys 0-3, hi[h] keys 4-7. */
static inline __attribute__((always_inline)) void
scores8(const int NH, const uint16_t *kb, int64_t hd, const float *const *qs, __m128 *lo, __m128 *hi, const uint16_t *pf,
        const uint16_t *pv) {
    const char *p0 = (const char *)pf, *p1 = pf ? (const char *)(pf + 4 * hd) : NULL;
    const char *v0 = (const char *)pv, *v1 = pv ? (const char *)(pv + 4 * hd) : NULL;
    if (hd == 64) {
        scores4(NH, 64, kb, qs, lo, p0, v0);
        scores4(NH, 64, kb + 4 * 64, qs, hi, p1, v1);
    } else if (hd == 128) {
        scores4(NH, 128, kb, qs, lo, p0, v0);
        scores4(NH, 128, kb + 4 * 128, qs, hi, p1, v1);
    } else {
        scores4(NH, hd, kb, qs, lo, p0, v0);
        scores4(NH, hd, kb + 4 * hd, qs, hi, p1, v1);
    }
}

/* Whether token r sees slot j (its mask row, or its first nkeys[r] slots). */
#define SEES(r, j) (mask ? mask[(r) * mstride + (j)] != 0 : (j) < nkeys[r])

/* Asks for the 8 slots of one kv head from p (consecutive in a cache block) ahead of their use. */
static inline void prefetch8(const uint16_t *p, int64_t hd, int far) {
    for (int64_t b = 0; b < 8 * hd * 2; b += 64)
        if (far)
            _mm_prefetch((const char *)p + b, _MM_HINT_T1);
        else
            _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* The weighted sums of values of NH heads of one token (rows of one token list the same keys) for the
 * NP * 16 columns from c0 (NH * NP <= 4), over the keys of slots [jfirst, end) (a chunk of the token's keys;
 * e: the listed index of its first visible key): per key, each piece of 16 values is widened once (its even
 * and its odd columns) and multiplied into every head's accumulators, one chain per (head, column) over the
 * keys in slot order (the order the softmax listed them). The accumulators start at zero (init) or from acc
 * (head h's piece c at acc + h * hd + c0 + 16 c, the even lanes then the odd), where a chunk that is not the
 * last (fin 0) leaves them: a chain split over chunks is the same sequence of operations, so the bits do
 * not depend on the chunking. The last chunk's are times the head's inv and rounded to bf16 into out (head h
 * at out + h * hd). p: the first head's probabilities, head h's at p + h * Lmax. first: this pass streams
 * the chunk's values from memory (prefetched ahead); the later passes find them in cache. */
static inline __attribute__((always_inline)) void
values_pass(const int NH, const int NP, const uint16_t *v, const int64_t *tab, int64_t nkv, int64_t kh,
            int64_t bshift, int64_t hd, const uint8_t *mrow, int64_t end, int64_t Lmax, const float *p,
            const float *inv, int64_t c0, int first, uint16_t *out, int64_t jfirst, int64_t e, float *acc, int init,
            int fin, int64_t nj0, int64_t nend) {
    __m256 ae[4], ao[4]; /* (head h, piece c) at h * NP + c */
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NP; c++) {
            const float *a = acc + h * hd + c0 + 16 * c;
            ae[h * NP + c] = init ? _mm256_setzero_ps() : _mm256_load_ps(a);
            ao[h * NP + c] = init ? _mm256_setzero_ps() : _mm256_load_ps(a + 8);
        }
    const int64_t bs = (int64_t)1 << bshift;
    for (int64_t jb = jfirst; jb < end; jb += bs) {
        const uint16_t *base = v + slot(tab, jb, nkv, kh, bshift, hd) + c0;
        const int64_t cnt = end - jb < bs ? end - jb : bs;
        const int64_t nleft = nend - nj0 - (jb - jfirst), ncnt = nleft < bs ? nleft : bs;
        const char *nrow = ncnt > 0 ? (const char *)(v + slot(tab, nj0 + jb - jfirst, nkv, kh, bshift, hd)) : NULL;
        for (int64_t jj = 0; jj < cnt; jj++) {
            if (jj < ncnt) { /* streaming: the next chunk's values, spread over the passes */
                const char *row = nrow + jj * hd * 2;
                if (NP == 1) { /* half a line a key: line c0 / 32 of every other key, the others' in the next pass */
                    if (((jj + c0 / 16) & 1) == 0) _mm_prefetch(row + ((c0 * 2) & ~(int64_t)63), _MM_HINT_T0);
                } else
                    for (int64_t off = (c0 * 2 + 63) & ~(int64_t)63; off < (c0 + 16 * NP) * 2; off += 64)
                        _mm_prefetch(row + off, _MM_HINT_T0);
            }
            if (!nrow && first && (jj & 7) == 0 && jb + jj + 16 < end) prefetch8(v + slot(tab, jb + jj + 16, nkv, kh, bshift, hd), hd, 0);
            if (mrow && !mrow[jb + jj]) continue;
            __m256 w[4];
            for (int h = 0; h < NH; h++) w[h] = _mm256_broadcast_ss(p + h * Lmax + e);
            for (int c = 0; c < NP; c++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(base + jj * hd + 16 * c));
                const __m256 xe = even_bf16(x), xo = odd_bf16(x);
                for (int h = 0; h < NH; h++) {
                    ae[h * NP + c] = _mm256_fmadd_ps(w[h], xe, ae[h * NP + c]);
                    ao[h * NP + c] = _mm256_fmadd_ps(w[h], xo, ao[h * NP + c]);
                }
            }
            e++;
        }
    }
    if (!fin) {
        for (int h = 0; h < NH; h++)
            for (int c = 0; c < NP; c++) {
                float *a = acc + h * hd + c0 + 16 * c;
                _mm256_store_ps(a, ae[h * NP + c]);
                _mm256_store_ps(a + 8, ao[h * NP + c]);
            }
        return;
    }
    for (int h = 0; h < NH; h++) {
        const __m256 vinv = _mm256_set1_ps(inv[h]);
        for (int c = 0; c < NP; c++) {
            const __m256 lo = _mm256_unpacklo_ps(ae[h * NP + c], ao[h * NP + c]);
            const __m256 hi = _mm256_unpackhi_ps(ae[h * NP + c], ao[h * NP + c]);
            uint16_t *o = out + h * hd + c0 + 16 * c;
            sd8_st_bf16(o, _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x20), vinv));
            sd8_st_bf16(o + 8, _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x31), vinv));
        }
    }
}

/* The AVX2 twin of the AVX-512 sd_attn_rows (same arguments and scratch). Scores: eight keys at a time,
 * widened once into a scratch block for every (token, head) row; a row's score of key u is one chain of
 * FMAs over its eight-column pieces in order, then sum8x8 and the scale, listed over the token's visible
 * keys in slot order. Values: per row, register accumulators over its listed keys in that order. A
 * (token, head) score and output are one fixed sequence of operations on that token's query and the
 * keys and values it sees alone, so results do not depend on R, on the other tokens, or on where a
 * token's keys sit (tree verification). */
void sd_attn_rows(const uint16_t *q, int64_t qtok, int64_t qstride, float scale, const uint16_t *k,
                  const uint16_t *v, const int64_t *tab, int64_t nkv, int64_t kh, int64_t bshift, int64_t hd,
                  int64_t G, const uint8_t *mask, int64_t mstride, const int64_t *nkeys, int64_t R, float *s,
                  int64_t *idx, float *o, uint16_t *out, int64_t otok, int64_t jfirst, const float *sinks,
                  float softcap) {
    int64_t Lmax = mask ? mstride : 0, n[SD_MAXR];
    for (int64_t r = 0; r < R; r++) {
        n[r] = 0;
        if (!mask && nkeys[r] > Lmax) Lmax = nkeys[r];
    }
    (void)idx;
    const int64_t rows = R * G;
    /* the queries widened into o */
    for (int64_t i = 0; i < rows; i++) widen_eo(q + (i / G) * qtok + (i % G) * qstride, hd, o + i * hd);
    const __m256 vscale = _mm256_set1_ps(scale);
    const int vals_ahead = R == 1 && Lmax * hd <= 32768; /* one token: its values into L2 during the scores */
    /* A head's keys and values beyond what L2 holds (the layer's forward asked for them into L2 before its
     * qkv product, sd_attn_prefetch: only a short context's stay) are streamed: each loop asks for the
     * bytes it will read next a little at a time, keys a few blocks ahead during the scores, the values'
     * first chunk during the last scores and each next chunk during a chunk's passes. A burst of requests
     * per 8 keys (the short-context way) stalls a Zen core on its miss buffers: measured 0.6-0.7x the ticks
     * per key from memory (python -m specdec.tools.bench.ab attention --cold), the same bits. */
    const int spread = (Lmax - jfirst) * hd * 4 > SD_SPREAD_BYTES;
    const int64_t bs = (int64_t)1 << bshift;
    int64_t chunk = (spread ? VCHUNK / 2 : VCHUNK) / (hd * 2) / bs * bs;
    if (chunk < bs) chunk = bs;
    const int64_t vbase = jfirst + ((Lmax - chunk - jfirst > 0 ? Lmax - chunk - jfirst : 0) & ~(int64_t)7);
    for (int64_t j0 = jfirst; j0 < Lmax; j0 += 8) {
        const int64_t m = Lmax - j0 < 8 ? Lmax - j0 : 8;
        unsigned vis[SD_MAXR], any = 0;
        for (int64_t r = 0; r < R; r++) {
            unsigned b = 0;
            for (int64_t u = 0; u < m; u++) b |= (unsigned)SEES(r, j0 + u) << u;
            any |= vis[r] = b;
        }
        const uint16_t *kpf = spread && j0 + 32 < Lmax ? k + slot(tab, j0 + 32, nkv, kh, bshift, hd) : NULL;
        const uint16_t *vpf = spread && j0 >= vbase && jfirst + (j0 - vbase) < Lmax
                                  ? v + slot(tab, jfirst + (j0 - vbase), nkv, kh, bshift, hd) : NULL;
        if (!spread && j0 + 32 < Lmax) {
            prefetch8(k + slot(tab, j0 + 32, nkv, kh, bshift, hd), hd, 0);
            if (vals_ahead) prefetch8(v + slot(tab, j0 + 32, nkv, kh, bshift, hd), hd, 1);
        }
        if (!any) continue;
        /* the 8 slots share a cache block (8 divides its size): lanes no row lists (or past the last key)
         * read that block's other slots, finite (KVCache zeroes a block it hands out), and are dropped */
        const uint16_t *kb = k + slot(tab, j0, nkv, kh, bshift, hd);
        /* the rows two at a time: each key read and widened once per pair */
        for (int64_t i = 0, nh2; i < rows; i += nh2) {
            nh2 = i + 1 < rows ? 2 : 1;
            if (!vis[i / G] && (nh2 == 1 || !vis[(i + 1) / G])) continue;
            const float *qs[2] = {o + i * hd, o + (i + nh2 - 1) * hd};
            __m128 lo[2], hi[2];
            if (nh2 == 2)
                scores8(2, kb, hd, qs, lo, hi, i == 0 ? kpf : NULL, i == 0 ? vpf : NULL);
            else
                scores8(1, kb, hd, qs, lo, hi, i == 0 ? kpf : NULL, i == 0 ? vpf : NULL);
            for (int h = 0; h < nh2; h++) {
                const int64_t r = (i + h) / G;
                if (!vis[r]) continue;
                const __m256 sc = _mm256_mul_ps(_mm256_set_m128(hi[h], lo[h]), vscale);
                float *dst = s + (i + h) * Lmax + n[r];
                if (vis[r] == 0xffu) {
                    _mm256_storeu_ps(dst, sc);
                } else {
                    float t[8] __attribute__((aligned(32)));
                    _mm256_store_ps(t, sc);
                    int e = 0;
                    for (int u = 0; u < 8; u++)
                        if (vis[r] >> u & 1) dst[e++] = t[u];
                }
            }
        }
        for (int64_t r = 0; r < R; r++) n[r] += __builtin_popcount(vis[r]);
    }
    /* probabilities in place */
    float sum[SD_MAXR * SD_MAXG];
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < G; g++) {
            float *sg = s + (r * G + g) * Lmax;
            const int64_t nr = n[r];
            if (softcap != 0.0f) /* Gemma 2: each listed score to cap * tanh(score / cap), before the softmax */
                for (int64_t i = 0; i < nr; i += 8) {
                    const int m = nr - i >= 8 ? 8 : (int)(nr - i);
                    if (m == 8)
                        _mm256_storeu_ps(sg + i, softcap_v(_mm256_loadu_ps(sg + i), _mm256_set1_ps(softcap)));
                    else
                        sd8_store_n(sg + i, softcap_v(sd8_load_n(sg + i, m), _mm256_set1_ps(softcap)), m);
                }
            __m256 vm = _mm256_set1_ps(-INFINITY);
            int64_t i = 0;
            for (; i + 8 <= nr; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sg + i));
            float mx = sd8_hmax(vm);
            for (int64_t t = i; t < nr; t++) mx = sg[t] > mx ? sg[t] : mx;
            if (sinks && sinks[g] > mx) mx = sinks[g]; /* a sink: one more logit in the softmax */
            const __m256 vmx = _mm256_set1_ps(mx);
            __m256 acc = _mm256_setzero_ps();
            for (i = 0; i < nr; i += 8) {
                const int m = nr - i >= 8 ? 8 : (int)(nr - i);
                const __m256 x = m == 8 ? _mm256_loadu_ps(sg + i) : sd8_load_n(sg + i, m);
                const __m256 e = _mm256_and_ps(sd8_exp_neg(_mm256_sub_ps(x, vmx)), _mm256_castsi256_ps(sd8_lanes(m)));
                if (m == 8)
                    _mm256_storeu_ps(sg + i, e);
                else
                    sd8_store_n(sg + i, e, m);
                acc = _mm256_add_ps(acc, e);
            }
            sum[r * G + g] = sd8_hsum(acc);
            if (sinks) sum[r * G + g] += expf(sinks[g] - mx); /* in the denominator only: no value */
        }
    /* the weighted sums of values: a token's heads up to four at a time, 16 columns a pass (each key's
     * values widened once for them); a last single head by itself, 64 columns a pass. The keys go in chunks
     * of about VCHUNK bytes of values, every pass over a chunk before the next chunk: the passes after the
     * first find the chunk in cache, where passes over all the keys (a long context's values outgrow the
     * core's cache) would each read them from memory again. The accumulators wait between chunks in o (the
     * widened queries are not needed after the scores). */
    float inv[SD_MAXR * SD_MAXG];
    for (int64_t i = 0; i < rows; i++) inv[i] = 1.0f / sum[i];
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *mrow = mask ? mask + r * mstride : NULL;
        const int64_t end = mask ? Lmax : nkeys[r];
        float *acc = o + r * G * hd;
        int64_t e0 = 0; /* the listed index of the chunk's first visible key */
        for (int64_t j0 = jfirst; j0 < end || j0 == jfirst; j0 += chunk) {
            const int64_t j1 = end - j0 < chunk ? end : j0 + chunk;
            const int init = j0 == jfirst, fin = j1 >= end;
            int64_t nj0 = 0, nend = 0; /* streaming: the keys whose values the passes ask for, the next chunk's */
            if (spread && !fin) {
                nj0 = j1;
                nend = end - j1 < chunk ? end : j1 + chunk;
            } else if (spread && r + 1 < R) { /* the next token's first chunk */
                nj0 = jfirst;
                nend = Lmax - jfirst < chunk ? Lmax : jfirst + chunk;
            }
            for (int64_t g0 = 0; g0 < G; g0 += 4) {
                const int64_t pj0 = g0 ? 0 : nj0, pend = g0 ? 0 : nend; /* the first heads' passes ask */
                const float *p = s + (r * G + g0) * Lmax;
                uint16_t *oi = out + r * otok + g0 * hd;
                float *ag = acc + g0 * hd;
                if (G - g0 == 1) { /* a single head: its own pass over 64 columns, one broadcast per key */
                    for (int64_t c0 = 0; c0 < hd; c0 += 64) {
                        const int first = g0 == 0 && c0 == 0;
                        switch (hd - c0 >= 64 ? 4 : (int)((hd - c0) / 16)) {
                        case 4: values_pass(1, 4, v, tab, nkv, kh, bshift, hd, mrow, j1, Lmax, p, inv + r * G + g0, c0, first, oi, j0, e0, ag, init, fin, pj0, pend); break;
                        case 3: values_pass(1, 3, v, tab, nkv, kh, bshift, hd, mrow, j1, Lmax, p, inv + r * G + g0, c0, first, oi, j0, e0, ag, init, fin, pj0, pend); break;
                        case 2: values_pass(1, 2, v, tab, nkv, kh, bshift, hd, mrow, j1, Lmax, p, inv + r * G + g0, c0, first, oi, j0, e0, ag, init, fin, pj0, pend); break;
                        default: values_pass(1, 1, v, tab, nkv, kh, bshift, hd, mrow, j1, Lmax, p, inv + r * G + g0, c0, first, oi, j0, e0, ag, init, fin, pj0, pend); break;
                        }
                    }
                    break;
                }
                for (int64_t c0 = 0, step; c0 < hd; c0 += step) {
                    const int first = g0 == 0 && c0 == 0;
                    step = 16;
                    if (G - g0 == 2 && hd - c0 >= 32) { /* two heads: 32 columns a pass (8 accumulators) */
                        values_pass(2, 2, v, tab, nkv, kh, bshift, hd, mrow, j1, Lmax, p, inv + r * G + g0, c0, first, oi, j0, e0, ag, init, fin, pj0, pend);
                        step = 32;
                        continue;
                    }
                    switch (G - g0 >= 4 ? 4 : (int)(G - g0)) {
                    case 4: values_pass(4, 1, v, tab, nkv, kh, bshift, hd, mrow, j1, Lmax, p, inv + r * G + g0, c0, first, oi, j0, e0, ag, init, fin, pj0, pend); break;
                    case 3: values_pass(3, 1, v, tab, nkv, kh, bshift, hd, mrow, j1, Lmax, p, inv + r * G + g0, c0, first, oi, j0, e0, ag, init, fin, pj0, pend); break;
                    case 2: values_pass(2, 1, v, tab, nkv, kh, bshift, hd, mrow, j1, Lmax, p, inv + r * G + g0, c0, first, oi, j0, e0, ag, init, fin, pj0, pend); break;
                    default: values_pass(1, 1, v, tab, nkv, kh, bshift, hd, mrow, j1, Lmax, p, inv + r * G + g0, c0, first, oi, j0, e0, ag, init, fin, pj0, pend); break;
                    }
                }
            }
            if (mrow)
                for (int64_t j = j0; j < j1; j++) e0 += mrow[j] != 0;
            else
                e0 += j1 - j0;
            if (fin) break;
        }
    }
}
#undef SEES
#endif

/* Asks for the keys and values of slots [0, L) of kv head kh (a paged layer, through the row's block
 * table tab) into L2: issued by the native forward before a layer's qkv product, so that attention finds
 * the cache that the weights evicted since the last layer already read in beside the product's stream,
 * instead of waiting on it key by key. */
void sd_attn_prefetch(const uint16_t *k, const uint16_t *v, const int64_t *tab, int64_t nkv, int64_t kh, int64_t bshift,
                      int64_t hd, int64_t j0, int64_t L) {
    const int64_t bs = (int64_t)1 << bshift;
    for (int64_t jb = j0 & ~(bs - 1); jb < L; jb += bs) {
        const int64_t off = slot(tab, jb, nkv, kh, bshift, hd), bytes = (L - jb < bs ? L - jb : bs) * hd * 2;
        for (int64_t b = 0; b < bytes; b += 64) {
            _mm_prefetch((const char *)(k + off) + b, _MM_HINT_T1);
            _mm_prefetch((const char *)(v + off) + b, _MM_HINT_T1);
        }
    }
}

/* One query token (sd_attn_rows with R = 1): keys listed by mrow (L bytes) or, mrow NULL, [0, L). */
void sd_attn_item(const uint16_t *q, int64_t qstride, float scale, const uint16_t *k, const uint16_t *v,
                  const int64_t *tab, int64_t nkv, int64_t kh, int64_t bshift, int64_t hd, int64_t G,
                  const uint8_t *mrow, int64_t L, float *s, int64_t *idx, uint16_t *out) {
    float o[SD_MAXG * SD_MAXHD] __attribute__((aligned(64)));
    sd_attn_rows(q, 0, qstride, scale, k, v, tab, nkv, kh, bshift, hd, G, mrow, L, &L, 1, s, idx, o, out, 0, 0, NULL, 0.0f);
}

/* q (B, nh, T, hd); k, v: one layer of the paged cache, (blocks, nkv, 1 << bshift, hd); table
 * (table rows, max_blocks): a row's pool block of each of its 1 << bshift slot blocks; rows (B,) table
 * rows; mask (B, T, L) bytes; out (B, T, nh, hd). hd a multiple of 16, at most 256; nh / nkv at most
 * 16. Returns 0, -1 on unsupported shapes, -2 without memory. */
int sd_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *table,
                 const int64_t *rows, const uint8_t *mask, uint16_t *out, int64_t B, int64_t nh, int64_t nkv,
                 int64_t T, int64_t hd, int64_t L, int64_t max_blocks, int64_t bshift, float scale) {
    const int64_t G = nh / nkv;
    if (hd % 16 || hd > SD_MAXHD || G > SD_MAXG || nh % nkv || bshift < 3) return -1;
    int failed = 0;
#pragma omp parallel
    {
        float *s = (float *)malloc(sizeof(float) * (size_t)(G * L > 0 ? G * L : 1));
        int64_t *idx = (int64_t *)malloc(sizeof(int64_t) * (size_t)(L > 0 ? L : 1));
        if (!s || !idx) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < B * nkv * T; item++) {
            if (!s || !idx) continue;
            const int64_t b = item / (nkv * T), kh = (item / T) % nkv, t = item % T;
            sd_attn_item(q + ((b * nh + kh * G) * T + t) * hd, T * hd, scale, k, v, table + rows[b] * max_blocks,
                         nkv, kh, bshift, hd, G, mask + (b * T + t) * L, L, s, idx,
                         out + ((b * T + t) * nh + kh * G) * hd);
        }
        free(s);
        free(idx);
    }
    return failed ? -2 : 0;
}
