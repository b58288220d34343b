/* GGUF blocks laid into qmm.c's tiles at load, straight from the file's bytes (its memory map).
 *
 * The numbers are the file's: codes as the block type packs them, the scales' fp16 fields copied, the small
 * scales and mins unpacked, never rounded (gguf_blocks.py says which type goes to which format, and holds the
 * same decoding in NumPy, against which tests/formats/test_gguf_repack.py checks this one byte for byte).
 * Each output column (a row of the file's tensor) comes from its own row pointer, so a fused layer's parts,
 * a converter's row permutation and an expert's rows are all just a list of rows. Threads split the tiles.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "sd.h"

/* ggml's type ids */
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* an fp16 times a power of two (-8, -16, -128 for the offsets of Q4_0, Q5_0, Q8_0), as fp16: exact */
static inline uint16_t f16_scaled(uint16_t h, float by) { return _cvtss_sh(_cvtsh_ss(h) * by, 0); }

/* Group g (inputs 32g .. 32g + 31) of an affine type's row: codes and fp16 scale and offset. */
static void group_affine(int type, const uint8_t *row, int64_t g, uint8_t *q, uint16_t *s, uint16_t *m) {
    switch (type) {
    case T_Q4_0: {
        const uint8_t *b = row + g * 18;
        for (int i = 0; i < 16; i++) q[i] = b[2 + i] & 15, q[i + 16] = b[2 + i] >> 4;
        *s = rd16(b), *m = f16_scaled(rd16(b), -8.0f);
        break;
    }
    case T_Q4_1: {
        const uint8_t *b = row + g * 20;
        for (int i = 0; i < 16; i++) q[i] = b[4 + i] & 15, q[i + 16] = b[4 + i] >> 4;
        *s = rd16(b), *m = rd16(b + 2);
        break;
    }
    case T_Q5_0:
    case T_Q5_1: {
        const int one = type == T_Q5_1;
        const uint8_t *b = row + g * (one ? 24 : 22);
        uint32_t qh;
        memcpy(&qh, b + (one ? 4 : 2), 4);
        const uint8_t *qs = b + (one ? 8 : 6);
        for (int i = 0; i < 16; i++) {
            q[i] = (qs[i] & 15) | (((qh >> i) & 1) << 4);
            q[i + 16] = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        }
        *s = rd16(b), *m = one ? rd16(b + 2) : f16_scaled(rd16(b), -16.0f);
        break;
    }
    default: { /* Q8_0 */
        const uint8_t *b = row + g * 34;
        for (int i = 0; i < 32; i++) q[i] = (uint8_t)((int)(int8_t)b[2 + i] + 128);
        *s = rd16(b), *m = f16_scaled(rd16(b), -128.0f);
    }
    }
}

