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

/* a group's scale a times the sums of its x[0..15] and x[16..31] (int8), into out[0], out[1] (format 3's
 * offsets per half): x + 128 summed by vpsadbw, less 16 * 128 each */
static inline void half_sums(const int8_t *x, float a, float *out) {
    const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)x), _mm256_set1_epi8((char)0x80));
    const __m256i s = _mm256_sad_epu8(v, _mm256_setzero_si256());
    const __m128i lo = _mm256_castsi256_si128(s), hi = _mm256_extracti128_si256(s, 1);
    out[0] = a * (float)(_mm_cvtsi128_si32(lo) + _mm_extract_epi32(lo, 2) - 2048);
    out[1] = a * (float)(_mm_cvtsi128_si32(hi) + _mm_extract_epi32(hi, 2) - 2048);
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
    tile_block(const int R, const int bits, const int fmt, const int8_t *xq, const float *a, const float *am, int64_t M, int64_t K,         \
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
    __m512 acc[RB]; /* in registers: the row loops unrolled (rolled, GCC kept acc in memory, a store and a
                     * reload per row and group: at 8 rows the hottest instructions of the block) */
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = g0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(part + 16 * r);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *wp = wt + g * gbytes;
        PREFETCH_GROUPS;
        __m512i w[8];
        group_codes(bits, wp, w);
        __m512 s, m, s2, m2;
        group_scales(fmt, st, sb8, g, &s, &m, &s2, &m2);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + (g * M + r0 + r) * GS; /* the rows packed by group (sd_qmm_range) */
            const float ar = a[g * M + r0 + r];
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
                const float *hs = am + (g * M + r0 + r) * 2; /* a * the halves' sums (sd_qmm_range) */
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
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(am[g * M + r0 + r]), acc[r]);
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


/* How many code vectors a half-group is staged as: 8 (lane c of vector j: inputs 4j .. 4j + 3 of column c, the
 * AVX-512 layout), or without VNNI for codes up to 255 (8 bits, formats 1 and 2) 16: the low nibbles, then the
 * high ones (vpmaddubsw's pair sums of full bytes could saturate). */
#ifdef SD_AVX2_VNNI
#define NV(bits, fmt) 8
#else
#define NV(bits, fmt) ((bits) == 8 && (fmt) != 3 ? 16 : 8)
#endif

/* Half h of group wp's codes as NV vectors of bytes. */
static inline __attribute__((always_inline)) void half_codes(const int bits, const int fmt, const uint8_t *wp, int h,
                                                             __m256i *v) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    if (bits == 4) {
        for (int j = 0; j < 4; j++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(wp + 64 * j + 32 * h));
            v[j] = _mm256_and_si256(c, low4);
            v[j + 4] = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
        }
    } else if (bits == 6) {
        for (int j = 0; j < 8; j++) v[j] = codes6(wp, j, h);
    } else {
        for (int j = 0; j < 8; j++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(wp + 64 * j + 32 * h));
            if (NV(bits, fmt) == 16) {
                v[j] = _mm256_and_si256(c, low4);
                v[j + 8] = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
            } else {
                v[j] = c;
            }
        }
    }
}

/* Half h of group g's scales and offsets in fp32 (format 3: s, m the low 16 inputs', s2, m2 the high's). */
static inline __attribute__((always_inline)) void half_scales(const int fmt, const uint16_t *st, const uint8_t *sb8,
                                                              int64_t g, int h, __m256 *sv) {
    if (fmt == 1) {
        sv[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + g * 32 + 8 * h)));
        sv[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(st + g * 32 + 16 + 8 * h)));
        return;
    }
    const uint8_t *sb = sb8 + (g >> 3) * (fmt == 2 ? SB_BYTES2 : SB_BYTES3);
    const __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 16 * h)));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 32 + 16 * h)));
