/* Small-batch quantized matrix products for CPUs with AVX-512 VNNI (the avx512 and avx512-bf16 rungs) or AVX2.
 *
 *   y (M, N) = x (M, K) @ W^T,  W (N, K) stored as unsigned 4- or 8-bit codes q with, per group of
 *   32 inputs and per output column, an fp16 scale s and an fp16 offset m:  W[n, k] = s * q + m.
 *
 * Each row of x is quantized to int8 per group of 32 (symmetric, scale a = max|x| / 127), so that
 * one group's dot product is an exact integer sum of u8 x s8 products (vpdpbusd):
 *
 *   sum_k W[n,k] x[k]  ~  sum_g  a_g * ( s_ng * dot_g(q, xq) + m_ng * sum_g(xq) )
 *
 * Layout: columns in tiles of 16 (one zmm lane per column), each tile's groups contiguous, so every
 * thread streams its tiles front to back. A group of one tile is 4 zmm of packed nibbles (int4) or
 * 8 zmm of bytes (int8); lane c of vector j holds 4 consecutive inputs of column c. The codes of a
 * group are unpacked once into registers and multiplied into up to 8 rows, so that the weight read,
 * which bounds the cost of a small batch, is paid once for all rows.
 *
 * Three scale formats (the mat's kind, sd.h), all exact for the GGUF blocks they hold:
 *   1  an fp16 scale s and offset m per group and column (ours; Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4)
 *   2  two levels as Q4_K / Q5_K define them: per 256 inputs and column fp16 d and dm, per group u8 sc and
 *      mn: s = d sc, m = dm mn (products of an fp16 and a small integer: exact in fp32)
 *   3  two levels with half groups of 16 as Q6_K defines them: per 256 inputs fp16 d and dm, per 16 inputs
 *      s8 sc and mn: s = d sc, m = dm mn on each half (Q6_K: dm = -32 d, mn = sc); codes below 64. Each
 *      half's integer dot and each row's sum of its 16 int8 inputs (computed once per call) enter on their own.
 * Codes come in 4 bits, 8, or, in any format where they are below 64 (Q5_0, Q5_1, Q5_K, Q6_K), packed in 6:
 * a group's 4-bit layout of the low nibbles, then two vectors of high bit pairs (byte (column c, b) of
 * vector i holds in bits 2j, 2j + 1 the high bits of input 16 i + 4 j + b).
 *
 * Batch invariance: a row's result is made by the same sequence of operations whatever the number
 * of rows and wherever the row sits in the batch (integer dots are exact; the float sums run over
 * groups in one fixed order), so its bits never depend on M. Threads split the column tiles.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "sd.h"

#define GS 32 /* inputs per group */
#define TN 16 /* columns per tile */
#define RB 8  /* rows per register block */
#define PFG 8 /* groups read ahead by software prefetch (2 KB of int4 codes) */

int sd_abi_version(void) { return 10; }

/* bytes of a tile's scales per super-block of 8 groups (256 inputs), by format (1: 64 bytes per group) */
#define SB_BYTES2 320 /* d[16] fp16, dm[16] fp16, then per group sc[16] u8, mn[16] u8 */
#define SB_BYTES3 576 /* d[16] fp16, dm[16] fp16, then per group sc_lo[16], sc_hi[16], mn_lo[16], mn_hi[16] s8 */
static inline int64_t st_tile_halves(int fmt, int64_t G) { /* in uint16 units */
    return fmt == 1 ? G * 32 : (G / 8) * (fmt == 2 ? SB_BYTES2 : SB_BYTES3) / 2;
}

/* the sums of x[0..15] and x[16..31] (int8): x + 128 summed by vpsadbw, less 16 * 128 each */
static inline void half_sums(const int8_t *x, int32_t *lo, int32_t *hi) {
    const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)x), _mm256_set1_epi8((char)0x80));
    const __m256i s = _mm256_sad_epu8(v, _mm256_setzero_si256());
    const __m128i a = _mm256_castsi256_si128(s), b = _mm256_extracti128_si256(s, 1);
    *lo = _mm_cvtsi128_si32(a) + _mm_extract_epi32(a, 2) - 2048;
    *hi = _mm_cvtsi128_si32(b) + _mm_extract_epi32(b, 2) - 2048;
}


