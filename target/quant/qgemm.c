/* Group-quantized GEMM for decoding on the CPU: y[M, N] = x[M, K] @ w[N, K]^T (+ bias).
 *
 * Weights are quantized per group of 32 inputs, 16 output channels to a tile; each tile is
 * either int4 (w = (q - 8) * step + zero, q in 0..15: GGUF Q4_K weights fit this exactly) or
 * int8 (w = (q - 128) * step, q in 1..255). Activations are quantized per row and per group of 32
 * (x ~ xq * xs, xq in -127..127), so an outlier channel only coarsens its own group (as
 * llama.cpp's Q8 activation blocks do; per-row int8 needs SmoothQuant instead).
 *
 * The inner product of a group is exact in int32 (`qgemm_tiles.h`, per instruction-set level:
 * AVX-512 VNNI or AVX-VNNI `vpdpbusd`, unsigned weight bytes times signed activation bytes, or
 * AVX2 `vpmaddubsw` + `vpmaddwd`); the weight offset is removed with the group's activation sum:
 *   sum_k w_k x_k ~ xs_g * (step_n * (isum - off * xsum_g) + zero_n * xsum_g).
 * Every row runs the same instructions in the same order whatever the other rows are, and an
 * output channel is computed by one thread, so results are bitwise independent of the batch
 * (speculative verification of k+1 rows equals k+1 single-row forwards). The integer sums are
 * exact and the float work (`simd.h`) is the same lane by lane at every level, so the AVX2 and
 * AVX-VNNI builds return bitwise what the AVX-512 build returns.
 *
 * Each weight tile is read once per call however many rows there are: rows are processed in
 * chunks of up to MAX_ROWS against the tile while it sits in L1/L2, so verifying k+1 tokens costs about
 * what one costs until the VNNI units, not memory, are the limit. Later passes over a tile prefetch
 * the next one, and at AVX2 / AVX-VNNI a call of many rows unpacks each int4 tile once.
 *
 * Tile layout (bytes, per group g of the tile, groups in order):
 *   int4: 4 blocks of 64 B (8 inputs x 16 outputs each: byte 4n+i = q[n][8b+i] | q[n][8b+4+i] << 4),
 *         then step[16], zero[16] as bf16;
 *   int8: 8 blocks of 64 B (4 inputs x 16 outputs each: byte 4n+i = q[n][4b+i]), then step[16] bf16;
 *   GGUF's Q8_0: int8's with step[16] fp16 (the file's d); Q5_0, Q4_0, Q4_1, IQ4_NL, MXFP4, Q4_K, Q5_K, Q6_K:
 *   block32_tiles.h and
 *   kquant_tiles.h; F16 and BF16 (fp32 activations, not quantized): float_tiles.h.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernel_abi.h"
#include "simd.h"

#define GROUP SPECDEC_GROUP
#define TILE SPECDEC_TILE
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif

/* One group's activation constants (see quantize_rows). */
struct group_consts {
    float scale, sum, int4_offset, int8_offset; /* xs, xs * sum(xq), 8 * that, 128 * that */
    int32_t isum;                               /* sum(xq) */
};

#include "qgemm_tiles.h" /* tile_rows and MAX_ROWS for this build's instruction set */
#include "kquant_tiles.h" /* q4k_rows, q6k_rows: GGUF's Q4_K, Q5_K and Q6_K tiles, one source for every level */
#include "block32_tiles.h" /* b32_rows: GGUF's Q5_0, Q4_0, Q4_1, IQ4_NL and MXFP4 tiles, one source for every level */

/* The 32 fp32 inputs of group g of row r: x itself, RMSNorm(x) (norm_w), or with `glu` (x is
 * [M, 2K], gate | up) silu(gate) * up, computed in fp32. */
