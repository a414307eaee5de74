/* Group-quantized GEMM for decoding on the CPU: y[M, N] = x[M, K] @ w[N, K]^T (+ bias).
 *
 * Weights are quantized per group of 32 inputs, 16 output channels to a tile; each tile is
 * either int4 (w = (q - 8) * step + zero, q in 0..15: GGUF Q4_K weights fit this exactly) or
 * int8 (w = (q - 128) * step, q in 1..255). Activations are quantized per row and per group of 32
 * (x ~ xq * xs, xq in -127..127), so an outlier channel only coarsens its own group (as
 * llama.cpp's Q8 activation blocks do; per-row int8 needs SmoothQuant instead).
 *
 * The inner product of a group is exact in int32 (AVX-512 VNNI `vpdpbusd`: unsigned weight bytes
 * times signed activation bytes); the weight offset is removed with the group's activation sum:
 *   sum_k w_k x_k ~ xs_g * (step_n * (isum - off * xsum_g) + zero_n * xsum_g).
 * Every row runs the same instructions in the same order whatever the other rows are, and an
 * output channel is computed by one thread, so results are bitwise independent of the batch
 * (speculative verification of k+1 rows equals k+1 single-row forwards).
 *
 * Each weight tile is read once per call however many rows there are: rows are processed in
 * chunks of up to 6 against the tile while it sits in L1/L2, so verifying k+1 tokens costs about
 * what one costs until the VNNI units, not memory, are the limit.
 *
 * Tile layout (bytes, per group g of the tile, groups in order):
 *   int4: 4 blocks of 64 B (8 inputs x 16 outputs each: byte 4n+i = q[n][8b+i] | q[n][8b+4+i] << 4),
 *         then step[16], zero[16] as bf16;
 *   int8: 8 blocks of 64 B (4 inputs x 16 outputs each: byte 4n+i = q[n][4b+i]), then step[16] bf16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "avx512_common.h"
#include "kernel_abi.h"

#define GROUP SPECDEC_GROUP
#define TILE SPECDEC_TILE
#define MAX_ROWS 6
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif

/* acc += w (16 x 4 unsigned bytes) . the 4 signed bytes at `a`, broadcast to every lane. Written in
 * asm so the broadcast stays a memory operand: with the intrinsic, gcc hoists the broadcasts into
 * vectors spilled to the stack. */
#define DPBUSD_BCST(acc, w, a) \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)(a)))

static inline float load_x(const void *x, int x_bf16, int64_t i) {
    if (x_bf16) {
        uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
        float f;
        __builtin_memcpy(&f, &u, 4);
        return f;
    }
    return ((const float *)x)[i];
}

static inline __m512 load16(const void *x, int x_bf16, int64_t i) {
    return x_bf16 ? bf16x16_to_fp32((const uint16_t *)x + i) : _mm512_loadu_ps((const float *)x + i);
}

/* The 32 fp32 inputs of group g of row r: x itself, RMSNorm(x) (norm_w), or with `glu` (x is
 * [M, 2K], gate | up) silu(gate) * up, computed in fp32. */
static inline void load_group(const void *x, int x_bf16, int64_t r, int64_t g, int64_t k, int glu,
                              const float *inv_rms, const void *norm_w, int norm_w_bf16, float *v) {
    for (int i = 0; i < GROUP; i += 16) {
        const int64_t col = g * GROUP + i;
        __m512 a;
        if (glu) {
            const __m512 gate = load16(x, x_bf16, r * 2 * k + col), up = load16(x, x_bf16, r * 2 * k + k + col);
            const __m512 sig = _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate)));
            a = _mm512_div_ps(_mm512_mul_ps(gate, up), sig);
        } else {
            a = load16(x, x_bf16, r * k + col);
            if (norm_w) /* RMSNorm fused in: x * rsqrt(mean(x^2) + eps) * w, in fp32 */
                a = _mm512_mul_ps(_mm512_mul_ps(a, _mm512_set1_ps(inv_rms[r])), load16(norm_w, norm_w_bf16, col));
        }
        _mm512_storeu_ps(v + i, a);
    }
}

