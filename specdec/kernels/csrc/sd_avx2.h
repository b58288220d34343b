/* The AVX2 (+ FMA, F16C) twins of sd.h's helpers, 8 lanes at a time, for CPUs without AVX-512 VNNI (AMD Zen
 * 1-3, Intel client cores since Alder Lake, Skylake-SP's AVX-512 without VNNI): the avx2 rung. Included by
 * sd.h only; the kernels' #else branches use them.
 *
 * What stays bit-identical to the AVX-512 rungs (avx512-bf16 and avx512): the activations' int8
 * quantization (sd8_quantize_group: the same scale, rounding and sums) and so every quantized product
 * (integer group dots are exact, and the per-group float steps are the same fused multiply-adds in the
 * same order). What differs in the last bits: bf16 products (a pair of FMAs per input pair, the even
 * input's first, instead of vdpbf16ps or the avx512 rung's odd-first pair) and the order of the
 * horizontal sums in norms and softmax. Either way each row's result never depends on the rows beside
 * it, which is what exact speculation needs. */
#ifndef SD_AVX2_H
#define SD_AVX2_H
#define SD_AVX2 1
/* the avx2-vnni rung: AVX-VNNI's vpdpbusd in 256 bits (Intel client cores since Alder Lake, Sapphire Rapids,
 * Zen 5) for the quantized products' integer dots, which are exact either way: the same bits as avx2 */
#ifdef __AVXVNNI__
#define SD_AVX2_VNNI 1
#endif

static inline __m256 sd8_ld_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* the first n (0..8) lanes on, as a vector mask */
static inline __m256i sd8_lanes(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
static inline __m256 sd8_load_n(const float *p, int n) { return _mm256_maskload_ps(p, sd8_lanes(n)); }
static inline void sd8_store_n(float *p, __m256 v, int n) { _mm256_maskstore_ps(p, sd8_lanes(n), v); }

/* v rounded to bf16, nearest even, as 32-bit lanes (the bf16 bits in the high half); NaN -> quiet NaN */
static inline __m256i sd8_rne(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)),
                                       _mm256_set1_epi32((int)0xffff0000u));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan));
}

/* v rounded to bf16 and widened back (PyTorch's rounding after every bf16 operation) */
static inline __m256 sd8_round_bf16(__m256 v) { return _mm256_castsi256_ps(sd8_rne(v)); }

static inline void sd8_st_bf16(uint16_t *p, __m256 v) {
    const __m256i h = _mm256_srli_epi32(sd8_rne(v), 16);
    const __m256i k = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08); /* lanes 0-3, 4-7 */
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(k));
}

static inline float sd8_hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

static inline float sd8_hmax(__m256 v) {
    const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

static inline int32_t sd8_hsum_epi32(__m256i v) {
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}

/* sd_quantize_group of the AVX-512 build, the same arithmetic (max is exact in any order, the integer
 * sum too, conversions round to nearest even). */
static inline void sd_quantize_group(const uint16_t *p, int8_t *q, float *a, float *am) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 x[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = sd8_ld_bf16(p + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_and_ps(x[i], absmask));
    }
    const float amax = sd8_hmax(mx);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i c[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], vinv)); /* nearest even */
        sum = _mm256_add_epi32(sum, c[i]);
    }
    /* pack 32 int32 (each within [-127, 127]) to int8 in order: packs work per 128-bit lane */
    const __m256i w01 = _mm256_packs_epi32(c[0], c[1]), w23 = _mm256_packs_epi32(c[2], c[3]);
    const __m256i b = _mm256_packs_epi16(w01, w23);
    const __m256i ord = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, ord);
    const float sc = amax / 127.0f;
    *a = sc;
    *am = sc * (float)sd8_hsum_epi32(sum);
}

/* exp(x) for x <= 0 (attention.c) */
__m256 sd8_exp_neg(__m256 x);

#endif