#define SC8_U8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define SC8_S8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
    if (fmt == 2) {
        const uint8_t *gp = sb + 64 + (g & 7) * 32 + 8 * h;
        sv[0] = _mm256_mul_ps(dd, SC8_U8(gp));
        sv[1] = _mm256_mul_ps(dm, SC8_U8(gp + 16));
    } else {
        const uint8_t *gp = sb + 64 + (g & 7) * 64 + 8 * h;
        sv[0] = _mm256_mul_ps(dd, SC8_S8(gp));
        sv[2] = _mm256_mul_ps(dd, SC8_S8(gp + 16));
        sv[1] = _mm256_mul_ps(dm, SC8_S8(gp + 32));
        sv[3] = _mm256_mul_ps(dm, SC8_S8(gp + 48));
    }
#undef SC8_U8
#undef SC8_S8
}

#ifndef PF_HINT
#define PF_HINT _MM_HINT_T0
#endif
#ifndef PFA
#define PFA PFG
#endif
#define SUB 4 /* rows a pass keeps in registers: their accumulators and dots of 8 columns */
#define CH 8  /* groups per chunk (one super-block): its codes unpacked once, for every 4 rows, into L1 */

/* The exact integer dots of S rows against code vectors j0 .. j1 - 1 of a half-group, a vector at a time
 * for all the rows (xg: the rows' 32 int8 inputs of the group, 32 bytes apart). Without VNNI vpmaddubsw's
 * 16-bit pair sums are added in 16 bits while they cannot overflow (codes below 16: a pair sum at most
 * 2 * 15 * 127 = 3810, all 8 of a group 30480; below 64: 16002, two of them 32004) and widened by vpmaddwd. */
/* an empty asm that holds v in a register here: GCC would otherwise reassociate a row's 16-bit sums, hoist all
 * the rows' products ahead of them and spill them (2x the time at 4 rows) */
#define KEEP(v) __asm__("" : "+x"(v))
static inline __attribute__((always_inline)) void rows_dot(const int S, const int bits, const int fmt, const __m256i *v,
                                                           int j0, int j1, const int8_t *xg, __m256i *d) {
    (void)bits, (void)fmt;
#ifdef SD_AVX2_VNNI
    __m256i e[SUB][2]; /* two chains a row: the dots' latency, not their rate, would bound 4 rows */
    for (int r = 0; r < S; r++) e[r][0] = e[r][1] = _mm256_setzero_si256();
    for (int j = j0; j < j1; j++) {
        const __m256i c = _mm256_loadu_si256(v + j);
        for (int r = 0; r < S; r++) {
            e[r][j & 1] = _mm256_dpbusd_avx_epi32(e[r][j & 1], c, bcast4(xg + 32 * r + 4 * j));
            KEEP(e[r][j & 1]);
        }
    }
    for (int r = 0; r < S; r++) d[r] = _mm256_add_epi32(e[r][0], e[r][1]);
#else
    const __m256i one = _mm256_set1_epi16(1);
    if (bits == 4) { /* codes below 16: all 8 vectors summed in 16 bits (j0 .. j1 is 0 .. 8) */
        __m256i t[SUB];
        for (int r = 0; r < S; r++) t[r] = _mm256_setzero_si256();
        for (int q = 0; q < 4; q++) {
            const __m256i c0 = _mm256_loadu_si256(v + q), c1 = _mm256_loadu_si256(v + q + 4);
            for (int r = 0; r < S; r++) {
                t[r] = _mm256_add_epi16(t[r], _mm256_add_epi16(_mm256_maddubs_epi16(c0, bcast4(xg + 32 * r + 4 * q)),
                                                               _mm256_maddubs_epi16(c1, bcast4(xg + 32 * r + 16 + 4 * q))));
                KEEP(t[r]);
            }
        }
        for (int r = 0; r < S; r++) d[r] = _mm256_madd_epi16(t[r], one);
    } else if (NV(bits, fmt) == 16) { /* bytes as two nibbles: 16 * (hi . x) + lo . x */
        __m256i tl[SUB], th[SUB];
        for (int r = 0; r < S; r++) tl[r] = th[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i c0 = _mm256_loadu_si256(v + j), c1 = _mm256_loadu_si256(v + j + 8);
            for (int r = 0; r < S; r++) {
                const __m256i x = bcast4(xg + 32 * r + 4 * j);
                tl[r] = _mm256_add_epi16(tl[r], _mm256_maddubs_epi16(c0, x));
                th[r] = _mm256_add_epi16(th[r], _mm256_maddubs_epi16(c1, x));
                KEEP(tl[r]);
                KEEP(th[r]);
            }
        }
        for (int r = 0; r < S; r++)
            d[r] = _mm256_add_epi32(_mm256_madd_epi16(tl[r], one), _mm256_slli_epi32(_mm256_madd_epi16(th[r], one), 4));
    } else { /* codes below 64: pairs of vectors in 16 bits, widened */
        for (int r = 0; r < S; r++) d[r] = _mm256_setzero_si256();
        for (int j = j0; j < j1; j += 2) {
            const __m256i c0 = _mm256_loadu_si256(v + j), c1 = _mm256_loadu_si256(v + j + 1);
            for (int r = 0; r < S; r++) {
                const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(c0, bcast4(xg + 32 * r + 4 * j)),
                                                   _mm256_maddubs_epi16(c1, bcast4(xg + 32 * r + 4 * j + 4)));
                d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(p, one));
                KEEP(d[r]);
            }
        }
    }