/* x -> xq [M, K] int8 and, per row and group of 32, the constants the tiles need:
 * gc[.][0] = xs (the group's scale), gc[.][1] = xs * sum(xq), gc[.][2] = 8 * gc[.][1] (int4 offset),
 * gc[.][3] = 128 * gc[.][1] (int8 offset). */
static void quantize_rows(const void *x, int x_bf16, int64_t m, int64_t k, int glu, const float *inv_rms,
                          const void *norm_w, int norm_w_bf16, int8_t *xq, float (*gc)[4], int threads) {
    const int64_t groups = k / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k > (1 << 16))
    for (int64_t idx = 0; idx < m * groups; idx++) {
        const int64_t base = idx * GROUP;  /* xq rows are contiguous: group idx starts here */
        float v[GROUP], amax = 0.0f;
        load_group(x, x_bf16, idx / groups, idx % groups, k, glu, inv_rms, norm_w, norm_w_bf16, v);
        for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < GROUP; i++) {
            int32_t q = (int32_t)nearbyintf(v[i] * inv);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            xq[base + i] = (int8_t)q;
            sum += q;
        }
        const float c = scale * (float)sum;
        gc[idx][0] = scale, gc[idx][1] = c, gc[idx][2] = 8.0f * c, gc[idx][3] = 128.0f * c;
    }
}

/* One tile (16 outputs) against `R` rows; acc[r] receives the 16 fp32 results of row r.
 * Two int32 accumulators per row (even and odd halves of each group) halve the dependency chains
 * of `vpdpbusd`, whose latency otherwise bounds the loop. Per group and row:
 *   acc += step * (cvt(isum) * xs - off * xs * sum(xq)) + zero * xs * sum(xq). */
static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *tile, int bits, int64_t groups, const int8_t *xq, const float (*gc)[4],
    int64_t k, const int R, __m512 *acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *p = tile;
    for (int64_t g = 0; g < groups; g++) {
        __m512i even[MAX_ROWS], odd[MAX_ROWS];
        for (int r = 0; r < R; r++) even[r] = odd[r] = _mm512_setzero_si512();
        const int8_t *xg = xq + g * GROUP;
        if (bits == 4) {
            for (int b = 0; b < 4; b++, p += 64) {
                _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
                __m512i w = _mm512_loadu_si512((const void *)p);
                __m512i lo = _mm512_and_si512(w, nibble);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
                for (int r = 0; r < R; r++) {
                    const int8_t *a = xg + r * k + 8 * b;
                    DPBUSD_BCST(even[r], lo, a);
                    DPBUSD_BCST(odd[r], hi, a + 4);
                }
            }
        } else {
            for (int b = 0; b < 8; b += 2, p += 128) {
                _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
                _mm_prefetch((const char *)p + PREFETCH_BYTES + 64, _MM_HINT_T0);
                __m512i w0 = _mm512_loadu_si512((const void *)p);
                __m512i w1 = _mm512_loadu_si512((const void *)(p + 64));
                for (int r = 0; r < R; r++) {
                    const int8_t *a = xg + r * k + 4 * b;
                    DPBUSD_BCST(even[r], w0, a);
                    DPBUSD_BCST(odd[r], w1, a + 4);
                }
            }
        }
        const __m512 step = bf16x16_to_fp32(p);
        p += 32;
        if (bits == 4) {
            const __m512 zero = bf16x16_to_fp32(p);
            p += 32;
            for (int r = 0; r < R; r++) {
                const float *c = gc[r * groups + g];
                __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(even[r], odd[r]));
                t = _mm512_fmsub_ps(t, _mm512_set1_ps(c[0]), _mm512_set1_ps(c[2]));
                acc[r] = _mm512_fmadd_ps(step, t, acc[r]);
                acc[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(c[1]), acc[r]);
            }
        } else {
            for (int r = 0; r < R; r++) {
                const float *c = gc[r * groups + g];
                __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(even[r], odd[r]));
                t = _mm512_fmsub_ps(t, _mm512_set1_ps(c[0]), _mm512_set1_ps(c[3]));
                acc[r] = _mm512_fmadd_ps(step, t, acc[r]);
            }
        }
    }
}

/* y = acc + bias (+ residual: rounded to y's dtype first, then added in fp32 and rounded again,
 * which is bitwise `residual + linear(x)` in torch). */