/* x (M, K) bf16 -> xq (M, K) int8, a (M, K/32) scales, am (M, K/32) = a * sum(xq) per group. */
void sd_quantize_rows(const uint16_t *x, int64_t M, int64_t K, int8_t *xq, float *a, float *am) {
    const int64_t G = K / GS;
    for (int64_t r = 0; r < M; r++)
        for (int64_t g = 0; g < G; g++) sd_quantize_group(x + r * K + g * GS, xq + r * K + g * GS, a + r * G + g, am + r * G + g);
}

/* The signature and first lines of tile_block, shared by the two instruction sets' versions below. */
#define TILE_BLOCK_HEAD                                                                                           \
    static inline __attribute__((always_inline)) void                                                           \
    tile_block(const int R, const int bits, const int fmt, const int8_t *xq, const float *a, const float *am, int64_t K,         \
               const uint8_t *wt, const uint16_t *st, const float *bias, void *y, int64_t ldy, int out_f32,      \
               int64_t r0, int64_t n0, __mmask16 nmask, int64_t g0, int64_t g1, float *part) {                   \
        const int64_t G = K / GS;                                                                                 \
        const int64_t gbytes = bits == 4 ? 256 : bits == 6 ? 384 : 512;                                           \
        const uint8_t *sb8 = (const uint8_t *)st;

#ifdef SD_AVX512
static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* Vector j (0-7) of a group of 6-bit codes as bytes: its nibble (the low ones of nibble vector j, the high
 * ones of j - 4) and its two high bits (pair j % 4 of high-bit vector j / 4) moved to bits 4-5. 16-bit
 * shifts: what crosses into a neighbour byte lands outside the 0x30 mask. */
static inline __m512i codes6(const uint8_t *wp, int j) {
    const __m512i v = _mm512_loadu_si512((const void *)(wp + 64 * (j & 3)));
    const __m512i nib = _mm512_and_si512(j < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
    const __m512i hb = _mm512_loadu_si512((const void *)(wp + 256 + 64 * (j >> 2)));
    const int sh = 2 * (j & 3);
    const __m512i up = sh <= 4 ? _mm512_slli_epi16(hb, 4 - sh) : _mm512_srli_epi16(hb, sh - 4);
    return _mm512_ternarylogic_epi32(nib, up, _mm512_set1_epi8(0x30), 0xF8); /* nib | (up & 0x30) */
}

/* A group's codes as 8 vectors of bytes (lane c of vector j: inputs 4j .. 4j + 3 of column c): the layout
 * vpdpbusd takes, and row j of the B tile an AMX TDPBSUD takes. */
static inline __attribute__((always_inline)) void group_codes(const int bits, const uint8_t *wp, __m512i w[8]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    if (bits == 4) {
        for (int j = 0; j < 4; j++) {
            __m512i v = _mm512_loadu_si512((const void *)(wp + 64 * j));
            w[j] = _mm512_and_si512(v, low4);
            w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
    } else if (bits == 6) {
        for (int j = 0; j < 8; j++) w[j] = codes6(wp, j);
    } else {
        for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(wp + 64 * j));
    }
}

/* Group g's 16 columns' scales and offsets in fp32, by format (3: s, m the low half's, s2, m2 the high's). */
static inline __attribute__((always_inline)) void group_scales(const int fmt, const uint16_t *st, const uint8_t *sb8,
                                                               int64_t g, __m512 *ps, __m512 *pm, __m512 *ps2,
                                                               __m512 *pm2) {
    __m512 s, m, s2 = _mm512_setzero_ps(), m2 = _mm512_setzero_ps();
    if (fmt == 1) {
        s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + g * 32)));
        m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + g * 32 + 16)));
    } else {
        const uint8_t *sb = sb8 + (g >> 3) * (fmt == 2 ? SB_BYTES2 : SB_BYTES3);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 32)));
