/* Declarations shared by the native kernels (qmm.c, attention.c, products.c, forward.c, moe.c, recurrent.c,
 * repack.c). */
#ifndef SD_H
#define SD_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define SD_GS 32 /* inputs per quantization group */
#define SD_TN 16 /* output columns per tile */

/* scalar bf16 helpers shared by forward.c and moe.c: a bf16 widened to float, and f rounded to bf16
 * (nearest even, as a tensor's .to(torch.bfloat16); f finite) widened back */
static inline float bf16_f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* Four rungs, one source (kernels/__init__.py names them and picks one from the CPU's flags):
 *   avx512-amx   avx512-bf16 with AMX-INT8 tiles (SD_AMX): a quantized product of 16+ rows takes its integer
 *                dots from TDPBSUD (qmm_amx.h), the same integers, so the same bits as avx512-bf16
 *   avx512-bf16  AVX-512 F/BW/VL/DQ with VNNI and BF16: vpdpbusd, vdpbf16ps, vcvtneps2bf16 (SD_AVX512, SD_BF16)
 *   avx512       AVX-512 F/BW/VL/DQ with VNNI, no BF16 (Cascade Lake, Ice Lake, most cloud Xeons, a
 *                Sapphire Rapids whose hypervisor hides BF16): the same kernels, the BF16 instructions
 *                emulated with AVX-512F by the helpers below (SD_AVX512 alone)
 *   avx2         AVX2 with FMA and F16C (sd_avx2.h: 8-lane twins; the same layouts, the same integer
 *                products, bf16 pairs multiplied by FMA)
 * -march=native picks the one this CPU has (AVX-512 without VNNI, Skylake-SP, takes the avx2 branch).
 * Each rung is exact against itself (a row's bits never depend on the rows beside it). Across rungs the
 * quantized products are bit-identical (integer dots, the same FMAs); the bf16 products are not: the
 * avx512 rung's two FMAs per bf16 pair round like vdpbf16ps on normal numbers (the odd input's product,
 * then the even one's: on AMD Zen 4 the same bits for normal inputs, checked on 32 M random lanes), but
 * vdpbf16ps flushes denormal inputs and results to zero (DAZ, FTZ) and the FMAs do not, and no other
 * CPU's vdpbf16ps was compared; so the avx512 rung is exact against ITSELF, like the avx2 rung. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
#define SD_AVX512 1
#ifdef __AVX512BF16__
#define SD_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SD_AMX 1 /* the avx512-amx rung: the quantized products of 16+ rows on AMX tiles (qmm_amx.h) */
#endif
#endif

static inline __m512 sd_ld_bf16(const uint16_t *p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

/* The BF16 instructions behind two bodies (SD_BF16: the instruction; else an AVX-512F emulation).
 *
 * sd_pairs: 16 lanes of bf16 pairs (a 32-bit lane holds inputs 2i, low half, and 2i + 1, high half) as
 * the dot product takes them: as they are for vdpbf16ps, widened to fp32 once (even and odd inputs) for
 * the emulation, so a weight vector used by several rows is widened once. sd_pairs_of(v) from a vector,
 * sd_pairs_set1(pair) one pair in every lane; sd_dot_pairs(acc, a, b) = acc + a.odd b.odd + a.even b.even
 * lane by lane (vdpbf16ps's order: the odd product first; each bf16 product is exact in fp32, so each FMA
 * rounds once, as vdpbf16ps's steps do).
 *
 * sd_cvt_bf16(v): 16 floats rounded to bf16, nearest even, exactly as vcvtneps2bf16 (the emulation equals
 * the instruction on every one of the 2^32 inputs but NaNs, checked on AMD Zen 4: denormals to a signed
 * zero as the instruction does, then the rounding bias 0x7fff + the kept part's lowest bit, infinities
 * kept, overflow to infinity); a NaN becomes the quiet NaN 0x7fc0 (sd_avx2.h's sd8_rne; the instruction
 * keeps the sign and payload). */
#ifdef SD_BF16
typedef __m512i sd_pairs;
static inline sd_pairs sd_pairs_of(__m512i v) { return v; }
static inline sd_pairs sd_pairs_set1(int32_t pair) { return _mm512_set1_epi32(pair); }
static inline __m512 sd_dot_pairs(__m512 acc, sd_pairs a, sd_pairs b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
static inline __m256i sd_cvt_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
#else
typedef struct {
    __m512 even, odd;
} sd_pairs;
static inline sd_pairs sd_pairs_of(__m512i v) {
    const sd_pairs r = {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
                        _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)))};
    return r;
}
static inline sd_pairs sd_pairs_set1(int32_t pair) {
    const uint32_t u = (uint32_t)pair;
    const sd_pairs r = {_mm512_castsi512_ps(_mm512_set1_epi32((int)(u << 16))),
                        _mm512_castsi512_ps(_mm512_set1_epi32((int)(u & 0xffff0000u)))};
    return r;
}
static inline __m512 sd_dot_pairs(__m512 acc, sd_pairs a, sd_pairs b) {
    return _mm512_fmadd_ps(a.even, b.even, _mm512_fmadd_ps(a.odd, b.odd, acc));
}
/* v rounded to bf16 as 32-bit lanes (the bf16 bits in the high half, the low half zero) */
static inline __m512i sd_rne(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
                                 _mm512_set1_epi32((int)0xffff0000u));
    const __mmask16 zero_exp = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000)); /* zero, denormal */
    r = _mm512_mask_and_epi32(r, zero_exp, u, _mm512_set1_epi32((int)0x80000000u));
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
}
static inline __m256i sd_cvt_bf16(__m512 v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(sd_rne(v), 16)); }
#endif