static inline void store_rows(const __m512 *acc, int R, const float *bias, const void *res, void *y,
                              int y_bf16, int64_t n, int64_t row0, int64_t col0) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + col0) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        __m512 v = _mm512_add_ps(acc[r], b);
        const int64_t at = (row0 + r) * n + col0;
        if (y_bf16) {
            __m256i h = fp32x16_to_bf16(v);
            if (res)
                h = fp32x16_to_bf16(_mm512_add_ps(bf16x16_to_fp32(&h), bf16x16_to_fp32((const uint16_t *)res + at)));
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), h);
        } else {
            if (res) v = _mm512_add_ps(v, _mm512_loadu_ps((const float *)res + at));
            _mm512_storeu_ps((float *)y + at, v);
        }
    }
}

#define TILE_ROWS(R)                                                                              \
    do {                                                                                          \
        __m512 acc[MAX_ROWS];                                                                     \
        tile_rows(tile, bits, groups, xq + row * k, gc + row * groups, k, R, acc);                \
        store_rows(acc, R, bias, residual, y, y_bf16, n, row, t * TILE);                                    \
    } while (0)

/* y[M, N] = residual + a @ w^T + bias, where a[M, K] is x, rmsnorm(x) with `norm_w` [K], or with
 * `glu` silu(x[:, :K]) * x[:, K:] of x [M, 2K]. `tiles` is the weight blob, `tile_offsets[N/16]`
 * the byte offset of each tile in it and `tile_bits[N/16]` its format (4 or 8). x, y, residual
 * [M, N] (NULL: none; may be y) and norm_w are fp32 or bf16 (flags; residual as y), bias fp32
 * or NULL. Returns SPECDEC_OK, SPECDEC_ERR_INVALID_ARGUMENT (sizes off the tile grid, a missing
 * buffer, a tile neither int4 nor int8, norm and glu together) or SPECDEC_ERR_NO_MEMORY. */
int qgemm(const void *x, int x_bf16, int64_t m, int64_t k, int glu, const uint8_t *tiles,
          const int64_t *tile_offsets, const uint8_t *tile_bits, int64_t n, const float *bias,
          const void *residual, void *y, int y_bf16, const void *norm_w, int norm_w_bf16, float eps,
          int threads) {
    if (!x || !tiles || !tile_offsets || !tile_bits || !y || m < 0 || k <= 0 || k % GROUP || n <= 0 ||
        n % TILE || (glu && norm_w))
        return SPECDEC_ERR_INVALID_ARGUMENT;
    for (int64_t t = 0; t < n / TILE; t++)
        if (tile_bits[t] != 4 && tile_bits[t] != 8) return SPECDEC_ERR_INVALID_ARGUMENT;
    const int64_t groups = k / GROUP;
    int8_t *xq = (int8_t *)malloc((size_t)(m * k));
    float(*gc)[4] = (float(*)[4])malloc(sizeof(float[4]) * (size_t)(m * groups));
    float *inv_rms = (float *)malloc(sizeof(float) * (size_t)(m > 0 ? m : 1));
    if (!xq || !gc || !inv_rms) {
        free(xq), free(gc), free(inv_rms);
        return SPECDEC_ERR_NO_MEMORY;
    }
    if (norm_w) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k > (1 << 16))
        for (int64_t r = 0; r < m; r++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < k; i++) {
                const float v = load_x(x, x_bf16, r * k + i);
                sum += v * v;
            }
            inv_rms[r] = 1.0f / sqrtf(sum / (float)k + eps);
        }
    }
    quantize_rows(x, x_bf16, m, k, glu, inv_rms, norm_w, norm_w_bf16, xq, gc, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < n / TILE; t++) {
        const uint8_t *tile = tiles + tile_offsets[t];
        const int bits = tile_bits[t];
        int64_t row = 0;
        for (; row + 6 <= m; row += 6) TILE_ROWS(6);
        switch (m - row) {
            case 5: TILE_ROWS(5); break;
            case 4: TILE_ROWS(4); break;
            case 3: TILE_ROWS(3); break;
            case 2: TILE_ROWS(2); break;
            case 1: TILE_ROWS(1); break;
            default: break;
        }
    }
    free(xq), free(gc), free(inv_rms);
    return SPECDEC_OK;
}
