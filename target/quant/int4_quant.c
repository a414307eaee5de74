/* Asymmetric int4 quantization per group of 32 float32 weights: `int4._quantize_int4_rows` in C
 * with AVX2, eight groups at a time (one per lane), bitwise its torch path: the same float32
 * operations in the same order (IEEE division and products, rounding to nearest even as
 * torch.round does, scalars as float32, torch's bf16 rounding; no FMA). The torch path's sort and
 * dozen passes over each chunk took ~15 s of the default pair's first load.
 *
 * Per group of 32 weights w:
 *   lo, hi = min, max;  minmax = max((hi - lo) / 15, 1e-12)
 *   grid = the smallest gap > 1e-4 * minmax between sorted neighbours (none: minmax)
 *   step = grid if hi - lo <= grid * 15.01 else minmax
 *   off the grid (some |(w - lo) / step - round(...)| >= 0.02): step = minmax
 *   q = clamp(round((w - lo) / step), 0, 15); zero = lo + 8 * step; step, zero stored as bf16.
 * The sort is a bitonic network of min / max: the sorted values, hence the gaps, are numpy's
 * whatever the order of ties. With `err_sq`: the sum of ((q - 8) * step + zero - w)^2 with the
 * bf16 step and zero, in double (the torch path sums in float32 in another order: only a bound is
 * tested on it).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernel_abi.h"

#define G 32    /* weights per group */
#define LANES 8 /* groups at a time */
#define ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* fp32 -> bf16 bits in the low half of each lane, rounding to nearest even (NaN: 0x7FC0). */
static inline __m256i to_bf16(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
}

static inline __m256 from_bf16(__m256i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)); }

/* Eight groups back to back at `w` (the tail zero-padded by the caller): their q (back to back),
 * steps and zeros (bf16 bits); returns their squared error (0 unless with_error). */
static double quantize8(const float *w, int count, int32_t *q, uint16_t *step_out, uint16_t *zero_out, int with_error) {
    const __m256i lanes = _mm256_setr_epi32(0, G, 2 * G, 3 * G, 4 * G, 5 * G, 6 * G, 7 * G);
    __m256 v[G], s[G];
    for (int i = 0; i < G; i++) v[i] = s[i] = _mm256_i32gather_ps(w + i, lanes, 4);
    for (int size = 2; size <= G; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1)
            for (int i = 0; i < G; i++) {
                const int j = i ^ stride;
                if (j <= i) continue;
                const int a = (i & size) ? j : i, b = (i & size) ? i : j; /* s[a] <= s[b] after */
                const __m256 x = s[a], y = s[b];
                s[a] = _mm256_min_ps(x, y), s[b] = _mm256_max_ps(x, y);
            }
    const __m256 lo = s[0], range = _mm256_sub_ps(s[G - 1], s[0]), inf = _mm256_set1_ps(__builtin_inff());
    const __m256 minmax = _mm256_max_ps(_mm256_div_ps(range, _mm256_set1_ps(15.0f)), _mm256_set1_ps(1e-12f));
    const __m256 tiny = _mm256_mul_ps(_mm256_set1_ps(1e-4f), minmax);
    __m256 grid = inf;
    for (int i = 1; i < G; i++) {
        const __m256 gap = _mm256_sub_ps(s[i], s[i - 1]);
        grid = _mm256_min_ps(grid, _mm256_blendv_ps(inf, gap, _mm256_cmp_ps(gap, tiny, _CMP_GT_OQ)));
    }
    grid = _mm256_blendv_ps(grid, minmax, _mm256_cmp_ps(grid, inf, _CMP_EQ_OQ));
    const __m256 fits = _mm256_cmp_ps(range, _mm256_mul_ps(grid, _mm256_set1_ps(15.01f)), _CMP_LE_OQ);
    __m256 step = _mm256_blendv_ps(minmax, grid, fits);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 worst = _mm256_setzero_ps();
    for (int i = 0; i < G; i++) {
        const __m256 x = _mm256_div_ps(_mm256_sub_ps(v[i], lo), step);
        worst = _mm256_max_ps(worst, _mm256_and_ps(_mm256_sub_ps(x, _mm256_round_ps(x, ROUND)), abs_mask));
    }
    step = _mm256_blendv_ps(minmax, step, _mm256_cmp_ps(worst, _mm256_set1_ps(0.02f), _CMP_LT_OQ));
    const __m256 zero = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_set1_ps(8.0f), step));
    const __m256i step_h = to_bf16(step), zero_h = to_bf16(zero);
    const __m256 step_b = from_bf16(step_h), zero_b = from_bf16(zero_h);
    int32_t sh[LANES], zh[LANES], lane_q[LANES];
    _mm256_storeu_si256((__m256i *)sh, step_h), _mm256_storeu_si256((__m256i *)zh, zero_h);
    for (int l = 0; l < count; l++) step_out[l] = (uint16_t)sh[l], zero_out[l] = (uint16_t)zh[l];
    __m256d err = _mm256_setzero_pd();
    for (int i = 0; i < G; i++) {
        __m256 level = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(v[i], lo), step), ROUND);
        level = _mm256_min_ps(_mm256_max_ps(level, _mm256_setzero_ps()), _mm256_set1_ps(15.0f));
        _mm256_storeu_si256((__m256i *)lane_q, _mm256_cvtps_epi32(level));
        for (int l = 0; l < count; l++) q[l * G + i] = lane_q[l];
        if (with_error) {
            const __m256 d = _mm256_sub_ps(
                _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(level, _mm256_set1_ps(8.0f)), step_b), zero_b), v[i]);
            const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(d)), d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(d, 1));
            err = _mm256_add_pd(err, _mm256_add_pd(_mm256_mul_pd(d0, d0), _mm256_mul_pd(d1, d1)));
        }
    }
    double e[4];
    _mm256_storeu_pd(e, err);
    return e[0] + e[1] + e[2] + e[3]; /* padded lanes: zeros, error 0 */
}

