#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include <immintrin.h>
int main(int argc, char** argv) {
    size_t bytes = (size_t)(argc > 1 ? atof(argv[1]) : 2.0) * (1ull << 30);
    int reps = argc > 2 ? atoi(argv[2]) : 5;
    size_t n = bytes / 64;
    __m512i* a = aligned_alloc(64, n * 64);
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) a[i] = _mm512_set1_epi64(i);
    double best = 0;
    long long sink = 0;
    for (int r = 0; r < reps; r++) {
        double t = omp_get_wtime();
        __m512i acc_total = _mm512_setzero_si512();
        #pragma omp parallel
        {
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
            #pragma omp for nowait
            for (size_t i = 0; i < n; i += 4) {
                a0 = _mm512_xor_si512(a0, _mm512_load_si512(a + i));
                a1 = _mm512_xor_si512(a1, _mm512_load_si512(a + i + 1));
                a2 = _mm512_xor_si512(a2, _mm512_load_si512(a + i + 2));
                a3 = _mm512_xor_si512(a3, _mm512_load_si512(a + i + 3));
            }
            __m512i s = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
            #pragma omp critical
            acc_total = _mm512_xor_si512(acc_total, s);
        }
        double dt = omp_get_wtime() - t;
        sink += _mm512_reduce_add_epi64(acc_total);
        double gbs = n * 64 / dt / 1e9;
        if (gbs > best) best = gbs;
    }
    printf("%.2f %lld\n", best, sink & 1);
    return 0;
}