#define SC_U8(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define SC_S8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
        if (fmt == 2) {
            const uint8_t *gp = sb + 64 + (g & 7) * 32;
            s = _mm512_mul_ps(d, SC_U8(gp));
            m = _mm512_mul_ps(dm, SC_U8(gp + 16));
        } else {
            const uint8_t *gp = sb + 64 + (g & 7) * 64;
            s = _mm512_mul_ps(d, SC_S8(gp));
            s2 = _mm512_mul_ps(d, SC_S8(gp + 16));
            m = _mm512_mul_ps(dm, SC_S8(gp + 32));
            m2 = _mm512_mul_ps(dm, SC_S8(gp + 48));
        }
#undef SC_U8
#undef SC_S8
    }
    *ps = s, *pm = m, *ps2 = s2, *pm2 = m2;
}

/* PFG groups ahead (the next tile's first groups at a tile's end: tiles are contiguous). With several rows
 * the dot products keep the core busy and the hardware's prefetch falls behind: at four rows a 1.5B down
 * projection ran 1.4x slower without these, at eight a gate/up 1.45x */
#define PREFETCH_GROUPS                                                                                            \
    for (int j = 0; j < gbytes / 64; j++) _mm_prefetch((const char *)(wp + PFG * gbytes + 64 * j), _MM_HINT_T0); \
    _mm_prefetch((const char *)(sb8 + (g + PFG) * (fmt == 1 ? 64 : fmt == 2 ? 40 : 72)), _MM_HINT_T0)

/* The rows' sums after a tile's last group: the bias added, stored as fp32 or bf16; before it (g1 < G),
 * the partial sums kept in part for the next chunk of groups. */
static inline __attribute__((always_inline)) void finish_rows(const int R, const __m512 *acc, int64_t g1, int64_t G,
                                                              const float *bias, void *y, int64_t ldy, int out_f32,
                                                              int64_t r0, int64_t n0, __mmask16 nmask, float *part) {
    if (g1 < G) {
        for (int r = 0; r < R; r++) _mm512_storeu_ps(part + 16 * r, acc[r]);
        return;
    }
    __m512 b = bias ? _mm512_maskz_loadu_ps(nmask, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        __m512 v = _mm512_add_ps(acc[r], b);
        if (out_f32) {
            _mm512_mask_storeu_ps((float *)y + (r0 + r) * ldy + n0, nmask, v);
        } else {
            __m256i h = sd_cvt_bf16(v);
            _mm256_mask_storeu_epi16((uint16_t *)y + (r0 + r) * ldy + n0, nmask, h);
        }
    }
}