static inline void load_group(const void *x, int x_bf16, int64_t r, int64_t g, int64_t k, int glu,
                              const float *inv_rms, const void *norm_w, int norm_w_bf16, float *v) {
    for (int i = 0; i < GROUP; i += 16) {
        const int64_t col = g * GROUP + i;
        vf a;
        if (glu) {
            const vf gate = load_floats(x, x_bf16, r * 2 * k + col), up = load_floats(x, x_bf16, r * 2 * k + k + col);
            const vf sig = vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), gate)));
            a = vf_div(vf_mul(gate, up), sig);
        } else {
            a = load_floats(x, x_bf16, r * k + col);
            if (norm_w) /* RMSNorm fused in: x * rsqrt(mean(x^2) + eps) * w, in fp32 */
                a = vf_mul(vf_mul(a, vf_set1(inv_rms[r])), load_floats(norm_w, norm_w_bf16, col));
        }
        vf_store(v + i, a);
    }
}

/* max |v[i]| of n floats (n % 16 == 0), in vectors: exact in any order (fmaxf was a libm call
 * per element, ~3% of a 512-token prefill's profile) */
static inline float abs_max(const float *v, int n) {
    vf m = vf_zero();
    for (int i = 0; i < n; i += 16) {
        const vf a = vf_load(v + i);
        m = vf_max(m, vf_max(a, vf_sub(vf_zero(), a)));
    }
    return vf_reduce_max(m);
}

/* x -> xq [M, K] int8 and, per row and group of 32, the constants the tiles need (gc). */
static void quantize_rows(const void *x, int x_bf16, int64_t m, int64_t k, int glu, const float *inv_rms,
                          const void *norm_w, int norm_w_bf16, int8_t *xq, struct group_consts *gc, int threads) {
    const int64_t groups = k / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k > (1 << 16))
    for (int64_t idx = 0; idx < m * groups; idx++) {
        const int64_t base = idx * GROUP;  /* xq rows are contiguous: group idx starts here */
        float v[GROUP];
        load_group(x, x_bf16, idx / groups, idx % groups, k, glu, inv_rms, norm_w, norm_w_bf16, v);
        const float amax = abs_max(v, GROUP);
        const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < GROUP; i++) {
            int32_t q = (int32_t)nearbyintf(v[i] * inv);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            xq[base + i] = (int8_t)q;
            sum += q;
        }
        const float c = scale * (float)sum;
        gc[idx] = (struct group_consts){scale, c, 8.0f * c, 128.0f * c, sum};
    }
}

/* x -> xq [M, K] int8 per row and super-block of 256 (one scale each, as llama.cpp's Q8_K) and
 * its sums per 16 and 32 inputs (sc): the activations of k-quant tiles. */
static void quantize_rows_super(const void *x, int x_bf16, int64_t m, int64_t k, int glu, const float *inv_rms,
                                const void *norm_w, int norm_w_bf16, int8_t *xq, struct super_consts *sc,
                                int threads) {
    const int64_t supers = k / SUPER, per = SUPER / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k > (1 << 16))
    for (int64_t idx = 0; idx < m * supers; idx++) {
        const int64_t r = idx / supers, s = idx % supers;
        float v[SUPER];
        for (int g = 0; g < per; g++)
            load_group(x, x_bf16, r, s * per + g, k, glu, inv_rms, norm_w, norm_w_bf16, v + g * GROUP);
        const float amax = abs_max(v, SUPER);
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        struct super_consts *c = &sc[idx];
        c->scale = amax / 127.0f;
        int8_t *q = xq + idx * SUPER;
        for (int i = 0; i < SUPER; i++) {
            int32_t t = (int32_t)nearbyintf(v[i] * inv);
            q[i] = (int8_t)(t > 127 ? 127 : t < -127 ? -127 : t);
        }
        for (int j = 0; j < 16; j++) {
            int32_t sum = 0;
            for (int i = 0; i < 16; i++) sum += q[16 * j + i];
            c->sum16[j] = (int16_t)sum;
        }
        for (int j = 0; j < 8; j++) c->sum32[j] = (int16_t)(c->sum16[2 * j] + c->sum16[2 * j + 1]);
    }
}

/* y = acc + bias (+ residual: rounded to y's dtype first, then added in fp32 and rounded again,
 * which is bitwise `residual + linear(x)` in torch). */