/* Q4_K's and Q5_K's 6-bit scale and min of sub-block j from their 12 bytes */
static inline void k_scale(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63, *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Group g of a two-level type's row: codes, the super-block's fp16 d and dm (dm = -dmin; Q6_K: -32 d), and
 * sc, mn per half group (a group's one value twice for Q4_K and Q5_K). */
static void group_two_level(int type, const uint8_t *row, int64_t g, uint8_t *q, uint16_t *d, uint16_t *dm, int sc[2],
                            int mn[2]) {
    const int64_t sbi = g / 8;
    const int j = (int)(g % 8);
    if (type == T_Q6_K) {
        const uint8_t *b = row + sbi * 210, *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        /* input i of the super-block (i = 32 j + l): half c = i / 128, u = i % 128; its low nibble is nibble
         * u / 64 of ql[64 c + u % 64], its high bits are pair u / 32 of qh[32 c + u % 32] */
        const uint8_t *lo = ql + 64 * (j / 4) + 32 * (j % 2), *hi = qh + 32 * (j / 4); /* for every l of the group */
        const int ls = 4 * ((j % 4) / 2), hs = 2 * (j % 4);
        for (int l = 0; l < 32; l++) q[l] = (uint8_t)(((lo[l] >> ls) & 15) | (((hi[l] >> hs) & 3) << 4));
        *d = rd16(b + 208);
        *dm = f16_scaled(*d, -32.0f);
        sc[0] = mn[0] = scales[2 * j], sc[1] = mn[1] = scales[2 * j + 1];
        return;
    }
    const int five = type == T_Q5_K;
    const uint8_t *b = row + sbi * (five ? 176 : 144);
    const uint8_t *qs = b + (five ? 48 : 16) + 32 * (j / 2);
    const int ls = 4 * (j % 2);
    for (int l = 0; l < 32; l++) q[l] = (qs[l] >> ls) & 15;
    if (five)
        for (int l = 0; l < 32; l++) q[l] |= ((b[16 + l] >> j) & 1) << 4;
    *d = rd16(b), *dm = rd16(b + 2) ^ 0x8000u; /* -dmin: the sign bit */
    int s, m;
    k_scale(b + 4, j, &s, &m);
    sc[0] = sc[1] = s, mn[0] = mn[1] = m;
}

/* the four 4-byte pieces of v at p, p + 64, p + 128, p + 192 */
static inline void put_pieces(uint8_t *p, __m128i v) {
    _mm_storeu_si32(p, v);
    _mm_storeu_si32(p + 64, _mm_srli_si128(v, 4));
    _mm_storeu_si32(p + 128, _mm_srli_si128(v, 8));
    _mm_storeu_si32(p + 192, _mm_srli_si128(v, 12));
}

/* A group's 32 codes q (below 16, 64 or 256 by bits) into column c of its tile group dg (qmm.c's layouts):
 * byte 4 j + b of the column's 16 holds codes 4 j + b and 16 + 4 j + b as nibbles (at dg + 64 j + 4 c + b);
 * 6 bits add each code's high pair, four to a byte (byte b of half i at dg + 256 + 64 i + 4 c: the pairs of
 * codes 16 i + 4 j + b, j = 0..3, at bits 2 j); 8 bits lay the codes 4 at a time at dg + 64 j + 4 c. */
static inline void put_codes(uint8_t *dg, int c, const uint8_t *q, int bits) {
    if (bits == 8) {
        for (int j = 0; j < 8; j++) memcpy(dg + 64 * j + 4 * c, q + 4 * j, 4);
        return;
    }
    const __m128i m4 = _mm_set1_epi8(15), lo = _mm_loadu_si128((const __m128i *)q),
                  hi = _mm_loadu_si128((const __m128i *)(q + 16));
    /* nibbles: each byte's value is below 16 after the mask, so a 16-bit lane's shift by 4 stays in its byte */
    const __m128i v = _mm_or_si128(_mm_and_si128(lo, m4), _mm_slli_epi16(_mm_and_si128(hi, m4), 4));
    uint8_t *at = dg + 4 * c;
    put_pieces(at, v);
    if (bits == 6) {
        const __m128i m2 = _mm_set1_epi8(3);
        for (int i = 0; i < 2; i++) {
            const __m128i h = _mm_and_si128(_mm_srli_epi16(i ? hi : lo, 4), m2); /* pairs, below 4 */
            const __m128i w = _mm_or_si128(_mm_or_si128(h, _mm_slli_epi16(_mm_srli_si128(h, 4), 2)),
                                           _mm_or_si128(_mm_slli_epi16(_mm_srli_si128(h, 8), 4),
                                                        _mm_slli_epi16(_mm_srli_si128(h, 12), 6)));
            _mm_storeu_si32(at + 256 + 64 * i, w);
        }
    }
}

/* Lay N rows (rows[n]: row n's bytes, types[n]: its ggml type) of K inputs into tiles of format fmt (qmm.c)
 * with bits-wide codes (4, 6 or 8: qmm.c's layouts): data (ceil(N/16), K/32, 256, 384 or 512) bytes and st (qmm.c's scales of the
 * format). Rows past N (the last tile's padding) are zero. Returns 0, or -1 for a type the format cannot take. */
int sd_repack(const uint8_t *const *rows, const int8_t *types, int64_t N, int64_t K, int fmt, int bits, uint8_t *data,
              uint8_t *st) {
    for (int64_t n = 0; n < N; n++) {
        const int t = types[n];
        const int two = t == T_Q4_K || t == T_Q5_K || t == T_Q6_K;
        if ((fmt == 1) == two || (fmt == 2 && t == T_Q6_K)) return -1;
        if (bits == 4 && !(t == T_Q4_0 || t == T_Q4_1 || t == T_Q4_K)) return -1;
        if (bits == 6 && t == T_Q8_0) return -1; /* 6 bits: codes below 64, every other type's */
    }
    const int64_t G = K / 32, tiles = (N + 15) / 16, gbytes = bits == 4 ? 256 : bits == 6 ? 384 : 512;
    const int64_t sbb = fmt == 2 ? 320 : 576, stile = fmt == 1 ? G * 64 : (G / 8) * sbb;
#pragma omp parallel for schedule(dynamic, 4) /* a thread slowed by another (the tokenizer read beside it) does less */
    for (int64_t ti = 0; ti < tiles; ti++) {
        uint8_t *dt = data + ti * G * gbytes, *s = st + ti * stile;
        memset(dt, 0, (size_t)(G * gbytes));
        memset(s, 0, (size_t)stile);
        for (int c = 0; c < 16; c++) {
            const int64_t n = ti * 16 + c;
            if (n >= N) break;
            for (int64_t g = 0; g < G; g++) {
                uint8_t q[32];
                uint8_t *dg = dt + g * gbytes;
                if (fmt == 1) {
                    uint16_t sc16, m16;
                    group_affine(types[n], rows[n], g, q, &sc16, &m16);
                    memcpy(s + g * 64 + 2 * c, &sc16, 2);
                    memcpy(s + g * 64 + 32 + 2 * c, &m16, 2);
                } else {
                    uint16_t d, dm;
                    int sc[2], mn[2];
                    group_two_level(types[n], rows[n], g, q, &d, &dm, sc, mn);
                    uint8_t *sb = s + (g / 8) * sbb;
                    memcpy(sb + 2 * c, &d, 2);
                    memcpy(sb + 32 + 2 * c, &dm, 2);
                    if (fmt == 2) {
                        uint8_t *gp = sb + 64 + (g % 8) * 32;
                        gp[c] = (uint8_t)sc[0], gp[16 + c] = (uint8_t)mn[0];
                    } else {
                        uint8_t *gp = sb + 64 + (g % 8) * 64;
                        gp[c] = (uint8_t)(int8_t)sc[0], gp[16 + c] = (uint8_t)(int8_t)sc[1];
                        gp[32 + c] = (uint8_t)(int8_t)mn[0], gp[48 + c] = (uint8_t)(int8_t)mn[1];
                    }
                }
                put_codes(dg, c, q, bits);
            }
        }
    }
    return 0;
}