/* One register block of R rows (r0..r0+R-1) against one column tile; always inlined with R constant. */
TILE_BLOCK_HEAD
    __m512 acc[RB];
    for (int r = 0; r < R; r++) acc[r] = g0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(part + 16 * r);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *wp = wt + g * gbytes;
        PREFETCH_GROUPS;
        __m512i w[8];
        group_codes(bits, wp, w);
        __m512 s, m, s2, m2;
        group_scales(fmt, st, sb8, g, &s, &m, &s2, &m2);
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + (r0 + r) * K + g * GS;
            const float ar = a[(r0 + r) * G + g];
            if (fmt == 3) { /* each half's dot on its own: inputs 0-15 are vectors 0-3, 16-31 vectors 4-7 */
                const int chains = R <= 2 ? 2 : 1;
                __m512i lo[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                __m512i hi[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                for (int j = 0; j < 4; j++) lo[j % chains] = _mm512_dpbusd_epi32(lo[j % chains], w[j], bcast4(xr + 4 * j));
                for (int j = 4; j < 8; j++) hi[j % chains] = _mm512_dpbusd_epi32(hi[j % chains], w[j], bcast4(xr + 4 * j));
                if (chains == 2) {
                    lo[0] = _mm512_add_epi32(lo[0], lo[1]);
                    hi[0] = _mm512_add_epi32(hi[0], hi[1]);
                }
                const float *hs = am + ((r0 + r) * G + g) * 2; /* a * the halves' sums (sd_qmm_range) */
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(hs[0]), acc[r]);
                acc[r] = _mm512_fmadd_ps(m2, _mm512_set1_ps(hs[1]), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[0]), _mm512_mul_ps(s, _mm512_set1_ps(ar)), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[0]), _mm512_mul_ps(s2, _mm512_set1_ps(ar)), acc[r]);
                continue;
            }
            /* few rows: split the 8 dependent dpbusd into independent chains (latency, not
             * throughput, bounds one row); integer sums are exact in any order */
            const int chains = R <= 2 ? 4 : R <= 4 ? 2 : 1;
            __m512i dc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                             _mm512_setzero_si512()};
            for (int j = 0; j < 8; j++) dc[j % chains] = _mm512_dpbusd_epi32(dc[j % chains], w[j], bcast4(xr + 4 * j));
            __m512i d = dc[0];
            for (int c = 1; c < chains; c++) d = _mm512_add_epi32(d, dc[c]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(am[(r0 + r) * G + g]), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, _mm512_set1_ps(ar)), acc[r]);
        }
    }
    finish_rows(R, acc, g1, G, bias, y, ldy, out_f32, r0, n0, nmask, part);
}
#include "qmm_amx.h"

#else
static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* codes6's twin: half h (columns 8h .. 8h + 7) of vector j of a group of 6-bit codes, as bytes */
static inline __m256i codes6(const uint8_t *wp, int j, int h) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(wp + 64 * (j & 3) + 32 * h));
    const __m256i nib = _mm256_and_si256(j < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(wp + 256 + 64 * (j >> 2) + 32 * h));
    const int sh = 2 * (j & 3);
    const __m256i up = sh <= 4 ? _mm256_slli_epi16(hb, 4 - sh) : _mm256_srli_epi16(hb, sh - 4);
    return _mm256_or_si256(nib, _mm256_and_si256(up, _mm256_set1_epi8(0x30)));
}

/* The AVX2 twin of the AVX-512 tile_block: a tile's 16 columns as two halves of 8. vpmaddubsw multiplies
 * the u8 codes (8-bit codes as two nibbles, 16 * hi + lo) by the s8 inputs into 16-bit pair sums, which
 * are added over the group's 8 code vectors in 16 bits (each pair sum is at most 2 * 15 * 127 = 3810 in
 * magnitude, 8 of them 30480 < 32767: no saturation, no overflow) and widened once by vpmaddwd: the exact
 * integer dot of vpdpbusd. The per-group float steps are the AVX-512 build's two fused multiply-adds in
 * the same order, so every result is bit for bit that build's. */