static inline void sd_st_bf16(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, sd_cvt_bf16(v)); }

/* v rounded to bf16 (nearest even) and widened back: PyTorch's rounding after every bf16 operation. */
static inline __m512 sd_round_bf16(__m512 v) {
#ifdef SD_BF16
    __m512i w = _mm512_cvtepu16_epi32(sd_cvt_bf16(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#else
    return _mm512_castsi512_ps(sd_rne(v));
#endif
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
#error "specdec kernels need AVX-512 (F, BW, VL, DQ, VNNI; BF16 used where there) or AVX2 with FMA and F16C"
#endif

/* A routine written once for both widths: SDV(op) is the build's intrinsic (_mm512_op or _mm256_op),
 * SDV_T / SDV_I its float / integer vector, SDV_W its lanes, and the rung's vector operations that are not
 * one intrinsic of the same name on both (each the instructions the rung's kernels used before they shared
 * it, so the shared routines compile to the same code):
 *   sdv_ld_bf16, sdv_st_bf16, sdv_round_bf16  the bf16 helpers of that width (sd_*, sd8_*)
 *   sdv_hsum(v)                the sum of v's lanes (the rung's order); sdv_exp_neg(x) exp(x) for x <= 0
 *   sdv_abs(x)                 |x|
 *   sdv_select_gt(a, b, x, y)  a > b ? y : x
 *   sdv_sign_of(t, x)          t with x's sign bit (t's own clear)
 *   sdv_mask                   a lane mask (a bit per lane on AVX-512, a vector of all-ones lanes on AVX2)
 *   sdv_lt(a, b)               the mask of a < b
 *   sdv_mul_unless(m, a, b)    a b, 0 where m
 *   sdv_mul_where(m, s, a, b)  a b where m, else s
 *   sdv_round_nearest(x)       x rounded to an integer, nearest even
 *   sdv_as_float(v)            v's bits as floats
 * all lane by lane. A new rung of another width adds its column here. */
#ifdef SD_AVX512
#define SDV(op) _mm512_##op
#define SDV_T __m512
#define SDV_I __m512i
#define SDV_W 16
#define sdv_ld_bf16 sd_ld_bf16
#define sdv_st_bf16 sd_st_bf16
#define sdv_round_bf16 sd_round_bf16
#define sdv_hsum _mm512_reduce_add_ps
#define sdv_exp_neg sd_exp_neg
#define sdv_abs _mm512_abs_ps
static inline __m512 sdv_select_gt(__m512 a, __m512 b, __m512 x, __m512 y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), x, y);
}
static inline __m512 sdv_sign_of(__m512 t, __m512 x) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(_mm512_castps_si512(x), sign)));
}
typedef __mmask16 sdv_mask;
static inline sdv_mask sdv_lt(__m512 a, __m512 b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
static inline __m512 sdv_mul_unless(sdv_mask m, __m512 a, __m512 b) { return _mm512_maskz_mul_ps(~m, a, b); }
static inline __m512 sdv_mul_where(sdv_mask m, __m512 s, __m512 a, __m512 b) { return _mm512_mask_mul_ps(s, m, a, b); }
static inline __m512 sdv_round_nearest(__m512 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }
#define sdv_as_float _mm512_castsi512_ps
#else
#define SDV(op) _mm256_##op
#define SDV_T __m256
#define SDV_I __m256i
#define SDV_W 8
#define sdv_ld_bf16 sd8_ld_bf16
#define sdv_st_bf16 sd8_st_bf16
#define sdv_round_bf16 sd8_round_bf16
#define sdv_hsum sd8_hsum
#define sdv_exp_neg sd8_exp_neg
static inline __m256 sdv_abs(__m256 x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
static inline __m256 sdv_select_gt(__m256 a, __m256 b, __m256 x, __m256 y) {
    return _mm256_blendv_ps(x, y, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
}
static inline __m256 sdv_sign_of(__m256 t, __m256 x) { return _mm256_or_ps(t, _mm256_and_ps(x, _mm256_set1_ps(-0.0f))); }
typedef __m256 sdv_mask;
static inline sdv_mask sdv_lt(__m256 a, __m256 b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
static inline __m256 sdv_mul_unless(sdv_mask m, __m256 a, __m256 b) { return _mm256_andnot_ps(m, _mm256_mul_ps(a, b)); }
static inline __m256 sdv_mul_where(sdv_mask m, __m256 s, __m256 a, __m256 b) {
    return _mm256_blendv_ps(s, _mm256_mul_ps(a, b), m);
}
static inline __m256 sdv_round_nearest(__m256 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#define sdv_as_float _mm256_castsi256_ps
#endif

/* sigmoid(g) = 1 / (1 + e^-g) lane by lane: 1 / (1 + e) for g >= 0, e / (1 + e) below, e = exp(-|g|), with an
 * exponential of a non-positive argument only and one division (products.c's activations, forward.c's gated
 * attention output, recurrent.c's mixers) */
static inline SDV_T sigmoid_v(SDV_T g) {
    const SDV_T e = sdv_exp_neg(SDV(sub_ps)(SDV(setzero_ps)(), sdv_abs(g)));
    const sdv_mask neg = sdv_lt(g, SDV(setzero_ps)());
    const SDV_T r = SDV(div_ps)(SDV(set1_ps)(1.0f), SDV(add_ps)(SDV(set1_ps)(1.0f), e));
    return sdv_mul_where(neg, r, e, r);
}

/* silu(g) = g sigmoid(g) */
static inline SDV_T silu_v(SDV_T g) { return SDV(mul_ps)(g, sigmoid_v(g)); }

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
                  const uint16_t *st, int64_t N, int bits, int fmt, const float *bias, void *y, int out_f32,
                  float *part, int64_t t0, int64_t t1);

/* One query token's G heads against one kv head of a paged layer (attention.c): q (G heads, head i at
 * q + i * qstride), keys listed by mrow (L bytes) or, mrow NULL, the slots [0, L); s: G * L floats and
 * idx: L int64 of scratch; out: G * hd bf16, heads contiguous. */
void sd_attn_item(const uint16_t *q, int64_t qstride, float scale, const uint16_t *k, const uint16_t *v,
                  const int64_t *tab, int64_t nkv, int64_t kh, int64_t bshift, int64_t hd, int64_t G,
                  const uint8_t *mrow, int64_t L, float *s, int64_t *idx, uint16_t *out);

/* R tokens of one cache row against one kv head, each key read once for all (attention.c). jfirst: no key
 * before it is visible to any of the R tokens (a sliding window's start; a multiple of 16 and of the cache
 * block), so neither pass reads or prefetches them: the same bits as starting at 0. sinks: the G heads'
 * sink logits (gpt-oss: each one more term of its softmax's denominator, a key without a value), or NULL.
 * softcap: Gemma 2's attention soft-capping, each scaled score to softcap * tanh(score / softcap) before the
 * mask and softmax (the sinks stay as they are); 0: none. */
void sd_attn_rows(const uint16_t *q, int64_t qtok, int64_t qstride, float scale, const uint16_t *k,
                  const uint16_t *v, const int64_t *tab, int64_t nkv, int64_t kh, int64_t bshift, int64_t hd,
                  int64_t G, const uint8_t *mask, int64_t mstride, const int64_t *nkeys, int64_t R, float *s,
                  int64_t *idx, float *o, uint16_t *out, int64_t otok, int64_t jfirst, const float *sinks,
                  float softcap);

/* The keys and values of slots [j0, L) of kv head kh into L2, ahead of sd_attn_rows (attention.c). */
void sd_attn_prefetch(const uint16_t *k, const uint16_t *v, const int64_t *tab, int64_t nkv, int64_t kh, int64_t bshift,
                      int64_t hd, int64_t j0, int64_t L);

#define SD_MAXG 16
#define SD_MAXHD 256
#define SD_MAXR 8 /* tokens per sd_attn_rows call */

/* ---- the operations forward.c and moe.c share (products.c) ------------------------------------- */

typedef struct {
    int64_t kind; /* 0: bf16 tiles (ceil(N/16), K/2, 16, 2); 1-3: quantized (qmm.c layout), its scale format */
    int64_t bits; /* 4 or 8 when quantized */
    int64_t N, K;
    const void *w;      /* bf16 tiles or codes */
    const uint16_t *st; /* quantized: fp16 scales and offsets */
    const float *bias;  /* (N,) fp32 or NULL */
} sd_mat;

/* The tiles [t0, t1) of y (M, N) = x W^T (products.c): x bf16 (M, K) for bf16 weights, or quantized
 * (xq, xa, xam) for quantized ones; part: ceil(N/16) * M * 16 floats. No barrier inside. */
void sd_product_tiles(const sd_mat *m, const uint16_t *x, const int8_t *xq, const float *xa, const float *xam,
                      int64_t M, void *y, int out_f32, float *part, int64_t t0, int64_t t1);

/* o[c] = act(gate[c]) * up[c] for c in [c0, c1) (multiples of 16), each step rounded to bf16 as the
 * reference's (models/moe.py activate): act 0 SiLU, 1 tanh GeLU, 2 gpt-oss's clamped SwiGLU (limit, alpha). */
void sd_act_mul(int act, float limit, float alpha, uint16_t *o, const uint16_t *gp, const uint16_t *up, int64_t c0,
                int64_t c1);

/* The avx2 rung's bf16 products widen their rows into a per-thread scratch that grows on demand
 * (products.c); a thread whose scratch cannot grow skips its share and sets this: the entry points
 * (sd_forward, sd_matmul) clear it before and return -4 when it is set after. Unused on AVX-512. Hidden: read
 * where it was a file's own static, not through the library's symbol table. */
extern int sd_xf_failed __attribute__((visibility("hidden")));

/* A mixture-of-experts MLP (models/moe.py MoE; the work: moe.c). */
typedef struct {
    int64_t E, k;       /* experts, and how many each row takes */
    int64_t router;     /* 0: softmax over all E in fp32, the k largest; 1: the k largest logits, softmax over them;
                         * 2: grouped sigmoid (the fields at the end) */
    int64_t norm_topk;  /* routers 0 and 2: the k weights divided by their sum */
    int64_t inter;      /* each expert's intermediate size */
    int64_t shared_inter; /* the shared expert's (Qwen2-MoE, GLM-4.5), 0: none */
    sd_mat gate;        /* the router (E, C): bf16 tiles, no bias */
    const uint16_t *gate_bias; /* (E,) bf16 added to the logits (rounded), or NULL */
    const sd_mat *experts;     /* (E, 2): each expert's gate_up (gate's inter columns, then up's), down */
    sd_mat shared_gate_up, shared_down, shared_gate; /* the shared expert and its gate (1, C) bf16 */
    /* router 2: the grouped sigmoid router (GLM-4.5; moe.c route_sigmoid_group) */
    const float *correction;    /* (E,) fp32 added to the sigmoid scores for choosing only, or NULL */
    int64_t n_group, topk_group; /* the experts in n_group equal groups, of which the topk_group best compete */
    double routed_scale;        /* the k weights times this */
    int64_t shared_ungated;     /* the shared expert added whole, without a gate (GLM-4.5; shared_gate unused) */
} sd_moe;

/* One MoE layer's call from inside forward.c's parallel region, by every thread (moe.c says the phases). */
typedef struct {
    const sd_moe *moe;  /* the layer's */
    const sd_moe *dims; /* the largest sizes of any layer (E, k, inter, shared_inter): the buffers' layout */
    int64_t M, C, nt;
    const uint16_t *x;  /* (M, C) the rows' normalized input; quantized (xq, xa, xam) for quantized experts */
    const int8_t *xq;
    const float *xa, *xam;
    char *shared;       /* sd_moe_shared_bytes of the threads' shared buffers */
    char *own;          /* sd_moe_own_bytes of this thread's */
    int64_t act;        /* the activation (sd_act_mul) */
    float limit, alpha;
    int64_t *stats;     /* (E, 3) += rows routed to each expert, its gate/up and down tiles computed; or NULL */
} sd_moe_call;

int64_t sd_moe_shared_bytes(const sd_moe *dims, int64_t M, int64_t C);
int64_t sd_moe_own_bytes(const sd_moe *dims, int64_t M, int64_t C);
/* phase 0: router, shared expert's gate and gate/up; 1: experts' gate/up, shared down; 2: experts' down */
int64_t sd_moe_units(const sd_moe_call *c, int phase);
void sd_moe_run(const sd_moe_call *c, int phase, int64_t u0, int64_t u1);
/* after phase 0, before 1, in every thread: the routing of every row into the thread's own plan;
 * record: this thread adds the rows per expert to stats */
void sd_moe_route(const sd_moe_call *c, int record);
/* after phase 2: row t's output (bf16, C) into out */
void sd_moe_combine(const sd_moe_call *c, int64_t t, uint16_t *out);
/* ---- a hybrid model's recurrent mixers (recurrent.c; models/recurrent.py is the reference) -------- */

/* One recurrent layer's call from inside forward.c's parallel region. The tokens form runs: consecutive
 * tokens of one cache row at consecutive positions (a row's block, its prompt chunks); a run starting at
 * position p0 reads the convolution inputs of positions p0 - width + 1 .. p0 - 1 and the recurrent state
 * after p0 - 1 from the row's rings (entry p % slots; zeros before position 0; models/native.py checked
 * that the entries hold those positions), and its last min(T, slots) tokens write theirs. */
typedef struct {
    int64_t kind;             /* 1: LFM2's short convolution, 2: Qwen3.5's gated delta-net */
    int64_t M;                /* tokens */
    int64_t D;                /* channels convolved: C (1), 2 hk dk + hv dv (2) */
    int64_t N;                /* in_proj's columns: 3C (1: b, c, x), D + hv dv + 2 hv (2: qkv, z, b, a) */
    int64_t width;            /* the convolution's taps */
    int64_t hk, hv, dk, dv;   /* 2: key heads, value heads and their sizes */
    float eps;                /* 2: the gated RMSNorm's */
    const float *conv_wt;     /* (width, D) fp32: the depthwise weights, tap-major */
    const float *conv_b;      /* (D,) fp32, or NULL */
    const float *neg_a;       /* 2: (hv,) -exp(A_log), fp32 */
    const float *dt_bias;     /* 2: (hv,) fp32 */
    const uint16_t *gnorm;    /* 2: (dv,) bf16, the gated norm's weight */
    const uint16_t *proj;     /* (M, N) in_proj's output, bf16 */
    const int64_t *pos, *row; /* (M,) each token's position and cache row */
    const int64_t *run0, *run1; /* (M,) the first token of its run and one past its last */
    uint16_t *ring_in;        /* (rows, slots, D) the convolution's inputs, bf16 */
    float *ring_state;        /* 2: (rows, slots, hv, dk, dv) the states after each position, fp32 */
    int64_t slots;
    uint16_t *mix;            /* 2: (M, D) the convolution's output after SiLU, bf16 */
    uint16_t *out;            /* (M, K) out_proj's input, K = C (1) or hv dv (2), bf16 */
    int8_t *xq;               /* its int8 form for a quantized out_proj (groups of 32), or NULL */
    float *xa, *xam;
} sd_mixer_call;

/* the convolution phase: units of (token, 32 channels) for 1 (C / 32 per token; 1's output, quantized
 * groups too), (token, 16 channels) for 2 (the SiLU of the convolution into mix) */
int64_t sd_mixer_conv_units(const sd_mixer_call *c);
void sd_mixer_conv(const sd_mixer_call *c, int64_t u0, int64_t u1);
/* 2: value head h over the run of T tokens from t0, token by token from the state after its first
 * position - 1: the gated delta rule in fp32, each kept position's state into the ring, the gated norm's
 * output into out (quantized when xq and dv % 32 == 0); scratch: sd_mixer_scratch_floats floats */
int64_t sd_mixer_scratch_floats(int64_t dk, int64_t dv);
void sd_mixer_delta(const sd_mixer_call *c, int64_t t0, int64_t T, int64_t h, float *scratch);
/* the convolution inputs of the kept tokens in [t0, t1) into the ring (after every read of this layer) */
void sd_mixer_store(const sd_mixer_call *c, int64_t t0, int64_t t1);
#endif
