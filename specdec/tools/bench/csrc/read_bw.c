#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
/* Best read bandwidth over `bytes`, all threads, wide loads and nothing else: 64-byte loads with
 * AVX-512, two 32-byte loads per 64-byte line with AVX2 (CPUs without AVX-512), and elsewhere (aarch64:
 * NEON, four 16-byte loads per line) the line as a GCC vector, which the compiler splits into its own
 * widest loads. */
#ifdef __AVX512F__
#include <immintrin.h>
typedef __m512i line_t;
#define LINE_ZERO() _mm512_setzero_si512()
#define LINE_XOR(acc, p) _mm512_xor_si512(acc, _mm512_load_si512(p))
#define LINE_SUM(v) _mm512_reduce_add_epi64(v)
#elif defined(__AVX2__)
#include <immintrin.h>
typedef __m256i line_t;
#define LINE_ZERO() _mm256_setzero_si256()
#define LINE_XOR(acc, p) _mm256_xor_si256(_mm256_xor_si256(acc, _mm256_load_si256((const __m256i *)(p))), \
                                          _mm256_load_si256((const __m256i *)(p) + 1))
#define LINE_SUM(v) (_mm256_extract_epi64(v, 0) + _mm256_extract_epi64(v, 1))
#else
typedef uint64_t line_t __attribute__((vector_size(64), may_alias));
#define LINE_ZERO() ((line_t){0})
#define LINE_XOR(acc, p) ((acc) ^ *(const line_t *)(const void *)(p))
#define LINE_SUM(v) ((long long)((v)[0] + (v)[1] + (v)[2] + (v)[3] + (v)[4] + (v)[5] + (v)[6] + (v)[7]))
#endif
int main(int argc, char** argv) {
    size_t bytes = (size_t)((argc > 1 ? atof(argv[1]) : 2.0) * (double)(1ull << 30)); /* fractions of a GiB too */
    int reps = argc > 2 ? atoi(argv[2]) : 5;
    size_t n = bytes / 64;
    char* a = aligned_alloc(64, n * 64);
    #pragma omp parallel for
    for (size_t i = 0; i < n; i++) memset(a + 64 * i, (int)(i & 255), 64);
    double best = 0;
    long long sink = 0;
    for (int r = 0; r < reps; r++) {
        double t = omp_get_wtime();
        long long total = 0;
        #pragma omp parallel
        {
            line_t a0 = LINE_ZERO(), a1 = a0, a2 = a0, a3 = a0;
            #pragma omp for nowait
            for (size_t i = 0; i < n; i += 4) {
                a0 = LINE_XOR(a0, a + 64 * i);
                a1 = LINE_XOR(a1, a + 64 * (i + 1));
                a2 = LINE_XOR(a2, a + 64 * (i + 2));
                a3 = LINE_XOR(a3, a + 64 * (i + 3));
            }
            long long s = LINE_SUM(a0) + LINE_SUM(a1) + LINE_SUM(a2) + LINE_SUM(a3);
            #pragma omp atomic
            total += s;
        }
        double dt = omp_get_wtime() - t;
        sink += total;
        double gbs = n * 64 / dt / 1e9;
        if (gbs > best) best = gbs;
    }
    printf("%.2f %lld\n", best, sink & 1);
    return 0;
}
