/* The two ceilings of batch-1 decoding on a CPU, measured (`python -m specdec.eval.roofline`):
 *
 *   roofline_read_bandwidth: bytes/s that `threads` threads stream from memory (the weights of a
 *     decode step are read once each, so a step takes at least their bytes over this);
 *   roofline_int8_peak: multiply-adds/s of the integer instruction this build's qgemm is made of,
 *     on independent registers (no memory, no dependency chains: an upper bound of any int8 GEMM
 *     at this level, which a prefill chunk or a verify window approaches when it is compute-bound).
 *
 * Built per instruction-set level like qgemm: AVX-512 VNNI `vpdpbusd zmm` (64 per instruction),
 * AVX-VNNI `vpdpbusd ymm` (32), AVX2 `vpmaddubsw ymm` + `vpaddw` (32: the pair qgemm's int4 loop
 * spends on each). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernel_abi.h"

#define CHUNK ((int64_t)1 << 20)

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The best of `repeats` passes of `threads` threads summing the bytes of a `bytes` buffer (its
 * pages written first); bytes/s in *out. */
int roofline_read_bandwidth(int64_t bytes, int threads, int repeats, double *out) {
    if (bytes < 4096 || threads < 1 || repeats < 1 || !out) return SPECDEC_ERR_INVALID_ARGUMENT;
    bytes -= bytes % 128;
    uint8_t *buf = (uint8_t *)aligned_alloc(64, (size_t)bytes);
    if (!buf) return SPECDEC_ERR_NO_MEMORY;
    memset(buf, 1, (size_t)bytes);
    double best = 0.0;
    volatile int sink = 0;
    for (int rep = 0; rep < repeats; rep++) {
        const double t0 = now_s();
        int total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
        {
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
#pragma omp for schedule(static, 1)
            for (int64_t c = 0; c < bytes; c += CHUNK) { /* the threads take turns at 1 MB chunks */
                const uint8_t *p = buf + c;
                const int64_t end = bytes - c < CHUNK ? bytes - c : CHUNK;
                for (int64_t i = 0; i < end; i += 128) {
                    a0 = _mm256_add_epi8(a0, _mm256_load_si256((const __m256i *)(p + i)));
                    a1 = _mm256_add_epi8(a1, _mm256_load_si256((const __m256i *)(p + i + 32)));
                    a2 = _mm256_add_epi8(a2, _mm256_load_si256((const __m256i *)(p + i + 64)));
                    a3 = _mm256_add_epi8(a3, _mm256_load_si256((const __m256i *)(p + i + 96)));
                }
            }
            const __m256i s = _mm256_add_epi8(_mm256_add_epi8(a0, a1), _mm256_add_epi8(a2, a3));
            total += _mm256_extract_epi8(s, 0);
        }
        const double rate = (double)bytes / (now_s() - t0);
        sink += total;
        if (rate > best) best = rate;
    }
    (void)sink;
    free(buf);
    *out = best;
    return SPECDEC_OK;
}

/* 12 independent multiply-accumulates per round (enough to cover the instruction's latency) */
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define MACS_PER_ROUND (12 * 64)
#define STEP(acc) "vpdpbusd %%zmm30, %%zmm31, %%zmm" acc "\n\t"
#define ROUND STEP("16") STEP("17") STEP("18") STEP("19") STEP("20") STEP("21") \
              STEP("22") STEP("23") STEP("24") STEP("25") STEP("26") STEP("27")
#define CLOBBER "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27"
#elif defined(__AVXVNNI__)
#define MACS_PER_ROUND (12 * 32)
#define STEP(acc) "%{vex%} vpdpbusd %%ymm14, %%ymm15, %%ymm" acc "\n\t"
#define ROUND STEP("0") STEP("1") STEP("2") STEP("3") STEP("4") STEP("5") \
              STEP("6") STEP("7") STEP("8") STEP("9") STEP("10") STEP("11")
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"
#else
#define MACS_PER_ROUND (12 * 32)
#define STEP(acc, tmp) "vpmaddubsw %%ymm14, %%ymm15, %%ymm" tmp "\n\tvpaddw %%ymm" tmp ", %%ymm" acc ", %%ymm" acc "\n\t"
#define ROUND STEP("0", "8") STEP("1", "9") STEP("2", "10") STEP("3", "11") STEP("4", "12") STEP("5", "13") \
              STEP("6", "8") STEP("7", "9") STEP("0", "10") STEP("1", "11") STEP("2", "12") STEP("3", "13")
#define CLOBBER "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13"
#endif

/* `rounds` rounds on each of `threads` threads; multiply-adds/s (all threads) in *out. */
int roofline_int8_peak(int64_t rounds, int threads, double *out) {
    if (rounds < 1 || threads < 1 || !out) return SPECDEC_ERR_INVALID_ARGUMENT;
    const double t0 = now_s();
#pragma omp parallel num_threads(threads)
    for (int64_t i = 0; i < rounds; i++) __asm__ volatile(ROUND ::: CLOBBER);
    *out = (double)MACS_PER_ROUND * (double)rounds * (double)threads / (now_s() - t0);
    return SPECDEC_OK;
}