static inline void store_rows(const vf *acc, int R, const float *bias, const void *res, void *y,
                              int y_bf16, int64_t n, int64_t row0, int64_t col0) {
    const vf b = bias ? vf_load(bias + col0) : vf_zero();
    for (int r = 0; r < R; r++) {
        vf v = vf_add(acc[r], b);
        const int64_t at = (row0 + r) * n + col0;
        if (y_bf16) {
            if (res) v = vf_add(vf_round_bf16(v), vf_load_bf16((const uint16_t *)res + at));
            vf_store_bf16((uint16_t *)y + at, v);
        } else {
            if (res) v = vf_add(v, vf_load((const float *)res + at));
            vf_store((float *)y + at, v);
        }
    }
}

#include "float_tiles.h" /* float_tile: GGUF's F16 and BF16 tiles, fp32 activations */

#define TILE_ROWS(R)                                                                  \
    do {                                                                              \
        vf acc[MAX_ROWS];                                                             \
        tile_rows(tile, row == 0, next_ahead, bits, groups, xq + row * k, gc + row * groups, k, R, acc); \
        store_rows(acc, R, bias, residual, y, y_bf16, n, row, t * TILE);              \
    } while (0)

#ifdef KQUANT_WIDE /* R <= MAX_ROWS rows against a k-quant tile, 512 bits (kquant_tiles.h) */
#define KQUANT_WIDE_ROWS(R)                                                                              \
    do {                                                                                                 \
        vf acc[MAX_ROWS];                                                                                \
        const int64_t ahead = row == 0 ? PREFETCH_BYTES : next_ahead;                                    \
        if (bits == SPECDEC_TILE_Q4_K) q4k_rows_wide(tile, ahead, supers, 0, xqs + row * k, sc + row * supers, k, R, acc); \
        else if (bits == SPECDEC_TILE_Q5_K) q4k_rows_wide(tile, ahead, supers, 1, xqs + row * k, sc + row * supers, k, R, acc); \
        else if (bits == SPECDEC_TILE_IQ4_XS) iq4xs_rows_wide(tile, ahead, supers, xqs + row * k, sc + row * supers, k, R, acc); \
        else if (bits == SPECDEC_TILE_Q3_K) k2_rows_wide(tile, ahead, supers, 1, xqs + row * k, sc + row * supers, k, R, acc); \
        else if (bits == SPECDEC_TILE_Q2_K) k2_rows_wide(tile, ahead, supers, 0, xqs + row * k, sc + row * supers, k, R, acc); \
        else q6k_rows_wide(tile, ahead, supers, xqs + row * k, sc + row * supers, k, R, acc);            \
        store_rows(acc, R, bias, residual, y, y_bf16, n, row, t * TILE);                                 \
    } while (0)
#endif

/* R <= KQUANT_PASS rows against a k-quant tile (kquant_tiles.h); UNPACKED: KQUANT_UNPACKED_PASS rows
 * against its decoding `ku` */
#define KQUANT_ROWS(R, UNPACKED)                                                                         \
    do {                                                                                                 \
        __m256 lo[KQUANT_PASS], hi[KQUANT_PASS];                                                         \
        const int64_t ahead = row == 0 ? PREFETCH_BYTES : next_ahead;                                    \
        if (UNPACKED) kquant_rows_unpacked(bits, ku, supers, xqs + row * k, sc + row * supers, k, lo, hi); \
        else if (bits == SPECDEC_TILE_Q4_K) q4k_rows(tile, ahead, supers, 0, xqs + row * k, sc + row * supers, k, R, lo, hi); \
        else if (bits == SPECDEC_TILE_Q5_K) q4k_rows(tile, ahead, supers, 1, xqs + row * k, sc + row * supers, k, R, lo, hi); \
        else if (bits == SPECDEC_TILE_IQ4_XS) iq4xs_rows(tile, ahead, supers, xqs + row * k, sc + row * supers, k, R, lo, hi); \
        else if (bits == SPECDEC_TILE_Q3_K) k2_rows(tile, ahead, supers, 1, xqs + row * k, sc + row * supers, k, R, lo, hi); \
        else if (bits == SPECDEC_TILE_Q2_K) k2_rows(tile, ahead, supers, 0, xqs + row * k, sc + row * supers, k, R, lo, hi); \
        else q6k_rows(tile, ahead, supers, xqs + row * k, sc + row * supers, k, R, lo, hi);              \
        vf acc[KQUANT_PASS];                                                                             \
        for (int r = 0; r < R; r++) acc[r] = vf_halves(lo[r], hi[r]);                                    \
        store_rows(acc, R, bias, residual, y, y_bf16, n, row, t * TILE);                                 \
    } while (0)

