/* GGUF's F16 and BF16 tensors in qgemm, read as stored: a tile is the tensor's 16-bit values for
 * 16 output channels, input by input ([K][16], `kquant._pack_float`), so one load brings an
 * input's 16 weights. The activations stay fp32 (RMSNorm / SiLU-GLU applied, not quantized):
 * y[r, c] = sum_i x[r, i] * w[c, i] in fp32 FMAs, the even and the odd inputs in two chains
 * summed at the end (two chains keep one row's FMAs from waiting on each other). Each output lane
 * runs the same lane-wise operations in the same order at every level and for any number of rows,
 * so results are bitwise equal across levels and batch sizes. Included by qgemm.c. */
#ifndef SPECDEC_FLOAT_TILES_H
#define SPECDEC_FLOAT_TILES_H

#define FLOAT_PASS 4 /* rows multiplied against a tile in one pass */

static inline int is_float_kind(int bits) { return bits == SPECDEC_TILE_F16 || bits == SPECDEC_TILE_BF16; }

static inline __attribute__((always_inline)) vf float_weights(const uint8_t *tile, int bf16, int64_t i) {
    const uint16_t *p = (const uint16_t *)tile + i * TILE;
    return bf16 ? vf_load_bf16(p) : vf_load_f16(p);
}

/* acc[r] = the 16 outputs of rows 0..R-1 of xf [R, K] against the tile. */
static inline __attribute__((always_inline)) void float_rows(const uint8_t *tile, int bf16, const float *xf,
                                                              int64_t k, int R, vf *acc) {
    vf even[FLOAT_PASS], odd[FLOAT_PASS];
    for (int r = 0; r < R; r++) even[r] = vf_zero(), odd[r] = vf_zero();
    for (int64_t i = 0; i < k; i += 2) {
        const vf w0 = float_weights(tile, bf16, i), w1 = float_weights(tile, bf16, i + 1);
        for (int r = 0; r < R; r++) {
            even[r] = vf_fmadd(vf_set1(xf[r * k + i]), w0, even[r]);
            odd[r] = vf_fmadd(vf_set1(xf[r * k + i + 1]), w1, odd[r]);
        }
    }
    for (int r = 0; r < R; r++) acc[r] = vf_add(even[r], odd[r]);
}

#define FLOAT_ROWS(R)                                                                                  \
    do {                                                                                               \
        vf acc[FLOAT_PASS];                                                                            \
        float_rows(tile, bf16, xf + row * k, k, R, acc);                                               \
        store_rows(acc, R, bias, residual, y, y_bf16, n, row, t * TILE);                               \
    } while (0)

/* Tile t of a float kind against every row of xf [M, K]. */
static __attribute__((noinline)) void float_tile(const uint8_t *tile, int bf16, const float *xf, int64_t k,
                                                 int64_t m, const float *bias, const void *residual, void *y,
                                                 int y_bf16, int64_t n, int64_t t) {
    int64_t row = 0;
    for (; row + FLOAT_PASS <= m; row += FLOAT_PASS) FLOAT_ROWS(FLOAT_PASS);
    switch (m - row) {
        case 3: FLOAT_ROWS(3); break;
        case 2: FLOAT_ROWS(2); break;
        case 1: FLOAT_ROWS(1); break;
        default: break;
    }
}

#endif
