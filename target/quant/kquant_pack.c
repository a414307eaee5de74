/* GGUF Q4_K / Q6_K / Q5_0 / Q8_0 rows -> qgemm's tiles of those formats (the layouts of
 * kquant_tiles.h and block32_tiles.h), byte for byte what `kquant.py`'s torch packer makes
 * (tested), ~50x faster: the default target's 0.98 GB of blocks repack in well under a second
 * instead of ~10 s. Plain C: a reshuffle of bytes. */
#include <stdint.h>
#include <string.h>

#include "kernel_abi.h"

#define TILE SPECDEC_TILE
#define SUPER SPECDEC_SUPER
#define GROUP SPECDEC_GROUP

/* ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j from a Q4_K block's 12 bytes */
static void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* the 256 quants (0..15) of a Q4_K block */
static void q4_k_values(const uint8_t *block, uint8_t *q) {
    const uint8_t *qs = block + 16;
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l++) {
            q[64 * g + l] = qs[32 * g + l] & 15;
            q[64 * g + 32 + l] = qs[32 * g + l] >> 4;
        }
}

/* the 256 quants (0..63) of a Q6_K block */
static void q6_k_values(const uint8_t *block, uint8_t *q) {
    const uint8_t *ql = block, *qh = block + 128;
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t a = ql[64 * h + l], b = ql[64 * h + 32 + l], t = qh[32 * h + l];
            uint8_t *v = q + 128 * h + l;
            v[0] = (uint8_t)((a & 15) | ((t & 3) << 4));
            v[32] = (uint8_t)((b & 15) | (((t >> 2) & 3) << 4));
            v[64] = (uint8_t)((a >> 4) | (((t >> 4) & 3) << 4));
            v[96] = (uint8_t)((b >> 4) | (((t >> 6) & 3) << 4));
        }
}

/* one super-block of one tile: the 16 rows' blocks `rows[n]` -> `out` */
static void pack_q4_k_super(const uint8_t *const *rows, uint8_t *out) {
    memset(out + 2176, 0, 64);
    for (int n = 0; n < TILE; n++) {
        uint8_t q[SUPER];
        q4_k_values(rows[n], q);
        for (int b = 0; b < 32; b++)
            for (int i = 0; i < 4; i++) out[64 * b + 4 * n + i] = (uint8_t)(q[8 * b + i] | (q[8 * b + 4 + i] << 4));
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            scale_min_k4(j, rows[n] + 4, &sc, &m);
            out[2048 + 16 * j + n] = (uint8_t)((sc & 15) | ((m & 15) << 4));
            out[2176 + 16 * (j / 2) + n] |= (uint8_t)(((sc >> 4) | ((m >> 4) << 2)) << (4 * (j & 1)));
        }
        memcpy(out + 2240 + 2 * n, rows[n], 2);     /* d */
        memcpy(out + 2272 + 2 * n, rows[n] + 2, 2); /* dmin */
    }
}

static void pack_q6_k_super(const uint8_t *const *rows, uint8_t *out) {
    for (int b = 0; b < 32; b++) memset(out + 96 * b + 64, 0, 32);
    for (int n = 0; n < TILE; n++) {
        uint8_t q[SUPER];
        q6_k_values(rows[n], q);
        const int half = n / 8, np = n % 8;
        for (int b = 0; b < 32; b++) {
            uint8_t *blk = out + 96 * b;
            for (int i = 0; i < 4; i++) {
                const uint8_t lo = q[8 * b + i], hi = q[8 * b + 4 + i];
                blk[4 * n + i] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
                blk[64 + 4 * np + i] |= (uint8_t)(((lo >> 4) << (2 * half)) | ((hi >> 4) << (2 * (2 + half))));
            }
        }
        for (int j = 0; j < 16; j++) out[3072 + 16 * j + n] = rows[n][192 + j];
        memcpy(out + 3328 + 2 * n, rows[n] + 208, 2); /* d */
    }
}