/* R rows against a block32 tile of KIND decoded into b32u */
#define B32_UNPACKED_ROWS_OF(KIND, R)                                                                    \
    do {                                                                                                 \
        __m256 lo[B32_UNPACKED_PASS], hi[B32_UNPACKED_PASS];                                             \
        b32_rows_unpacked(b32u, groups, KIND, xq + row * k, gc + row * groups, k, R, lo, hi);            \
        vf acc[B32_UNPACKED_PASS];                                                                       \
        for (int r = 0; r < R; r++) acc[r] = vf_halves(lo[r], hi[r]);                                    \
        store_rows(acc, R, bias, residual, y, y_bf16, n, row, t * TILE);                                 \
    } while (0)

static inline int is_kquant(int bits) {
    return bits == SPECDEC_TILE_Q4_K || bits == SPECDEC_TILE_Q5_K || bits == SPECDEC_TILE_Q6_K || bits == SPECDEC_TILE_IQ4_XS ||
           bits == SPECDEC_TILE_Q3_K || bits == SPECDEC_TILE_Q2_K;
}
static inline int is_grouped(int bits) { /* activations per 32 inputs */
    return bits == 4 || bits == 8 || is_block32(bits) || bits == SPECDEC_TILE_Q8_0;
}

#if defined(KQUANT_WIDE) || defined(B32_WIDE)
/* The rows from `row` on against this tile: passes of MAX_ROWS (6 at AVX-512), then the rest, each
 * count its own unrolled instance of ROWS(R) */
#define WIDE_PASSES(ROWS)                                                                                \
    do {                                                                                                 \
        for (; row + MAX_ROWS <= m; row += MAX_ROWS) ROWS(MAX_ROWS);                                     \
        switch (m - row) {                                                                               \
            case 5: ROWS(5); break;                                                                      \
            case 4: ROWS(4); break;                                                                      \
            case 3: ROWS(3); break;                                                                      \
            case 2: ROWS(2); break;                                                                      \
            case 1: ROWS(1); break;                                                                      \
            default: break;                                                                              \
        }                                                                                                \
    } while (0)
#endif

#ifdef B32_WIDE /* R <= MAX_ROWS rows against a block32 tile of KIND, packed or decoded into b32u (block32_tiles.h) */
#define B32_WIDE_ROWS_OF(KIND, R)                                                                        \
    do {                                                                                                 \
        vf acc[MAX_ROWS];                                                                                \
        if (b32u) b32_rows_wide(b32u, 0, 1, groups, KIND, xq + row * k, gc + row * groups, k, R, acc);   \
        else b32_rows_wide(tile, row == 0 ? PREFETCH_BYTES : next_ahead, 0, groups, KIND, xq + row * k,  \
                           gc + row * groups, k, R, acc);                                                \
        store_rows(acc, R, bias, residual, y, y_bf16, n, row, t * TILE);                                 \
    } while (0)
#define B32_WIDE_Q5_0(R) B32_WIDE_ROWS_OF(SPECDEC_TILE_Q5_0, R)
#define B32_WIDE_Q4_0(R) B32_WIDE_ROWS_OF(SPECDEC_TILE_Q4_0, R)
#define B32_WIDE_Q4_1(R) B32_WIDE_ROWS_OF(SPECDEC_TILE_Q4_1, R)
#define B32_WIDE_IQ4_NL(R) B32_WIDE_ROWS_OF(SPECDEC_TILE_IQ4_NL, R)
#define B32_WIDE_MXFP4(R) B32_WIDE_ROWS_OF(SPECDEC_TILE_MXFP4, R)
#endif

