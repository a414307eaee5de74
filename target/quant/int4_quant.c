/* Asymmetric int4 per group of inputs, the quantizer of int4.py (`quantize_int4`) in one pass.
 *
 * Per group of g weights w (g <= SPECDEC_MAX_INT4_GROUP): sort it; lo, hi = its ends; the
 * min-max step (hi - lo) / 15; the grid step, the smallest gap between sorted neighbours above
 * 1e-4 of that (Q4_K weights sit on such a grid). The grid step is taken when the group spans at
 * most 15.01 of them and every (w - lo) / step is within 0.02 of an integer; else the min-max
 * step. q = round((w - lo) / step) in 0..15, zero = lo + 8 * step.
 *
 * Every value is the same IEEE float32 operation, in the same order, as the torch code it
 * replaces (sub, div, mul by float(c), compare, round half to even), and ISO C11 contracts no
 * multiply-add, so q, step and zero are bitwise torch's (tests/target/test_int4_quant.py). torch
 * spent ~20 passes over the weights for it: ~13 s for the 0.5B draft on two cores.
 */
#include <math.h>
#include <stdint.h>

#include "kernel_abi.h"

static void sort_floats(float *v, int n) { /* insertion sort: n is a group (32) */
    for (int i = 1; i < n; i++) {
        float x = v[i];
        int j = i - 1;
        while (j >= 0 && v[j] > x) {
            v[j + 1] = v[j];
            j--;
        }
        v[j + 1] = x;
    }
}

static void quantize_group(const float *w, int g, int32_t *q, float *step_out, float *zero_out) {
    float s[SPECDEC_MAX_INT4_GROUP];
    for (int i = 0; i < g; i++) s[i] = w[i];
    sort_floats(s, g);
    float lo = s[0], hi = s[g - 1];
    float minmax = (hi - lo) / 15.0f;
    if (minmax < 1e-12f) minmax = 1e-12f;
    float tiny = 1e-4f * minmax;
    float grid = INFINITY;
    for (int i = 0; i + 1 < g; i++) {
        float gap = s[i + 1] - s[i];
        if (gap > tiny && gap < grid) grid = gap;
    }
    if (isinf(grid)) grid = minmax;
    float step = (hi - lo) <= grid * 15.01f ? grid : minmax;
    float off = 0.0f, level[SPECDEC_MAX_INT4_GROUP];
    for (int i = 0; i < g; i++) {
        level[i] = (w[i] - lo) / step;
        float d = fabsf(level[i] - rintf(level[i]));
        if (d > off) off = d;
    }
    if (!(off < 0.02f)) { /* off the grid: the min-max step */
        step = minmax;
        for (int i = 0; i < g; i++) level[i] = (w[i] - lo) / step;
    }
    for (int i = 0; i < g; i++) {
        float v = rintf(level[i]);
        q[i] = (int32_t)(v < 0.0f ? 0.0f : v > 15.0f ? 15.0f : v);
    }
    *step_out = step;
    *zero_out = lo + 8.0f * step;
}

int quantize_int4_groups(const float *w, int64_t groups, int64_t group_size, int32_t *q, float *step,
                         float *zero, int threads) {
    if (!w || !q || !step || !zero || groups < 0 || group_size < 2 || group_size > SPECDEC_MAX_INT4_GROUP)
        return SPECDEC_ERR_INVALID_ARGUMENT;
    const int g = (int)group_size;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t i = 0; i < groups; i++)
        quantize_group(w + i * g, g, q + i * g, step + i, zero + i);
    return SPECDEC_OK;
}