TILE_BLOCK_HEAD
    const __m256i low4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi16(1);
    __m256 acc[2][RB];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < R; r++) acc[h][r] = g0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(part + 16 * r + 8 * h);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *wp = wt + g * gbytes;
        for (int j = 0; j < gbytes / 64; j++) _mm_prefetch((const char *)(wp + PFG * gbytes + 64 * j), _MM_HINT_T0);
        _mm_prefetch((const char *)(sb8 + (g + PFG) * (fmt == 1 ? 64 : fmt == 2 ? 40 : 72)), _MM_HINT_T0);
        __m256i d[2][RB], d2[2][RB]; /* format 3: d the low half's dots, d2 the high half's */
        if (fmt == 3 || bits == 6) { /* codes below 64: a pair sum is at most 2 * 63 * 127 = 16002, two 32004 */
            for (int h = 0; h < 2; h++) {
                __m256i v[8];
                for (int j = 0; j < 8; j++)
                    v[j] = bits == 6 ? codes6(wp, j, h) : _mm256_loadu_si256((const __m256i *)(wp + 64 * j + 32 * h));
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = xq + (r0 + r) * K + g * GS;
                    __m256i t[4];
                    for (int q = 0; q < 4; q++)
                        t[q] = _mm256_add_epi16(_mm256_maddubs_epi16(v[2 * q], bcast4(xr + 8 * q)),
                                                _mm256_maddubs_epi16(v[2 * q + 1], bcast4(xr + 8 * q + 4)));
                    d[h][r] = _mm256_add_epi32(_mm256_madd_epi16(t[0], one), _mm256_madd_epi16(t[1], one));
                    d2[h][r] = _mm256_add_epi32(_mm256_madd_epi16(t[2], one), _mm256_madd_epi16(t[3], one));
                    if (fmt != 3) d[h][r] = _mm256_add_epi32(d[h][r], d2[h][r]); /* one dot for the group */
                }
            }
        } else if (bits == 4) {
            __m256i t[2][RB];
            for (int h = 0; h < 2; h++)
                for (int r = 0; r < R; r++) t[h][r] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)(wp + 64 * j));
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wp + 64 * j + 32));
                const __m256i l0 = _mm256_and_si256(v0, low4), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
                const __m256i l1 = _mm256_and_si256(v1, low4), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = xq + (r0 + r) * K + g * GS;
                    const __m256i xl = bcast4(xr + 4 * j), xh = bcast4(xr + 16 + 4 * j);
                    t[0][r] = _mm256_add_epi16(t[0][r], _mm256_add_epi16(_mm256_maddubs_epi16(l0, xl), _mm256_maddubs_epi16(h0, xh)));
                    t[1][r] = _mm256_add_epi16(t[1][r], _mm256_add_epi16(_mm256_maddubs_epi16(l1, xl), _mm256_maddubs_epi16(h1, xh)));
                }
            }
            for (int h = 0; h < 2; h++)
                for (int r = 0; r < R; r++) d[h][r] = _mm256_madd_epi16(t[h][r], one);
        } else {
            for (int h = 0; h < 2; h++)
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = xq + (r0 + r) * K + g * GS;
                    __m256i tl = _mm256_setzero_si256(), th = _mm256_setzero_si256();
                    for (int j = 0; j < 8; j++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(wp + 64 * j + 32 * h));
                        const __m256i x = bcast4(xr + 4 * j);
                        tl = _mm256_add_epi16(tl, _mm256_maddubs_epi16(_mm256_and_si256(v, low4), x));
                        th = _mm256_add_epi16(th, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), x));
                    }
                    d[h][r] = _mm256_add_epi32(_mm256_madd_epi16(tl, one), _mm256_slli_epi32(_mm256_madd_epi16(th, one), 4));
                }
        }
        for (int h = 0; h < 2; h++) {
            __m256 s, m, s2 = _mm256_setzero_ps(), m2 = _mm256_setzero_ps();
            if (fmt == 1) {
                s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + g * 32 + 8 * h)));
                m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + g * 32 + 16 + 8 * h)));
            } else {
                const uint8_t *sb = sb8 + (g >> 3) * (fmt == 2 ? SB_BYTES2 : SB_BYTES3);
                const __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16 * h)));
                const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 32 + 16 * h)));
#define SC8_U8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define SC8_S8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
                if (fmt == 2) {
                    const uint8_t *gp = sb + 64 + (g & 7) * 32 + 8 * h;
                    s = _mm256_mul_ps(dd, SC8_U8(gp));
                    m = _mm256_mul_ps(dm, SC8_U8(gp + 16));
                } else {
                    const uint8_t *gp = sb + 64 + (g & 7) * 64 + 8 * h;
                    s = _mm256_mul_ps(dd, SC8_S8(gp));
                    s2 = _mm256_mul_ps(dd, SC8_S8(gp + 16));
                    m = _mm256_mul_ps(dm, SC8_S8(gp + 32));
                    m2 = _mm256_mul_ps(dm, SC8_S8(gp + 48));
                }