/* R <= B32_PASS rows against a block32 tile of KIND (block32_tiles.h) */
#define B32_ROWS(KIND, R)                                                                                \
    do {                                                                                                 \
        __m256 lo[B32_PASS], hi[B32_PASS];                                                               \
        b32_rows(tile, row == 0 ? PREFETCH_BYTES : next_ahead, groups, KIND, xq + row * k, gc + row * groups, k, R, lo, hi); \
        vf acc[B32_PASS];                                                                                \
        for (int r = 0; r < R; r++) acc[r] = vf_halves(lo[r], hi[r]);                                    \
        store_rows(acc, R, bias, residual, y, y_bf16, n, row, t * TILE);                                 \
    } while (0)

/* Every row against a block32 tile of KIND (a constant: one instance of the loops per kind). At
 * AVX-512 VNNI 512-bit passes (WIDE: B32_WIDE_Q5_0 and the others); else decoded once for more
 * than two passes' rows, then register passes of B32_PASS. */
#ifdef B32_WIDE
#define B32_TILE(KIND, WIDE)                                                                             \
    do {                                                                                                 \
        if (b32u) b32_unpack_tile(tile, groups, KIND, b32u); /* NULL (few rows, or no memory): decoded per pass */ \
        WIDE_PASSES(WIDE);                                                                               \
    } while (0)
#else
#define B32_TILE(KIND, WIDE)                                                                             \
    do {                                                                                                 \
        if (b32u) b32_unpack_tile(tile, groups, KIND, b32u); /* NULL (few rows, or no memory): decoded per pass */ \
        for (; b32u && row + B32_UNPACKED_PASS <= m; row += B32_UNPACKED_PASS) B32_UNPACKED_ROWS_OF(KIND, B32_UNPACKED_PASS); \
        if (b32u && m - row == 2) {                                                                      \
            B32_UNPACKED_ROWS_OF(KIND, 2);                                                               \
            row += 2;                                                                                    \
        } else if (b32u && m - row == 1) {                                                               \
            B32_UNPACKED_ROWS_OF(KIND, 1);                                                               \
            row += 1;                                                                                    \
        }                                                                                                \
        for (; row + B32_PASS <= m; row += B32_PASS) B32_ROWS(KIND, B32_PASS);                           \
        if (m - row == 2) B32_ROWS(KIND, 2);                                                             \
        else if (m - row == 1) B32_ROWS(KIND, 1);                                                        \
    } while (0)
#endif

/* Each block32 kind's loops in a function of its own: five instances inlined into qgemm's loop
 * made the Q5_0 passes 10-15% slower (register allocation over one huge function; kernel_ab.py). */
#define B32_TILE_FN(NAME, KIND, WIDE)                                                                    \
    static __attribute__((noinline)) void NAME(const uint8_t *tile, int64_t next_ahead, int64_t groups, \
                                               const int8_t *xq, const struct group_consts *gc, int64_t k, \
                                               int64_t m, const float *bias, const void *residual, void *y, \
                                               int y_bf16, int64_t n, int64_t t, uint8_t *b32u) {          \
        int64_t row = 0;                                                                                 \
        B32_TILE(KIND, WIDE);                                                                            \
    }
B32_TILE_FN(b32_tile_q5_0, SPECDEC_TILE_Q5_0, B32_WIDE_Q5_0)
B32_TILE_FN(b32_tile_q4_0, SPECDEC_TILE_Q4_0, B32_WIDE_Q4_0)
B32_TILE_FN(b32_tile_q4_1, SPECDEC_TILE_Q4_1, B32_WIDE_Q4_1)
B32_TILE_FN(b32_tile_iq4_nl, SPECDEC_TILE_IQ4_NL, B32_WIDE_IQ4_NL)
B32_TILE_FN(b32_tile_mxfp4, SPECDEC_TILE_MXFP4, B32_WIDE_MXFP4)
#define B32_TILE_ARGS tile, next_ahead, groups, xq, gc, k, m, bias, residual, y, y_bf16, n, t, b32u
/* Each k-quant kind's passes over a tile in a function of its own, `bits` a constant there (as the
 * block32 kinds', B32_TILE_FN): at AVX-512 VNNI passes of up to MAX_ROWS rows in 512 bits; else a
 * tile decoded once for many rows (Q4_K, Q5_K, Q6_K), then register passes. */