#endif
}

/* One group's half h (code vectors v, scales s) into the accumulators of rows r0 .. r0 + S - 1 (S <= SUB). The
 * rows come packed by group (sd_qmm_range): xp (G, M, 32), ap (G, M), amp (G, M) or, format 3, (G, M, 2). The
 * float steps are the AVX-512 build's, in its order. */
static inline __attribute__((always_inline)) void group_half(const int S, const int bits, const int fmt, const __m256i *v,
                                                             const __m256 *s, const int8_t *xp, const float *ap,
                                                             const float *amp, int64_t M, int64_t g, int64_t r0,
                                                             __m256 *acc) {
    const int8_t *xg = xp + (g * M + r0) * GS;
    const float *ag = ap + g * M + r0;
    __m256i d[SUB];
    if (fmt == 3) {
        const float *hs = amp + (g * M + r0) * 2; /* a * the halves' sums */
#pragma GCC unroll 4
        for (int r = 0; r < S; r++) {
            acc[r] = _mm256_fmadd_ps(s[1], _mm256_set1_ps(hs[2 * r]), acc[r]);
            acc[r] = _mm256_fmadd_ps(s[3], _mm256_set1_ps(hs[2 * r + 1]), acc[r]);
        }
        rows_dot(S, bits, fmt, v, 0, 4, xg, d);
#pragma GCC unroll 4
        for (int r = 0; r < S; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r]), _mm256_mul_ps(s[0], _mm256_set1_ps(ag[r])), acc[r]);
        rows_dot(S, bits, fmt, v, 4, 8, xg, d);
#pragma GCC unroll 4
        for (int r = 0; r < S; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r]), _mm256_mul_ps(s[2], _mm256_set1_ps(ag[r])), acc[r]);
    } else {
        const float *amg = amp + g * M + r0;
#pragma GCC unroll 4
        for (int r = 0; r < S; r++) acc[r] = _mm256_fmadd_ps(s[1], _mm256_set1_ps(amg[r]), acc[r]);
        rows_dot(S, bits, fmt, v, 0, 8, xg, d);
#pragma GCC unroll 4
        for (int r = 0; r < S; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r]), _mm256_mul_ps(s[0], _mm256_set1_ps(ag[r])), acc[r]);
    }
}

/* group g's codes and scales PFA groups ahead, a group at a time: spread over the compute, not in a burst */
#define PREFETCH_AHEAD(wp, g)                                                                                         \
    do {                                                                                                              \
        for (int j = 0; j < gbytes / 64; j++) _mm_prefetch((const char *)((wp) + PFA * gbytes + 64 * j), PF_HINT); \
        _mm_prefetch((const char *)(sb8 + ((g) + PFA) * (fmt == 1 ? 64 : fmt == 2 ? 40 : 72)), PF_HINT);             \
    } while (0)