/* one 32-input group of a Q8_0 tile: 8 blocks of 4 inputs x 16 outputs (byte 4n+i: q + 128), d[16] */
static void pack_q8_0_group(const uint8_t *const *rows, uint8_t *out) {
    for (int n = 0; n < TILE; n++) {
        const uint8_t *qs = rows[n] + 2;
        for (int b = 0; b < 8; b++)
            for (int i = 0; i < 4; i++) out[64 * b + 4 * n + i] = (uint8_t)(qs[4 * b + i] ^ 0x80);
        memcpy(out + 512 + 2 * n, rows[n], 2); /* d */
    }
}

/* one 32-input group of a Q5_0 tile: the low nibbles in the int4 layout, their top bits, d[16] */
static void pack_q5_0_group(const uint8_t *const *rows, uint8_t *out) {
    memset(out + 256, 0, 64);
    for (int n = 0; n < TILE; n++) {
        const uint8_t *blk = rows[n], *qs = blk + 6;
        const uint32_t qh = (uint32_t)blk[2] | (uint32_t)blk[3] << 8 | (uint32_t)blk[4] << 16 | (uint32_t)blk[5] << 24;
        uint8_t q[GROUP];
        for (int j = 0; j < 16; j++) {
            q[j] = (uint8_t)((qs[j] & 15) | ((qh >> j) & 1) << 4);
            q[j + 16] = (uint8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
        }
        for (int b = 0; b < 4; b++)
            for (int i = 0; i < 4; i++) {
                const uint8_t lo = q[8 * b + i], hi = q[8 * b + 4 + i];
                out[64 * b + 4 * n + i] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
                out[256 + 4 * n + i] |= (uint8_t)((lo >> 4) << (2 * b) | (hi >> 4) << (2 * b + 1));
            }
        memcpy(out + 320 + 2 * n, blk, 2); /* d */
    }
}

/* raw [n, k / inputs per block * block bytes] (rows `row_stride` bytes apart) of `kind`
 * (SPECDEC_TILE_Q4_K, _Q6_K, _Q5_0 or _Q8_0) -> out [n / 16 tiles of their blocks] in the tile
 * layout of that kind. SPECDEC_ERR_INVALID_ARGUMENT for sizes off the tile grid or another kind. */
int kquant_pack(const uint8_t *raw, int64_t row_stride, int64_t n, int64_t k, int kind, uint8_t *out, int threads) {
    int64_t inputs, block, bytes; /* per block: inputs, bytes in the file, bytes in a tile (16 rows) */
    switch (kind) {
        case SPECDEC_TILE_Q4_K: inputs = SUPER, block = 144; break;
        case SPECDEC_TILE_Q6_K: inputs = SUPER, block = 210; break;
        case SPECDEC_TILE_Q5_0: inputs = GROUP, block = 22; break;
        case SPECDEC_TILE_Q8_0: inputs = GROUP, block = 34; break;
        default: return SPECDEC_ERR_INVALID_ARGUMENT;
    }
    bytes = TILE * block;
    if (!raw || !out || n <= 0 || n % TILE || k <= 0 || k % inputs) return SPECDEC_ERR_INVALID_ARGUMENT;
    const int64_t blocks = k / inputs;
    if (row_stride < blocks * block) return SPECDEC_ERR_INVALID_ARGUMENT;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t idx = 0; idx < n / TILE * blocks; idx++) {
        const int64_t t = idx / blocks, s = idx % blocks;
        const uint8_t *rows[TILE];
        for (int r = 0; r < TILE; r++) rows[r] = raw + (t * TILE + r) * row_stride + s * block;
        uint8_t *dst = out + idx * bytes;
        switch (kind) {
            case SPECDEC_TILE_Q4_K: pack_q4_k_super(rows, dst); break;
            case SPECDEC_TILE_Q6_K: pack_q6_k_super(rows, dst); break;
            case SPECDEC_TILE_Q5_0: pack_q5_0_group(rows, dst); break;
            default: pack_q8_0_group(rows, dst); break;
        }
    }
    return SPECDEC_OK;
}
