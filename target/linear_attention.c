/* Gated DeltaNet's recurrence in one C call per layer and window (`linear_attention.py`).
 *
 * A window of n rows of one sequence, from the states as of its start:
 *   1. the causal depthwise convolution over the projected q | k | v (kernel K, SiLU), per channel
 *      over the rows, from the last K-1 inputs (`conv_in`);
 *   2. q and k L2-normalised per key head, q scaled by 1/sqrt(Dk);
 *   3. per value head h, token by token:
 *        S = exp(g) * S;  delta = beta * (v - S^T k);  S = S + k delta^T;  o = S^T q
 * The states after each of the last `keep` rows go to `conv_out[i]` / `ssm_out[i]` (ring entries
 * of the runner's `RecurrentStateCache`; one of them may be the entry read: the inputs are copied
 * first). Every sum runs in fp32 in a fixed order (the inner loops run over the value dimension, so
 * they vectorise without reassociation): a row's result does not depend on the window it came in,
 * nor on the level the library was built for.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_abi.h"

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

static void l2norm(float *x, int64_t d, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d; i++) ss += x[i] * x[i];
    const float r = scale / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < d; i++) x[i] *= r;
}

int gated_delta_window(const float *mixed, int64_t n, const float *conv_w, int64_t channels, int64_t kernel,
                       const float *g, const float *beta, int64_t key_heads, int64_t heads, int64_t dk, int64_t dv,
                       int tiled, const float *conv_in, const float *ssm_in, int64_t keep, float *const *conv_out,
                       float *const *ssm_out, float *out, int threads) {
    const int64_t width = kernel - 1, key_dim = key_heads * dk;
    if (n < 1 || keep < 0 || keep > n || kernel < 1 || key_heads < 1 || heads % key_heads != 0 || dk < 1 || dv < 1 ||
        channels != 2 * key_dim + heads * dv || !mixed || !conv_w || !g || !beta || !out || (keep && (!conv_out || !ssm_out)))
        return SPECDEC_ERR_INVALID_ARGUMENT;
    const int64_t r = heads / key_heads;
    float *conv = malloc((size_t)(n * channels) * sizeof(float));
    if (!conv) return SPECDEC_ERR_NO_MEMORY;
    int failed = 0;

#pragma omp parallel num_threads(threads)
    {
        float *win = malloc((size_t)(width + n) * sizeof(float));
        float *s = malloc((size_t)(dk * dv + 2 * dv) * sizeof(float));
        if (!win || !s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            /* 1. the convolution, channel by channel over the rows */
#pragma omp for schedule(static)
            for (int64_t c = 0; c < channels; c++) {
                for (int64_t i = 0; i < width; i++) win[i] = conv_in ? conv_in[c * width + i] : 0.0f;
                for (int64_t t = 0; t < n; t++) win[width + t] = mixed[t * channels + c];
                const float *w = conv_w + c * kernel;
                for (int64_t t = 0; t < n; t++) {
                    float acc = 0.0f;
                    for (int64_t i = 0; i < kernel; i++) acc += w[i] * win[t + i];
                    conv[t * channels + c] = silu(acc);
                }
                for (int64_t i = 0; i < keep; i++) /* the last K-1 inputs after row n-keep+i */
                    memcpy(conv_out[i] + c * width, win + (n - keep + i) + 1, (size_t)width * sizeof(float));
            }
            /* 2. q and k normalised per key head */
            const float qscale = 1.0f / sqrtf((float)dk);
#pragma omp for schedule(static)
            for (int64_t j = 0; j < n * 2 * key_heads; j++) {
                const int64_t t = j / (2 * key_heads), part = j % (2 * key_heads);
                l2norm(conv + t * channels + part * dk, dk, part < key_heads ? qscale : 1.0f);
            }
            /* 3. the recurrence, value head by value head over the rows */
#pragma omp for schedule(static)
            for (int64_t h = 0; h < heads; h++) {
                const int64_t kh = tiled ? h % key_heads : h / r;
                float *kv = s + dk * dv, *delta = kv + dv;
                if (ssm_in)
                    memcpy(s, ssm_in + h * dk * dv, (size_t)(dk * dv) * sizeof(float));
                else
                    memset(s, 0, (size_t)(dk * dv) * sizeof(float));
                for (int64_t t = 0; t < n; t++) {
                    const float *q = conv + t * channels + kh * dk, *k = conv + t * channels + key_dim + kh * dk;
                    const float *v = conv + t * channels + 2 * key_dim + h * dv;
                    const float decay = expf(g[t * heads + h]), b = beta[t * heads + h];
                    float *o = out + (t * heads + h) * dv;
                    for (int64_t j = 0; j < dv; j++) kv[j] = 0.0f;
                    for (int64_t i = 0; i < dk; i++) {
                        float *row = s + i * dv;
                        const float ki = k[i];
                        for (int64_t j = 0; j < dv; j++) {
                            const float x = row[j] * decay;
                            row[j] = x;
                            kv[j] += x * ki;
                        }
                    }
                    for (int64_t j = 0; j < dv; j++) {
                        delta[j] = (v[j] - kv[j]) * b;
                        o[j] = 0.0f;
                    }
                    for (int64_t i = 0; i < dk; i++) {
                        float *row = s + i * dv;
                        const float ki = k[i], qi = q[i];
                        for (int64_t j = 0; j < dv; j++) {
                            const float x = row[j] + ki * delta[j];
                            row[j] = x;
                            o[j] += x * qi;
                        }
                    }
                    if (t >= n - keep)
                        memcpy(ssm_out[t - (n - keep)] + h * dk * dv, s, (size_t)(dk * dv) * sizeof(float));
                }
            }
        }
        free(win);
        free(s);
    }
    free(conv);
    return failed ? SPECDEC_ERR_NO_MEMORY : SPECDEC_OK;
}