#ifdef KQUANT_WIDE
#define KQ_TILE_BODY WIDE_PASSES(KQUANT_WIDE_ROWS)
#else
#define KQ_TILE_BODY                                                                                     \
    do {                                                                                                 \
        /* NULL (few rows, no memory, or IQ4_XS, Q3_K, Q2_K: register passes only): decoded in every pass */ \
        const int decodable = bits == SPECDEC_TILE_Q4_K || bits == SPECDEC_TILE_Q5_K || bits == SPECDEC_TILE_Q6_K; \
        const uint8_t *ku = decodable ? kunpacked : NULL;                                            \
        for (int64_t s = 0; ku && s < supers; s++)                                                   \
            kquant_unpack(bits, tile, s, kunpacked + s * KQUANT_UNPACKED_MAX);                       \
        for (; ku && row + KQUANT_UNPACKED_PASS <= m; row += KQUANT_UNPACKED_PASS) KQUANT_ROWS(KQUANT_UNPACKED_PASS, 1); \
        /* passes of 4, but 5 and 6 rows as 3 + 2 and 3 + 3 (4 + 1 and 4 + 2: 0.95-0.99x) */         \
        for (; row + KQUANT_PASS <= m && m - row != 5 && m - row != 6; row += KQUANT_PASS) KQUANT_ROWS(KQUANT_PASS, 0); \
        if (m - row >= 5) {                                                                          \
            KQUANT_ROWS(3, 0);                                                                       \
            row += 3;                                                                                \
        }                                                                                            \
        switch (m - row) { /* the rest, each count its own unrolled instance */                      \
            case 3: KQUANT_ROWS(3, 0); break;                                                        \
            case 2: KQUANT_ROWS(2, 0); break;                                                        \
            case 1: KQUANT_ROWS(1, 0); break;                                                        \
            default: break;                                                                          \
        }                                                                                            \
    } while (0)
#endif
#define KQ_TILE_FN(NAME, KIND)                                                                           \
    static __attribute__((noinline)) void NAME(const uint8_t *tile, int64_t next_ahead, int64_t supers, \
                                               const int8_t *xqs, const struct super_consts *sc, int64_t k, \
                                               int64_t m, const float *bias, const void *residual, void *y, \
                                               int y_bf16, int64_t n, int64_t t, uint8_t *kunpacked) {    \
        const int bits = KIND;                                                                           \
        int64_t row = 0;                                                                                 \
        (void)kunpacked;                                                                                 \
        KQ_TILE_BODY;                                                                                    \
    }
KQ_TILE_FN(kq_tile_q4_k, SPECDEC_TILE_Q4_K)
KQ_TILE_FN(kq_tile_q5_k, SPECDEC_TILE_Q5_K)
KQ_TILE_FN(kq_tile_q6_k, SPECDEC_TILE_Q6_K)
KQ_TILE_FN(kq_tile_iq4_xs, SPECDEC_TILE_IQ4_XS)
KQ_TILE_FN(kq_tile_q3_k, SPECDEC_TILE_Q3_K)
KQ_TILE_FN(kq_tile_q2_k, SPECDEC_TILE_Q2_K)
#define KQ_TILE_ARGS tile, next_ahead, supers, xqs, sc, k, m, bias, residual, y, y_bf16, n, t, kunpacked

#ifdef UNPACKED_GROUP /* R <= UNPACKED_PASS rows against the unpacked tile */
#define UNPACKED_ROWS(R)                                                                              \
    do {                                                                                              \
        vf acc[UNPACKED_PASS];                                                                        \
        unpacked_rows(unpacked, tile + next_ahead, groups, xq + row * k, gc + row * groups, k, R, acc); \
        store_rows(acc, R, bias, residual, y, y_bf16, n, row, t * TILE);                              \
    } while (0)
#endif

