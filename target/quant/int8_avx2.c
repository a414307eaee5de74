/* W8A8 GEMM for AVX2 CPUs without VNNI, straight from row-major int8 weights:
 *   y[M, N] = float(sum_k q[m, k] * w[n, k]) * w_scale[n],  q = clamp(nearbyint(x + zp), 0, 255) - zp
 * bitwise what fbgemm's `linear_with_input_q_dq_qweight_dq_output_fp32` returns for the same x
 * (activation scale 1, zero point zp) and the same weights packed by `linear_prepack`, but with no
 * packing at all: a model multiplies the `weight_int8 [N, K]` it loaded as it is.
 *
 * Activations: x comes scaled per row into [-63, 63] (Int8Linear) and is quantized as fbgemm does:
 * the zero point is added in fp32 before rounding (x = 0.5000027 gives q = 0, not 1: rounding x
 * first disagreed with fbgemm), the result clamped to [0, 255]; here q is also kept to
 * [-Q_MAX, Q_MAX], which changes nothing for |x| <= 63.5 and keeps every int16 sum below exact.
 *
 * Products (the sign trick): `vpmaddubsw` takes unsigned bytes times signed bytes, so it gets |w|
 * and q with w's sign (`vpsignb`): pairs of products q * w summed into int16. Two steps' int16 sums
 * (4 products, |sum| <= 4 * 128 * 63 < 2^15) are added before one `vpmaddwd` with ones widens them
 * to int32: 3 multiplies per 64 inputs where u8 activations need 4, and no weight sums to make at
 * load. Integer sums are exact in any order, then y = (float)acc * w_scale[n] as fbgemm's
 * requantization computes it, so neither the tiling nor the thread count changes a result.
 *
 * Tiling: MAX_ROWS rows of x against COLS output channels (8 int32 accumulators); rows go in
 * blocks whose activations stay in L2 (ROW_BLOCK_BYTES) while a thread's weight rows stream past:
 * a decode step (M = 1) reads each weight once, verification (M = 2..9) reads a tile from memory
 * once and again from L1, prefill re-streams the weights once per row block. Each tile prefetches
 * the next one, in memory order where a tile is small (LINEAR_BYTES: short rows), else row by row
 * at the same offsets (on a 2-core AVX2 EPYC, either order alone was up to 1.3x slower for one of
 * K = 1536 and K = 8960). Threads split the output channels into contiguous ranges.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernel_abi.h"

#define K_STEP 32   /* inputs per vpmaddubsw */
#define COLS 4      /* output channels per tile */
#define MAX_ROWS 2  /* rows per tile */
#define Q_MAX 63    /* |q| */
#define LINEAR_BYTES (16 * 1024)     /* tiles up to this size prefetch the next in memory order */
#define ROW_BLOCK_BYTES (192 * 1024) /* quantized activations per row block */

/* x [M, K] fp32 -> xq [M, K] s8 = clamp(nearbyint(x + zp), lo, hi) - zp, 32 inputs at a time,
 * where [lo, hi] is fbgemm's [0, 255] narrowed to zp -+ 63 (see the top). cvtps rounds to nearest
 * even (the default MXCSR); the two packs interleave 128-bit lanes, which `order` undoes. */
static void quantize_rows(const float *x, int64_t m, int64_t k, int zero_point, int8_t *xq, int threads) {
    const __m256 zp = _mm256_set1_ps((float)zero_point);
    const __m256i lo = _mm256_set1_epi32(zero_point > Q_MAX ? zero_point - Q_MAX : 0);
    const __m256i hi = _mm256_set1_epi32(zero_point + Q_MAX < 255 ? zero_point + Q_MAX : 255);
    const __m256i zpi = _mm256_set1_epi32(zero_point), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k > (1 << 16))
    for (int64_t r = 0; r < m; r++) {
        for (int64_t j = 0; j < k; j += K_STEP) {
            const float *p = x + r * k + j;
            __m256i q[4];
            for (int i = 0; i < 4; i++) {
                const __m256i u = _mm256_cvtps_epi32(_mm256_add_ps(_mm256_loadu_ps(p + 8 * i), zp));
                q[i] = _mm256_sub_epi32(_mm256_min_epi32(_mm256_max_epi32(u, lo), hi), zpi);
            }
            const __m256i s8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(xq + r * k + j), _mm256_permutevar8x32_epi32(s8, order));
        }
    }
}

