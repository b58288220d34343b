/* The quantized products' integer dots on AMX tiles (the avx512-amx rung; included by qmm.c's AVX-512 branch).
 *
 * A group's dot of a row's 32 int8 inputs with a column's 32 codes is one int32 (qmm.c). TDPBSUD computes
 * it for up to 16 rows and the tile's 16 columns at once: A = the rows' inputs (signed bytes, R rows of 32,
 * read in place from xq with the row stride K), B = the group's codes as bytes in exactly the layout the
 * vpdpbusd path holds in registers (row j: inputs 4j .. 4j + 3 of each column, 64 bytes; an 8-bit group is
 * that layout in memory, a 4- or 6-bit one is unpacked into it once for all rows), C = the R x 16 int32
 * dots, stored and read back per row. Every integer is the one vpdpbusd makes (exact sums), and the float
 * steps after it are tile_block's, in the same order: the results are bit for bit the avx512-bf16 rung's,
 * for any number of rows (tests/kernels/test_rungs.py). What changes is the cost of a block of rows: the
 * 8 vpdpbusd (and 8 broadcasts) per row and group become one tile operation for all the rows.
 *
 * Linux hands the tile state to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM, once); where it
 * refuses, the vpdpbusd path runs. Tiles are configured per thread at each call (another library's AMX
 * code may have configured them otherwise) and released at its end (no 8 KB of tile state to save at
 * every context switch). */
#ifdef SD_AMX
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_MIN_ROWS 16 /* fewer rows: the vpdpbusd path, faster there (1.5B Q4_K_M, Xeon with AMX: 4 rows 56 against 75 ms, 8 rows 76 against 84; 16 rows 146 against 113, 64 rows 533 against 443) */
#define AMX_ROWS 16    /* rows per tile block */