/* y[M, N] = residual + a @ w^T + bias, where a[M, K] is x, rmsnorm(x) with `norm_w` [K], or with
 * `glu` silu(x[:, :K]) * x[:, K:] of x [M, 2K]. `tiles` is the weight blob, `tile_offsets[N/16]`
 * the byte offset of each tile in it and `tile_bits[N/16]` its format (4, 8, a GGUF tile
 * SPECDEC_TILE_Q5_0, _Q4_0, _Q4_1, _IQ4_NL, _MXFP4 or _Q8_0, a k-quant tile SPECDEC_TILE_Q4_K, _Q5_K, _Q6_K, _IQ4_XS, _Q3_K or _Q2_K, whose calls need
 * K % 256 == 0, or a float tile SPECDEC_TILE_F16 or _BF16). x, y, residual
 * [M, N] (NULL: none; may be y) and norm_w are fp32 or bf16 (flags; residual as y), bias fp32
 * or NULL. Returns SPECDEC_OK, SPECDEC_ERR_INVALID_ARGUMENT (sizes off the tile grid, a missing
 * buffer, a tile of no format, norm and glu together) or SPECDEC_ERR_NO_MEMORY. */
int qgemm(const void *x, int x_bf16, int64_t m, int64_t k, int glu, const uint8_t *tiles,
          const int64_t *tile_offsets, const uint8_t *tile_bits, int64_t n, const float *bias,
          const void *residual, void *y, int y_bf16, const void *norm_w, int norm_w_bf16, float eps,
          int threads) {
    if (!x || !tiles || !tile_offsets || !tile_bits || !y || m < 0 || k <= 0 || k % GROUP || n <= 0 ||
        n % TILE || (glu && norm_w))
        return SPECDEC_ERR_INVALID_ARGUMENT;
    int grouped = 0, kquant = 0, b32 = 0, floats = 0; /* which activations the tiles need; any block32 tile */
    for (int64_t t = 0; t < n / TILE; t++) {
        b32 |= is_block32(tile_bits[t]);
        if (is_float_kind(tile_bits[t])) floats = 1;
        else if (is_grouped(tile_bits[t])) grouped = 1;
        else if (is_kquant(tile_bits[t])) kquant = 1;
        else return SPECDEC_ERR_INVALID_ARGUMENT;
    }
    if (kquant && k % SUPER) return SPECDEC_ERR_INVALID_ARGUMENT;
    const int64_t groups = k / GROUP, supers = k / SUPER;
    int8_t *xq = grouped ? (int8_t *)malloc((size_t)(m * k) + 1) : NULL;
    struct group_consts *gc = grouped ? (struct group_consts *)malloc(sizeof(struct group_consts) * (size_t)(m * groups) + 1) : NULL;
    int8_t *xqs = kquant ? (int8_t *)malloc((size_t)(m * k) + 1) : NULL;
    struct super_consts *sc = kquant ? (struct super_consts *)malloc(sizeof(struct super_consts) * (size_t)(m * supers) + 1) : NULL;
    float *inv_rms = (float *)malloc(sizeof(float) * (size_t)(m > 0 ? m : 1));
    float *xf = floats ? (float *)malloc(sizeof(float) * (size_t)(m * k) + 1) : NULL; /* fp32 activations */
    if ((grouped && (!xq || !gc)) || (kquant && (!xqs || !sc)) || (floats && !xf) || !inv_rms) {
        free(xq), free(gc), free(xqs), free(sc), free(inv_rms), free(xf);
        return SPECDEC_ERR_NO_MEMORY;
    }
    if (norm_w) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k > (1 << 16))
        for (int64_t r = 0; r < m; r++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < k; i++) {
                const float v = load_float(x, x_bf16, r * k + i);
                sum += v * v;
            }
            inv_rms[r] = 1.0f / sqrtf(sum / (float)k + eps);
        }
    }
    if (grouped) quantize_rows(x, x_bf16, m, k, glu, inv_rms, norm_w, norm_w_bf16, xq, gc, threads);
    if (kquant) quantize_rows_super(x, x_bf16, m, k, glu, inv_rms, norm_w, norm_w_bf16, xqs, sc, threads);
    if (floats) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k > (1 << 16))
        for (int64_t idx = 0; idx < m * groups; idx++) /* group idx of xf's contiguous rows */
            load_group(x, x_bf16, idx / groups, idx % groups, k, glu, inv_rms, norm_w, norm_w_bf16, xf + idx * GROUP);
    }
