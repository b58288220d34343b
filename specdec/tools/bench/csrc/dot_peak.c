/* The machine's peak rate of the two dot-product instructions our products are made of, on all
 * threads: vpdpbusd (u8 x s8, 64 multiply-adds: the int8/int4 products) and vdpbf16ps (bf16 pairs, 32
 * multiply-adds: the bf16 products). Prints "<vpdpbusd per second> <vdpbf16ps per second>" (totals
 * over the threads, best of the repeats). With a product's multiply-adds this gives the time below
 * which no kernel can go when it is compute-bound (a block of several rows on two cores).
 *
 * Twelve independent accumulator chains per thread (more than latency x throughput), operands in
 * registers, so only the instruction's throughput is measured. */
#if !defined(__x86_64__) && !defined(__i386__)
#error "dot_peak.c times x86 instructions (vpdpbusd and vdpbf16ps, or the AVX2 kernels' sequences): no probe for this architecture yet"
#else
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#define CHAINS 12

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
static __attribute__((noinline)) int32_t int8_chains(long n, int seed) {
    __m512i acc[CHAINS];
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_epi32(seed + i);
    const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8((char)(seed & 7));
    for (long k = 0; k < n; k++)
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], u, s);
    __m512i t = acc[0];
    for (int i = 1; i < CHAINS; i++) t = _mm512_add_epi32(t, acc[i]);
    return _mm512_reduce_add_epi32(t);
}

static __attribute__((noinline)) float bf16_chains(long n, int seed) {
    __m512 acc[CHAINS];
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_ps(1e-3f * (float)(seed + i));
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3c00), b = (__m512bh)_mm512_set1_epi16((short)(0x2000 + seed));
    for (long k = 0; k < n; k++)
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __m512 t = acc[0];
    for (int i = 1; i < CHAINS; i++) t = _mm512_add_ps(t, acc[i]);
    return _mm512_reduce_add_ps(t);
}

#else
/* AVX2 CPUs: the instruction sequences the AVX2 build of the kernels uses instead, counted in the same
 * units (one vpdpbusd = 64 multiply-adds, one vdpbf16ps = 32), so the caller's arithmetic holds:
 * int8 as qmm.c's tile_block does it, vpmaddubsw + vpaddw (32 multiply-adds into 16-bit sums) with a
 * vpmaddwd + vpaddd widening every 8 of them, each chain its own s8 operand and the u8 one changing every
 * round (constant operands would let the compiler hoist the products out of the loop and time only the
 * adds, as an earlier version of this file did); bf16 as the widening of a tile's pairs and two FMAs
 * (16 multiply-adds). */
#define CHAINS8 6
static __attribute__((noinline)) int32_t int8_chains(long n, int seed) {
    __m256i acc[CHAINS8], s[CHAINS8];
    for (int i = 0; i < CHAINS8; i++) {
        acc[i] = _mm256_set1_epi32(seed + i);
        s[i] = _mm256_set1_epi8((char)(seed + 2 * i + 1));
    }
    __m256i u = _mm256_set1_epi8(3);
    const __m256i one = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(1);
    const long rounds = 2 * n * CHAINS / CHAINS8; /* 32 multiply-adds per chain per round */
    for (long k = 0; k < rounds; k += 8) {
        __m256i t[CHAINS8];
        for (int i = 0; i < CHAINS8; i++) t[i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            u = _mm256_add_epi8(u, flip); /* period 256: nothing to hoist */
            for (int i = 0; i < CHAINS8; i++) t[i] = _mm256_add_epi16(t[i], _mm256_maddubs_epi16(u, s[i]));
        }
        for (int i = 0; i < CHAINS8; i++) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(t[i], one));
    }
    __m256i t = acc[0];
    for (int i = 1; i < CHAINS8; i++) t = _mm256_add_epi32(t, acc[i]);
    return _mm256_extract_epi32(t, 0) + _mm256_extract_epi32(t, 7);
}
static __attribute__((noinline)) float bf16_chains(long n, int seed) {
    __m256 acc[CHAINS];
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_set1_ps(1e-3f * (float)(seed + i));
    __m256i w = _mm256_set1_epi32(0x3c003c00 + seed);
    const __m256 xe = _mm256_set1_ps(1e-3f), xo = _mm256_set1_ps(2e-3f);
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (long k = 0; k < 2 * n; k++) /* two rounds = one vpdpbusd (vdpbf16ps) of multiply-adds */ {
        w = _mm256_xor_si256(w, _mm256_set1_epi32(1)); /* a new "load" each round, kept in registers */
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), wo = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_fmadd_ps(wo, xo, _mm256_fmadd_ps(we, xe, acc[i]));
    }
    __m256 t = acc[0];
    for (int i = 1; i < CHAINS; i++) t = _mm256_add_ps(t, acc[i]);
    return _mm256_cvtss_f32(t);
}
#endif

int main(int argc, char **argv) {
    const long n = argc > 1 ? atol(argv[1]) : 20000000;
    const int reps = argc > 2 ? atoi(argv[2]) : 3;
    double best[2] = {0, 0};
    volatile float sink = 0;
    for (int r = 0; r < reps; r++)
        for (int kind = 0; kind < 2; kind++) {
            int nt = 1;
            const double t = omp_get_wtime();
#pragma omp parallel
            {
#pragma omp single
                nt = omp_get_num_threads();
                const int id = omp_get_thread_num();
                const float v = kind == 0 ? (float)int8_chains(n, id + r) : bf16_chains(n, id + r);
#pragma omp atomic
                sink += v;
            }
            const double rate = (double)n * CHAINS * nt / (omp_get_wtime() - t);
            if (rate > best[kind]) best[kind] = rate;
        }
    printf("%.4g %.4g\n", best[0], best[1]);
    return sink == 12345.0f; /* keeps the results live */
}
#endif