#undef SC8_U8
#undef SC8_S8
            }
            for (int r = 0; r < R; r++) {
                const float ar = a[(r0 + r) * G + g];
                if (fmt == 3) { /* the AVX-512 build's four steps, in its order */
                    const float *hs = am + ((r0 + r) * G + g) * 2; /* a * the halves' sums (sd_qmm_range) */
                    acc[h][r] = _mm256_fmadd_ps(m, _mm256_set1_ps(hs[0]), acc[h][r]);
                    acc[h][r] = _mm256_fmadd_ps(m2, _mm256_set1_ps(hs[1]), acc[h][r]);
                    acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[h][r]), _mm256_mul_ps(s, _mm256_set1_ps(ar)), acc[h][r]);
                    acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d2[h][r]), _mm256_mul_ps(s2, _mm256_set1_ps(ar)), acc[h][r]);
                    continue;
                }
                acc[h][r] = _mm256_fmadd_ps(m, _mm256_set1_ps(am[(r0 + r) * G + g]), acc[h][r]);
                acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[h][r]), _mm256_mul_ps(s, _mm256_set1_ps(ar)), acc[h][r]);
            }
        }
    }
    if (g1 < G) {
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < R; r++) _mm256_storeu_ps(part + 16 * r + 8 * h, acc[h][r]);
        return;
    }
    for (int h = 0; h < 2; h++) {
        const int64_t n = n0 + 8 * h;
        const int nv = (int)__builtin_popcount((unsigned)(nmask >> (8 * h)) & 0xffu);
        if (!nv) continue;
        const __m256 b = bias ? (nv == 8 ? _mm256_loadu_ps(bias + n) : sd8_load_n(bias + n, nv)) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m256 v = _mm256_add_ps(acc[h][r], b);
            if (out_f32) {
                float *o = (float *)y + (r0 + r) * ldy + n;
                if (nv == 8)
                    _mm256_storeu_ps(o, v);
                else
                    sd8_store_n(o, v, nv);
            } else {
                uint16_t *o = (uint16_t *)y + (r0 + r) * ldy + n;
                if (nv == 8) {
                    sd8_st_bf16(o, v);
                } else {
                    uint16_t tmp[8];
                    sd8_st_bf16(tmp, v);
                    memcpy(o, tmp, sizeof(uint16_t) * (size_t)nv);
                }
            }
        }
    }
}
#endif
#ifndef SD_AMX
int sd_amx_available(void) { return 0; } /* a build without the tiles (no AMX at -march, the lower rungs) */
void sd_amx_use(int on) { (void)on; }
#endif

#define BLOCK_CASE(R, BITS, FMT) \
    case R: tile_block(R, BITS, FMT, xq, a, am, K, wt, st, bias, y, N, out_f32, r0, n0, nmask, g0, g1, part + 16 * r0); break;

#define ROW_BLOCKS(BITS, FMT)                                                     \
    switch (M - r0 < RB ? M - r0 : RB) {                                     \
        BLOCK_CASE(1, BITS, FMT) BLOCK_CASE(2, BITS, FMT) BLOCK_CASE(3, BITS, FMT) BLOCK_CASE(4, BITS, FMT) \
        BLOCK_CASE(5, BITS, FMT) BLOCK_CASE(6, BITS, FMT) BLOCK_CASE(7, BITS, FMT) BLOCK_CASE(8, BITS, FMT) \
    }