/* w [n, k] fp32 -> q [n, k] int32 in 0..15 and the rows' step and zero (bf16 bits) at
 * scales_and_zeros[2 * (group_index * sz_rows + row) + 0 / 1]: rows [row0, row0 + n) of a
 * [k / 32, sz_rows, 2] tensor whose pointer is already offset by 2 * row0; *err_sq (with_error)
 * the squared error of the reconstruction. */
int int4_quantize_rows(const float *w, int64_t n, int64_t k, int64_t group, int32_t *q, uint16_t *scales_and_zeros,
                       int64_t sz_rows, int with_error, double *err_sq, int threads) {
    if (!w || !q || !scales_and_zeros || n < 0 || k <= 0 || group != G || k % G || sz_rows < n ||
        (with_error && !err_sq) || threads < 1)
        return SPECDEC_ERR_INVALID_ARGUMENT;
    const int64_t groups = k / G, total_groups = n * groups; /* groups lie back to back, row by row */
    double total = 0.0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total) if (n * k > (1 << 16))
    for (int64_t first = 0; first < total_groups; first += LANES) {
        const int count = total_groups - first < LANES ? (int)(total_groups - first) : LANES;
        float padded[LANES * G];
        const float *src = w + first * G;
        if (count < LANES) { /* the tail: zeros past the last group, nothing written for them */
            memset(padded, 0, sizeof padded);
            memcpy(padded, src, sizeof(float) * (size_t)(count * G));
            src = padded;
        }
        uint16_t step[LANES], zero[LANES];
        total += quantize8(src, count, q + first * G, step, zero, with_error);
        for (int l = 0; l < count; l++) {
            const int64_t r = (first + l) / groups, gi = (first + l) % groups;
            scales_and_zeros[2 * (gi * sz_rows + r)] = step[l];
            scales_and_zeros[2 * (gi * sz_rows + r) + 1] = zero[l];
        }
    }
    if (with_error) *err_sq = total;
    return SPECDEC_OK;
}