/* Rows r0 .. r0 + S - 1 of half h over the chunk's staged groups (cv, sv: gc .. gc + n - 1), the accumulators
 * loaded from and stored back to accs (fp32: exact); pf: prefetch as it goes (the chunk's first pass). */
static inline __attribute__((always_inline)) void half_pass(const int S, const int bits, const int fmt, const int pf,
                                                            const int8_t *xp, const float *ap, const float *amp,
                                                            int64_t M, const uint8_t *wt, const uint8_t *sb8,
                                                            int64_t gbytes, int64_t r0, int h, int64_t gc, int n,
                                                            __m256i (*cv)[16], __m256 (*sv)[4], float *accs) {
    __m256 acc[SUB];
#pragma GCC unroll 4
    for (int r = 0; r < S; r++) acc[r] = _mm256_loadu_ps(accs + 16 * r + 8 * h);
    for (int i = 0; i < n; i++) {
        if (pf) PREFETCH_AHEAD(wt + (gc + i) * gbytes, gc + i);
        group_half(S, bits, fmt, cv[i], sv[i], xp, ap, amp, M, gc + i, r0, acc);
    }
#pragma GCC unroll 4
    for (int r = 0; r < S; r++) _mm256_storeu_ps(accs + 16 * r + 8 * h, acc[r]);
}

/* The AVX2 twin of the AVX-512 tile_block: a tile's 16 columns as two halves of 8, in chunks of CH groups. A
 * block of 3+ rows unpacks a chunk's codes and scales once per half into L1 and runs them past its rows 4 at a
 * time, a code vector at a time for the 4 rows, so the accumulators and dots stay in the 16 registers (8 rows
 * of both halves at once spilled them); 1-2 rows unpack as they go, group by group. xq, a, am: the rows packed by group
 * (half_pass). The per-group float steps are the AVX-512 build's fused multiply-adds in the same order and the
 * integer dots are exact, so every result is bit for bit that build's. */