/* whether this process may use the tiles (asked of Linux once; a refusal is kept) */
static int amx_permitted(void) {
    static int state = 0; /* 0: not asked, 1: granted, -1: refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

static int amx_on = 1; /* sd_amx_use(0): the vpdpbusd path everywhere (the tests compare the two) */

/* 1 when the products of 16+ rows run on the tiles: built for them, asked for (sd_amx_use) and granted */
int sd_amx_available(void) { return amx_on && amx_permitted(); }

void sd_amx_use(int on) { amx_on = on; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_cfg;

/* tiles: 0 A (R x 32 bytes), 1 B (8 x 64), 2 C (R x 64); format 3's halves: 3 A (R x 16), 4 B (4 x 64), 5 C;
 * formats 1-2 alternate between (0, 1, 2) and (6, 7, 5) from group to group: the next group's dots run
 * while this one's are stored and scaled */
static inline void amx_configure(int R) {
    amx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = (uint8_t)R, c.colsb[0] = 32;
    c.rows[1] = 8, c.colsb[1] = 64;
    c.rows[2] = (uint8_t)R, c.colsb[2] = 64;
    c.rows[3] = (uint8_t)R, c.colsb[3] = 16;
    c.rows[4] = 4, c.colsb[4] = 64;
    c.rows[5] = (uint8_t)R, c.colsb[5] = 64;
    c.rows[6] = (uint8_t)R, c.colsb[6] = 32; /* formats 1-2, odd groups: A in 6, B in 7, C in 5 */
    c.rows[7] = 8, c.colsb[7] = 64;
    _tile_loadconfig(&c);
}

/* a group's codes in the B tile's layout: an 8-bit group as it is, a 4- or 6-bit one unpacked into buf */
static inline __attribute__((always_inline)) const uint8_t *codes_of(const int bits, const uint8_t *wp, uint8_t *buf) {
    if (bits == 8) return wp;
    __m512i w[8];
    group_codes(bits, wp, w);
    for (int j = 0; j < 8; j++) _mm512_store_si512((void *)(buf + 64 * j), w[j]);
    return buf;
}

/* tile_block on tiles: R (1-16, the tiles' configured rows) rows against one column tile. */
static inline __attribute__((always_inline)) void
tile_block_amx(const int R, const int bits, const int fmt, const int8_t *xq, const float *a, const float *am, int64_t K,
               const uint8_t *wt, const uint16_t *st, const float *bias, void *y, int64_t ldy, int out_f32, int64_t r0,
               int64_t n0, __mmask16 nmask, int64_t g0, int64_t g1, float *part) {
    const int64_t G = K / GS;
    const int64_t gbytes = bits == 4 ? 256 : bits == 6 ? 384 : 512;
    const uint8_t *sb8 = (const uint8_t *)st;
    uint8_t wbuf[1024] __attribute__((aligned(64))); /* two groups' unpacked codes (4- and 6-bit) */
    int32_t c[AMX_ROWS * 16] __attribute__((aligned(64))), c2[AMX_ROWS * 16] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = g0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(part + 16 * r);
    /* formats 1-2: group g's dots issued into set g & 1 (tiles 0-2 or 6, 7, 5) one group ahead */
#define AMX_ISSUE(g, A, B, C)                                                                       \
    do {                                                                                            \
        const uint8_t *bt_ = codes_of(bits, wt + (g) * gbytes, wbuf + 512 * ((g) & 1));            \
        _tile_zero(C);                                                                              \
        _tile_loadd(A, xq + r0 * K + (g) * GS, K);                                                  \
        _tile_loadd(B, bt_, 64);                                                                    \
        _tile_dpbsud(C, A, B);                                                                      \
    } while (0)
    if (fmt != 3 && g0 < g1) AMX_ISSUE(g0, 0, 1, 2);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *wp = wt + g * gbytes;
        PREFETCH_GROUPS;
        const int8_t *xg = xq + r0 * K + g * GS;
        if (fmt != 3) {
            if (g & 1) {
                if (g + 1 < g1) AMX_ISSUE(g + 1, 0, 1, 2);
                _tile_stored(5, c, 64);
            } else {
                if (g + 1 < g1) AMX_ISSUE(g + 1, 6, 7, 5);
                _tile_stored(2, c, 64);
            }
        } else {
            const uint8_t *bt = codes_of(bits, wp, wbuf); /* each half's dot on its own: inputs 0-15 are B's rows 0-3, 16-31 its rows 4-7 */
            _tile_zero(2);
            _tile_zero(5);
            _tile_loadd(3, xg, K);
            _tile_loadd(4, bt, 64);
            _tile_dpbsud(2, 3, 4);
            _tile_loadd(3, xg + 16, K);
            _tile_loadd(4, bt + 256, 64);
            _tile_dpbsud(5, 3, 4);
            _tile_stored(2, c, 64);
            _tile_stored(5, c2, 64);
        }
        __m512 s, m, s2, m2;
        group_scales(fmt, st, sb8, g, &s, &m, &s2, &m2);
        for (int r = 0; r < R; r++) {
            const float ar = a[(r0 + r) * G + g];
            const __m512 d = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + 16 * r)));
            if (fmt == 3) {
                const float *hs = am + ((r0 + r) * G + g) * 2;
                const __m512 d2 = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c2 + 16 * r)));
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(hs[0]), acc[r]);
                acc[r] = _mm512_fmadd_ps(m2, _mm512_set1_ps(hs[1]), acc[r]);
                acc[r] = _mm512_fmadd_ps(d, _mm512_mul_ps(s, _mm512_set1_ps(ar)), acc[r]);
                acc[r] = _mm512_fmadd_ps(d2, _mm512_mul_ps(s2, _mm512_set1_ps(ar)), acc[r]);
            } else {
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(am[(r0 + r) * G + g]), acc[r]);
                acc[r] = _mm512_fmadd_ps(d, _mm512_mul_ps(s, _mm512_set1_ps(ar)), acc[r]);
            }
        }
    }
#undef AMX_ISSUE
    finish_rows(R, acc, g1, G, bias, y, ldy, out_f32, r0, n0, nmask, part);
}

/* All rows against one tile in tile blocks of AMX_ROWS (the last one shorter: the tiles configured again). */
static void tile_rows_amx(int bits, int fmt, const int8_t *xq, const float *a, const float *am, int64_t M, int64_t K,
                          const uint8_t *wt, const uint16_t *st, const float *bias, void *y, int64_t N, int out_f32,
                          int64_t n0, __mmask16 nmask, int64_t g0, int64_t g1, float *part, int *rows_cfg) {
    for (int64_t r0 = 0; r0 < M; r0 += AMX_ROWS) {
        const int R = (int)(M - r0 < AMX_ROWS ? M - r0 : AMX_ROWS);
        if (R != *rows_cfg) {
            amx_configure(R);
            *rows_cfg = R;
        }
#define AMX_CASE(BITS, FMT) \
    tile_block_amx(R, BITS, FMT, xq, a, am, K, wt, st, bias, y, N, out_f32, r0, n0, nmask, g0, g1, part + 16 * r0)
        if (fmt == 3) {
            if (bits == 6) AMX_CASE(6, 3); else AMX_CASE(8, 3);
        } else if (fmt == 2) {
            if (bits == 4) AMX_CASE(4, 2); else if (bits == 6) AMX_CASE(6, 2); else AMX_CASE(8, 2);
        } else if (bits == 4) {
            AMX_CASE(4, 1);
        } else if (bits == 6) {
            AMX_CASE(6, 1);
        } else {
            AMX_CASE(8, 1);
        }
#undef AMX_CASE
    }
}
#endif