/* The four int32 totals of a, b, c, d (8 lanes each). */
static inline __m128i hsum4(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

#define LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
/* |w| * (q with w's sign): 16 int16 sums of two products each, |sum| <= 2 * 128 * Q_MAX. */
#define PRODUCTS(absw, q, w) _mm256_maddubs_epi16(absw, _mm256_sign_epi8(q, w))

/* sums[r][c] = sum_k xq[r, k] * w[c, k] for `rows` rows of xq and `cols` weight rows (both
 * compile-time constants where it is inlined, so the accumulators live in registers). Two steps'
 * int16 sums are added before widening (4 products, |sum| <= 4 * 128 * Q_MAX < 2^15): one
 * vpmaddwd per 64 inputs. Prefetches the next tile's weights, a line per 64 inputs and channel. */
static inline __attribute__((always_inline)) void dot_tile(const int8_t *xq, const int8_t *w, int64_t k,
                                                           int rows, int cols, int32_t sums[MAX_ROWS][COLS]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int linear = cols * k <= LINEAR_BYTES;
    __m256i acc[MAX_ROWS][COLS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < COLS; c++)
            acc[r][c] = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 2 * K_STEP <= k; j += 2 * K_STEP) {
        for (int c = 0; c < cols; c++) {
            const int8_t *wc = w + c * k + j, *next = w + cols * k; /* the next tile (or past the end) */
            _mm_prefetch((const char *)(linear ? next + (j / (2 * K_STEP) * cols + c) * 64 : wc + cols * k),
                         _MM_HINT_T0);
            const __m256i a0 = _mm256_abs_epi8(LOAD(wc)), a1 = _mm256_abs_epi8(LOAD(wc + K_STEP));
            for (int r = 0; r < rows; r++) {
                const int8_t *q = xq + r * k + j;
                const __m256i t = _mm256_add_epi16(PRODUCTS(a0, LOAD(q), LOAD(wc)),
                                                   PRODUCTS(a1, LOAD(q + K_STEP), LOAD(wc + K_STEP)));
                acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(t, ones));
            }
        }
    }
    if (j < k) /* k % 64 == 32 */
        for (int c = 0; c < cols; c++) {
            const int8_t *wc = w + c * k + j;
            const __m256i a0 = _mm256_abs_epi8(LOAD(wc));
            for (int r = 0; r < rows; r++) {
                const __m256i t = PRODUCTS(a0, LOAD(xq + r * k + j), LOAD(wc));
                acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(t, ones));
            }
        }
    for (int r = 0; r < rows; r++)
        _mm_storeu_si128((__m128i *)sums[r], hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

/* One instance per tile shape: full tiles of COLS channels, and single channels for N's tail. */
#define TILE_FN(R, C) \
    static void dot_##R##x##C(const int8_t *xq, const int8_t *w, int64_t k, int32_t s[MAX_ROWS][COLS]) { \
        dot_tile(xq, w, k, R, C, s); \
    }
TILE_FN(1, 4)
TILE_FN(2, 4)
TILE_FN(1, 1)
TILE_FN(2, 1)

typedef void (*tile_fn)(const int8_t *, const int8_t *, int64_t, int32_t[MAX_ROWS][COLS]);
static const tile_fn TILES[MAX_ROWS][2] = {{dot_1x1, dot_1x4}, {dot_2x1, dot_2x4}};

/* Output channels [n0, n1) for rows [r0, r1). */
static void gemm_range(const int8_t *xq, int64_t r0, int64_t r1, int64_t k, const int8_t *w,
                       const float *w_scale, int64_t n, int64_t n0, int64_t n1, float *y) {
    for (int64_t c0 = n0; c0 < n1;) {
        const int cols = n1 - c0 >= COLS ? COLS : 1;
        for (int64_t r = r0; r < r1; r += MAX_ROWS) {
            const int rows = r1 - r < MAX_ROWS ? (int)(r1 - r) : MAX_ROWS;
            int32_t sums[MAX_ROWS][COLS];
            TILES[rows - 1][cols == COLS](xq + r * k, w + c0 * k, k, sums);
            for (int i = 0; i < rows; i++)
                for (int c = 0; c < cols; c++)
                    y[(r + i) * n + c0 + c] = (float)sums[i][c] * w_scale[c0 + c];
        }
        c0 += cols;
    }
}

int int8_gemm_avx2(const float *x, int64_t m, int64_t k, const int8_t *w, const float *w_scale, int64_t n,
                   float *y, int zero_point, int threads) {
    if (!x || !w || !w_scale || !y || m < 0 || n < 0 || k <= 0 || k % K_STEP || zero_point < 0 ||
        zero_point > 255 || threads < 1)
        return SPECDEC_ERR_INVALID_ARGUMENT;
    if (m == 0 || n == 0)
        return SPECDEC_OK;
    int8_t *xq = aligned_alloc(64, (size_t)((m * k + 63) / 64 * 64));
    if (!xq)
        return SPECDEC_ERR_NO_MEMORY;
    quantize_rows(x, m, k, zero_point, xq, threads);
    const int64_t block = ROW_BLOCK_BYTES / k > MAX_ROWS ? ROW_BLOCK_BYTES / k / MAX_ROWS * MAX_ROWS : MAX_ROWS;
    const int64_t tiles = (n + COLS - 1) / COLS, parts = tiles < threads ? tiles : threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (parts > 1)
    for (int64_t p = 0; p < parts; p++) {
        const int64_t n0 = tiles * p / parts * COLS, n1 = tiles * (p + 1) / parts * COLS;
        for (int64_t r0 = 0; r0 < m; r0 += block)
            gemm_range(xq, r0, r0 + block < m ? r0 + block : m, k, w, w_scale, n, n0, n1 < n ? n1 : n, y);
    }
    free(xq);
    return SPECDEC_OK;
}