TILE_BLOCK_HEAD
    float accs[RB * 16];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 16; c++) accs[16 * r + c] = g0 == 0 ? 0.0f : part[16 * r + c];
    if (R <= 2) { /* group by group, both halves, the accumulators in registers throughout */
        __m256 acc[2][2];
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < R; r++) acc[h][r] = _mm256_loadu_ps(accs + 16 * r + 8 * h);
        for (int64_t g = g0; g < g1; g++) {
            const uint8_t *wp = wt + g * gbytes;
            PREFETCH_AHEAD(wp, g);
            for (int h = 0; h < 2; h++) {
                __m256i v[16];
                __m256 s[4];
                half_codes(bits, fmt, wp, h, v);
                half_scales(fmt, st, sb8, g, h, s);
                group_half(R, bits, fmt, v, s, xq, a, am, M, g, r0, acc[h]);
            }
        }
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < R; r++) _mm256_storeu_ps(accs + 16 * r + 8 * h, acc[h][r]);
    } else { /* a chunk's codes and scales unpacked once per half, then its rows 4 at a time */
        __m256i cv[CH][16];
        __m256 sv[CH][4];
        for (int64_t gc = g0; gc < g1; gc += CH) {
            const int n = g1 - gc < CH ? (int)(g1 - gc) : CH;
            for (int h = 0; h < 2; h++) {
                for (int i = 0; i < n; i++) {
                    half_codes(bits, fmt, wt + (gc + i) * gbytes, h, cv[i]);
                    half_scales(fmt, st, sb8, gc + i, h, sv[i]);
                }
                if (R <= SUB) {
                    half_pass(R, bits, fmt, h == 0, xq, a, am, M, wt, sb8, gbytes, r0, h, gc, n, cv, sv, accs);
                } else {
                    half_pass(SUB, bits, fmt, h == 0, xq, a, am, M, wt, sb8, gbytes, r0, h, gc, n, cv, sv, accs);
                    half_pass(R - SUB, bits, fmt, 0, xq, a, am, M, wt, sb8, gbytes, r0 + SUB, h, gc, n, cv, sv,
                              accs + 16 * SUB);
                }
            }
        }
    }
    if (g1 < G) {
        memcpy(part, accs, sizeof(float) * 16 * (size_t)R);
        return;
    }
    for (int h = 0; h < 2; h++) {
        const int64_t nn = n0 + 8 * h;
        const int nv = (int)__builtin_popcount((unsigned)(nmask >> (8 * h)) & 0xffu);
        if (!nv) continue;
        const __m256 b = bias ? (nv == 8 ? _mm256_loadu_ps(bias + nn) : sd8_load_n(bias + nn, nv)) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m256 v = _mm256_add_ps(_mm256_loadu_ps(accs + 16 * r + 8 * h), b);
            if (out_f32) {
                float *o = (float *)y + (r0 + r) * ldy + nn;
                if (nv == 8)
                    _mm256_storeu_ps(o, v);
                else
                    sd8_store_n(o, v, nv);
            } else {
                uint16_t *o = (uint16_t *)y + (r0 + r) * ldy + nn;
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
    case R: tile_block(R, BITS, FMT, xq, a, am, M, K, wt, st, bias, y, N, out_f32, r0, n0, nmask, g0, g1, part + 16 * r0); break;

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

/* The rows packed by group, as tile_block reads them (one base a group, the rows at fixed steps, so 4-8 rows'
 * pointers do not crowd the 16 general registers): xp (G, M, 32), then ap (G, M), then amp (G, M) or,
 * format 3, each row's a times its halves' sums (G, M, 2); one allocation, freed by the caller. */
static int8_t *pack_rows(const int8_t *xq, const float *a, const float *am, int64_t M, int64_t K, int fmt) {
    const int64_t G = K / GS;
    const int per = fmt == 3 ? 2 : 1;
    int8_t *xp = (int8_t *)malloc((size_t)(M * K) + sizeof(float) * (size_t)(M * G * (1 + per)));
    if (!xp) abort(); /* M * K bytes and a few floats a group */
    float *ap = (float *)(xp + M * K), *amp = ap + M * G;
    for (int64_t g = 0; g < G; g++)
        for (int64_t r = 0; r < M; r++) {
            memcpy(xp + (g * M + r) * GS, xq + r * K + g * GS, GS);
            ap[g * M + r] = a[r * G + g];
            if (fmt == 3) {
                half_sums(xq + r * K + g * GS, a[r * G + g], amp + (g * M + r) * 2);
            } else {
                amp[g * M + r] = am[r * G + g];
            }
        }
    return xp;
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
#ifdef SD_AMX
    int rows_cfg = 0; /* the tiles' configured rows (0: not configured in this call) */
    const int amx = M >= AMX_MIN_ROWS && t0 < t1 && sd_amx_available(); /* tiles load rows in place: (M, K) */
#else
    const int amx = 0;
#endif
    int8_t *xp = M > 1 && t0 < t1 && !amx ? pack_rows(xq, a, am, M, K, fmt) : NULL; /* one row: packed already */
    if (xp) {
        a = (const float *)(xp + M * K);
        am = a + M * G;
        xq = xp;
    }
    if (fmt == 3 && t0 < t1 && !xp) { /* each row's a times its halves' sums, once for all the tiles: in am's place */
        hs = M * G * 2 <= 8 * 640 ? stack_hs : (float *)malloc(sizeof(float) * (size_t)(M * G * 2));
        if (!hs) abort(); /* a few KB per row */
        for (int64_t r = 0; r < M; r++)
            for (int64_t g = 0; g < G; g++) half_sums(xq + r * K + g * GS, a[r * G + g], hs + (r * G + g) * 2);
        am = hs;
    }
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
    free(xp);
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