#pragma omp parallel num_threads(threads)
    {
        uint8_t *unpacked = NULL; /* many rows at AVX2 / AVX-VNNI: int4 tiles unpacked once (qgemm_tiles.h) */
#ifdef UNPACKED_GROUP
        if (m >= UNPACKED_MIN_ROWS) /* NULL (no memory): the packed passes */
            unpacked = (uint8_t *)aligned_alloc(64, (size_t)(groups * UNPACKED_GROUP));
#endif
#ifdef KQUANT_WIDE /* 512-bit passes at every row count: 1.4-1.7x the decoded-once path at 8-512 rows */
        uint8_t *kunpacked = NULL;
#else /* k-quant tiles with many rows: each decoded once (kquant_tiles.h) */
        uint8_t *kunpacked = kquant && m >= KQUANT_UNPACKED_ROWS
                                 ? (uint8_t *)aligned_alloc(64, (size_t)(supers * KQUANT_UNPACKED_MAX)) : NULL;
#endif
        uint8_t *b32u = b32 && m >= B32_UNPACKED_ROWS ? (uint8_t *)aligned_alloc(64, (size_t)(groups * B32_UNPACKED_GROUP)) : NULL;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n / TILE; t++) {
            const uint8_t *tile = tiles + tile_offsets[t];
            /* later passes over this tile prefetch the next one (qgemm_tiles.h) */
            const int64_t next_ahead = t + 1 < n / TILE ? tile_offsets[t + 1] - tile_offsets[t] : PREFETCH_BYTES;
            const int bits = tile_bits[t];
            int64_t row = 0;
            if (is_float_kind(bits)) {
                float_tile(tile, bits == SPECDEC_TILE_BF16, xf, k, m, bias, residual, y, y_bf16, n, t);
                continue;
            }
            if (is_kquant(bits)) {
                if (bits == SPECDEC_TILE_Q4_K) kq_tile_q4_k(KQ_TILE_ARGS);
                else if (bits == SPECDEC_TILE_Q5_K) kq_tile_q5_k(KQ_TILE_ARGS);
                else if (bits == SPECDEC_TILE_Q6_K) kq_tile_q6_k(KQ_TILE_ARGS);
                else if (bits == SPECDEC_TILE_IQ4_XS) kq_tile_iq4_xs(KQ_TILE_ARGS);
                else if (bits == SPECDEC_TILE_Q3_K) kq_tile_q3_k(KQ_TILE_ARGS);
                else kq_tile_q2_k(KQ_TILE_ARGS);
                continue;
            }
            if (is_block32(bits)) {
                if (bits == SPECDEC_TILE_Q5_0) b32_tile_q5_0(B32_TILE_ARGS);
                else if (bits == SPECDEC_TILE_Q4_0) b32_tile_q4_0(B32_TILE_ARGS);
                else if (bits == SPECDEC_TILE_Q4_1) b32_tile_q4_1(B32_TILE_ARGS);
                else if (bits == SPECDEC_TILE_IQ4_NL) b32_tile_iq4_nl(B32_TILE_ARGS);
                else b32_tile_mxfp4(B32_TILE_ARGS);
                continue;
            }
#ifdef UNPACKED_GROUP
            if (unpacked && bits == 4) {
                unpack_int4_tile(tile, groups, unpacked);
                for (; row + UNPACKED_PASS <= m; row += UNPACKED_PASS) UNPACKED_ROWS(UNPACKED_PASS);
                switch (m - row) {
                    case 3: UNPACKED_ROWS(3); break;
                    case 2: UNPACKED_ROWS(2); break;
                    case 1: UNPACKED_ROWS(1); break;
                    default: break;
                }
                continue;
            }
#endif
            for (; row + MAX_ROWS <= m; row += MAX_ROWS) TILE_ROWS(MAX_ROWS);
            switch (m - row) { /* the rest, each count its own unrolled instance */
#if MAX_ROWS > 5
                case 5: TILE_ROWS(5); break;
#endif
#if MAX_ROWS > 4
                case 4: TILE_ROWS(4); break;
#endif
                case 3: TILE_ROWS(3); break;
                case 2: TILE_ROWS(2); break;
                case 1: TILE_ROWS(1); break;
                default: break;
            }
        }
        free(unpacked), free(kunpacked), free(b32u);
    }
    free(xq), free(gc), free(xqs), free(sc), free(inv_rms), free(xf);
    return SPECDEC_OK;
}