/* All rows against one tile, in register blocks of up to RB rows (R and bits compile-time constants). */
static void tile_rows(int bits, int fmt, const int8_t *xq, const float *a, const float *am, int64_t M, int64_t K,
                      const uint8_t *wt, const uint16_t *st, const float *bias, void *y, int64_t N,
                      int out_f32, int64_t n0, __mmask16 nmask, int64_t g0, int64_t g1, float *part) {
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

/* y (M, N) = dequant(W) x, with x already quantized by sd_quantize_rows.
 * w: (ceil(N/16), K/32, 256 or 512) bytes; st: (ceil(N/16), K/32, 2, 16) fp16 (scales, offsets);
 * bias: N floats or NULL; y: (M, N) bf16 (out_f32 = 0) or float (out_f32 = 1).
 * Each tile runs all its groups front to back, so a thread's codes are one contiguous stream (with the
 * prefetch above, faster at every shape measured than chunks that keep the rows' codes in L1: a 7B down
 * projection at eight rows 2.25 -> 1.96 ms). Only inputs whose rows' codes pass XCHUNK bytes (past L2's
 * reach: 1024 groups at eight rows) run in chunks of groups, each over all of a thread's tiles; part:
 * ceil(N/16) * M * 16 floats of partial sums. A chunk's end stores the fp32 sums and the next chunk
 * reloads them: exact, so a row's bits do not depend on M (nor on where the chunks end). */
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
    float stack_hs[8 * 640];
    float *hs = NULL;
    if (fmt == 3 && t0 < t1) { /* each row's a times its halves' sums, once for all the tiles: in am's place */
        hs = M * G * 2 <= 8 * 640 ? stack_hs : (float *)malloc(sizeof(float) * (size_t)(M * G * 2));
        if (!hs) abort(); /* a few KB per row */
        for (int64_t r = 0; r < M; r++)
            for (int64_t g = 0; g < G; g++) {
                int32_t sl, sh;
                half_sums(xq + r * K + g * GS, &sl, &sh);
                hs[(r * G + g) * 2] = a[r * G + g] * (float)sl;
                hs[(r * G + g) * 2 + 1] = a[r * G + g] * (float)sh;
            }
        am = hs;
    }
#ifdef SD_AMX
    int rows_cfg = 0; /* the tiles' configured rows (0: not configured in this call) */
    const int amx = M >= AMX_MIN_ROWS && t0 < t1 && sd_amx_available();
#endif
    for (int64_t g0 = 0; g0 < G; g0 += chunk) {
        const int64_t g1 = g0 + chunk < G ? g0 + chunk : G;
        for (int64_t t = t0; t < t1; t++) {
            int64_t n0 = t * TN;
            __mmask16 nmask = N - n0 >= TN ? (__mmask16)0xffff : (__mmask16)((1u << (N - n0)) - 1);
#ifdef SD_AMX
            if (amx) {
                tile_rows_amx(bits, fmt, xq, a, am, M, K, w + t * G * gbytes, st + t * st_tile_halves(fmt, G), bias, y, N,
                              out_f32, n0, nmask, g0, g1, part + t * M * 16, &rows_cfg);
                continue;
            }
#endif
            tile_rows(bits, fmt, xq, a, am, M, K, w + t * G * gbytes, st + t * st_tile_halves(fmt, G), bias, y, N, out_f32, n0, nmask,
                      g0, g1, part + t * M * 16);
        }
    }
#ifdef SD_AMX
    if (rows_cfg) _tile_release();
#endif
    if (hs && hs != stack_hs) free(hs);
}

void sd_qmm(const int8_t *xq, const float *a, const float *am, int64_t M, int64_t K,
            const uint8_t *w, const uint16_t *st, int64_t N, int bits, int fmt, const float *bias,
            void *y, int out_f32, float *part) {
    const int64_t tiles = (N + TN - 1) / TN;
#pragma omp parallel
    {
        /* static split: a thread owns the same tiles in every chunk, so no barrier is needed */
        const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        sd_qmm_range(xq, a, am, M, K, w, st, N, bits, fmt, bias, y, out_f32, part, tiles * id / nt, tiles * (id + 1) / nt);
    }
}

/* Both steps with scratch of its own: the call a linear layer makes. Returns 0, or -1 without memory. */
int sd_linear(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *st, int64_t N,
              int bits, int fmt, const float *bias, void *y, int out_f32) {
    const int64_t G = K / GS, tiles = (N + TN - 1) / TN;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *a = (float *)malloc(sizeof(float) * (size_t)(M * G) * 2);
    const int chunked = G > kchunk(M); /* else one chunk: no partial sums */
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
