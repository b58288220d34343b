/* Declarations shared by the native kernels (qmm.c, attention.c, forward.c). */
#ifndef SD_H
#define SD_H
#include <immintrin.h>
#include <stdint.h>

#define SD_GS 32 /* inputs per quantization group */
#define SD_TN 16 /* output columns per tile */

/* Two instruction sets, one source: AVX-512 with VNNI and BF16 (vpdpbusd, vdpbf16ps), or AVX2 with FMA
 * and F16C (sd_avx2.h: 8-lane twins; the same layouts, the same integer products, bf16 pairs multiplied
 * by FMA). -march=native picks the one this CPU has. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512BF16__)
#define SD_AVX512 1

static inline __m512 sd_ld_bf16(const uint16_t *p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

static inline void sd_st_bf16(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); }

/* v rounded to bf16 (nearest even) and widened back: PyTorch's rounding after every bf16 operation. */
static inline __m512 sd_round_bf16(__m512 v) {
    __m512i w = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* One group of 32 bf16 inputs -> int8 codes (symmetric, scale max|x| / 127, nearest even), its scale
 * *a and *am = scale * sum(codes): what the quantized products multiply (qmm.c). */
static inline void sd_quantize_group(const uint16_t *p, int8_t *q, float *a, float *am) {
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 lo = sd_ld_bf16(p), hi = sd_ld_bf16(p + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, absmask), _mm512_and_ps(hi, absmask)));
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512 vinv = _mm512_set1_ps(inv);
    __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv)); /* round to nearest even */
    __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(qhi));
    int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    float sc = amax / 127.0f;
    *a = sc;
    *am = sc * (float)sum;
}

/* exp(x) for x <= 0 (attention.c). */
__m512 sd_exp_neg(__m512 x);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "sd_avx2.h"
#else
#error "specdec kernels need AVX-512 (VNNI, BF16) or AVX2 with FMA and F16C"
#endif

/* A routine written once for both widths: SDV(op) is the build's intrinsic (_mm512_op or _mm256_op),
 * SDV_T / SDV_I its float / integer vector, SDV_W its lanes, sdv_* the bf16 helpers of that width. */
#ifdef SD_AVX512
#define SDV(op) _mm512_##op
#define SDV_T __m512
#define SDV_I __m512i
#define SDV_W 16
#define sdv_ld_bf16 sd_ld_bf16
#define sdv_st_bf16 sd_st_bf16
#define sdv_round_bf16 sd_round_bf16
#define sdv_hsum _mm512_reduce_add_ps
#else
#define SDV(op) _mm256_##op
#define SDV_T __m256
#define SDV_I __m256i
#define SDV_W 8
#define sdv_ld_bf16 sd8_ld_bf16
#define sdv_st_bf16 sd8_st_bf16
#define sdv_round_bf16 sd8_round_bf16
#define sdv_hsum sd8_hsum
#endif

/* e^x for x <= -87 clamped (n = x log2(e) rounded to an integer, given): x - n ln 2 in two steps, the
 * polynomial p ~ e^r (Cephes' expf), and e = 2^n as an exponent field; both widths' sd_exp_neg. */
#define SD_EXP_STEPS(x, n, p, e)                                                                         \
    SDV_T r = SDV(fnmadd_ps)(n, SDV(set1_ps)(0.693359375f), x);                                          \
    r = SDV(fnmadd_ps)(n, SDV(set1_ps)(-2.12194440e-4f), r);                                             \
    SDV_T p = SDV(set1_ps)(1.9875691500e-4f);                                                            \
    p = SDV(fmadd_ps)(p, r, SDV(set1_ps)(1.3981999507e-3f));                                             \
    p = SDV(fmadd_ps)(p, r, SDV(set1_ps)(8.3334519073e-3f));                                             \
    p = SDV(fmadd_ps)(p, r, SDV(set1_ps)(4.1665795894e-2f));                                             \
    p = SDV(fmadd_ps)(p, r, SDV(set1_ps)(1.6666665459e-1f));                                             \
    p = SDV(fmadd_ps)(p, r, SDV(set1_ps)(5.0000001201e-1f));                                             \
    p = SDV(fmadd_ps)(p, SDV(mul_ps)(r, r), SDV(add_ps)(r, SDV(set1_ps)(1.0f)));                         \
    SDV_I e = SDV(slli_epi32)(SDV(add_epi32)(SDV(cvtps_epi32)(n), SDV(set1_epi32)(127)), 23)

/* quantized products (qmm.c) */
void sd_quantize_rows(const uint16_t *x, int64_t M, int64_t K, int8_t *xq, float *a, float *am);
void sd_qmm_range(const int8_t *xq, const float *a, const float *am, int64_t M, int64_t K, const uint8_t *w,
                  const uint16_t *st, int64_t N, int bits, const float *bias, void *y, int out_f32, float *part,
                  int64_t t0, int64_t t1);

/* One query token's G heads against one kv head of a paged layer (attention.c): q (G heads, head i at
 * q + i * qstride), keys listed by mrow (L bytes) or, mrow NULL, the slots [0, L); s: G * L floats and
 * idx: L int64 of scratch; out: G * hd bf16, heads contiguous. */
void sd_attn_item(const uint16_t *q, int64_t qstride, float scale, const uint16_t *k, const uint16_t *v,
                  const int64_t *tab, int64_t nkv, int64_t kh, int64_t bshift, int64_t hd, int64_t G,
                  const uint8_t *mrow, int64_t L, float *s, int64_t *idx, uint16_t *out);

/* R tokens of one cache row against one kv head, each key read once for all (attention.c). jfirst: no key
 * before it is visible to any of the R tokens (a sliding window's start; a multiple of 16 and of the cache
 * block), so neither pass reads or prefetches them: the same bits as starting at 0. */
void sd_attn_rows(const uint16_t *q, int64_t qtok, int64_t qstride, float scale, const uint16_t *k,
                  const uint16_t *v, const int64_t *tab, int64_t nkv, int64_t kh, int64_t bshift, int64_t hd,
                  int64_t G, const uint8_t *mask, int64_t mstride, const int64_t *nkeys, int64_t R, float *s,
                  int64_t *idx, float *o, uint16_t *out, int64_t otok, int64_t jfirst);

/* The keys and values of slots [j0, L) of kv head kh into L2, ahead of sd_attn_rows (attention.c). */
void sd_attn_prefetch(const uint16_t *k, const uint16_t *v, const int64_t *tab, int64_t nkv, int64_t kh, int64_t bshift,
                      int64_t hd, int64_t j0, int64_t L);

#define SD_MAXG 16
#define SD_MAXHD 256
#define SD_MAXR 8 /* tokens per sd_attn_rows call */
#endif
