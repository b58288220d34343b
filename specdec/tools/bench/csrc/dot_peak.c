/* The machine's peak rate of the two dot-product instructions our products are made of, on all
 * threads: vpdpbusd (u8 x s8, 64 multiply-adds: the int8/int4 products) and vdpbf16ps (bf16 pairs, 32
 * multiply-adds: the bf16 products). Prints "<vpdpbusd per second> <vdpbf16ps per second>" (totals
 * over the threads, best of the repeats). With a product's multiply-adds this gives the time below
 * which no kernel can go when it is compute-bound (a block of several rows on two cores).
 *
 * Twelve independent accumulator chains per thread (more than latency x throughput), operands in
 * registers, so only the instruction's throughput is measured. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#define CHAINS 12

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
