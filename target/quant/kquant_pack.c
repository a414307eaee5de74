/* GGUF Q4_K / Q5_K / Q6_K / Q5_0 / Q4_0 / Q4_1 / IQ4_NL / MXFP4 / Q8_0 rows -> qgemm's tiles of those formats (the layouts of
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

/* the 256 quants of a Q4_K block (0..15) or, `five`, a Q5_K block's (0..31: qh at 16, qs at 48) */
static void k_values(const uint8_t *block, int five, uint8_t *q) {
    const uint8_t *qs = block + (five ? 48 : 16), *qh = block + 16;
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l++) {
            q[64 * g + l] = (uint8_t)((qs[32 * g + l] & 15) | (five ? ((qh[l] >> (2 * g)) & 1) << 4 : 0));
            q[64 * g + 32 + l] = (uint8_t)((qs[32 * g + l] >> 4) | (five ? ((qh[l] >> (2 * g + 1)) & 1) << 4 : 0));
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

/* one super-block of one tile: the 16 rows' blocks `rows[n]` -> `out`; `five`: Q5_K blocks, whose
 * top bits follow at 2304 in Q5_0's plane per 32 inputs (byte 64 j + 4n + i, bit 2b + h: the top
 * bit of q[n][32 j + 8 b + 4 h + i]) */
static void pack_k_super(const uint8_t *const *rows, int five, uint8_t *out) {
    memset(out + 2176, 0, 64);
    if (five) memset(out + 2304, 0, 512);
    for (int n = 0; n < TILE; n++) {
        uint8_t q[SUPER];
        k_values(rows[n], five, q);
        if (five)
            for (int j = 0; j < 8; j++)
                for (int b = 0; b < 4; b++)
                    for (int h = 0; h < 2; h++)
                        for (int i = 0; i < 4; i++)
                            out[2304 + 64 * j + 4 * n + i] |= (uint8_t)((q[32 * j + 8 * b + 4 * h + i] >> 4) << (2 * b + h));
        for (int b = 0; b < 32; b++)
            for (int i = 0; i < 4; i++) out[64 * b + 4 * n + i] = (uint8_t)((q[8 * b + i] & 15) | (q[8 * b + 4 + i] & 15) << 4);
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

/* one 32-input group of a Q4_0 (`m` 0, `e` 0) or Q4_1 tile: the nibbles in the int4 layout, d[16], m[16];
 * IQ4_NL's is Q4_0's; MXFP4 (`e`): its exponent bytes e[16] instead of d */
static void pack_q4_01_group(const uint8_t *const *rows, int m, int e, uint8_t *out) {
    for (int n = 0; n < TILE; n++) {
        const uint8_t *blk = rows[n], *qs = blk + (m ? 4 : e ? 1 : 2);
        if (e) out[256 + n] = blk[0];
        uint8_t q[GROUP];
        for (int j = 0; j < 16; j++) q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4;
        for (int b = 0; b < 4; b++)
            for (int i = 0; i < 4; i++) out[64 * b + 4 * n + i] = (uint8_t)(q[8 * b + i] | q[8 * b + 4 + i] << 4);
        if (!e) memcpy(out + 256 + 2 * n, blk, 2); /* d */
        if (m) memcpy(out + 288 + 2 * n, blk + 2, 2);
    }
}

/* the 256 quants of a Q3_K block (0..7: w = d * (sc - 32) * (q - 4)) or a Q2_K block (0..3) and
 * their 16 sub-scales (Q3_K: 0..63; Q2_K: the scale bytes, sc | m << 4) */
static void k2_values(const uint8_t *blk, int three, uint8_t *q, uint8_t *sc) {
    const uint8_t *qs = blk + (three ? 32 : 16);
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                uint8_t v = (uint8_t)((qs[32 * h + l] >> (2 * j)) & 3);
                if (three) v |= (uint8_t)(((blk[l] >> (4 * h + j)) & 1) << 2);
                q[128 * h + 32 * j + l] = v;
            }
    for (int j = 0; j < 16; j++)
        sc[j] = three ? (uint8_t)(((blk[96 + j % 8] >> (4 * (j / 8))) & 15) | ((blk[104 + j % 4] >> (2 * (j / 4))) & 3) << 4)
                      : blk[j];
}

/* one super-block of a Q3_K (`three`) or Q2_K tile: the 2-bit plane (byte 64 P + 4n + i, bits
 * 2 (2b + h): q[n][16 P + 8 b + 4 h + i] & 3); Q3_K: the third bits in Q5_0's plane per 32 inputs,
 * the sub-scales' low nibbles [j/2][n] and top pairs [j/4][n], d; Q2_K: the scale bytes [j][n], d, dmin */
static void pack_k2_super(const uint8_t *const *rows, int three, uint8_t *out) {
    memset(out, 0, three ? 1728 : 1024);
    for (int n = 0; n < TILE; n++) {
        uint8_t q[SUPER], sc[16];
        k2_values(rows[n], three, q, sc);
        for (int x = 0; x < SUPER; x++) {
            const int pair = x / 16, b = (x / 8) % 2, h = (x / 4) % 2, i = x % 4;
            out[64 * pair + 4 * n + i] |= (uint8_t)((q[x] & 3) << (2 * (2 * b + h)));
            if (three) out[1024 + 64 * (x / 32) + 4 * n + i] |= (uint8_t)((q[x] >> 2) << (2 * ((x / 8) % 4) + h));
        }
        if (three) {
            for (int j = 0; j < 16; j++) {
                out[1536 + 16 * (j / 2) + n] |= (uint8_t)((sc[j] & 15) << (4 * (j % 2)));
                out[1664 + 16 * (j / 4) + n] |= (uint8_t)((sc[j] >> 4) << (2 * (j % 4)));
            }
            memcpy(out + 1728 + 2 * n, rows[n] + 108, 2); /* d */
        } else {
            for (int j = 0; j < 16; j++) out[1024 + 16 * j + n] = sc[j];
            memcpy(out + 1280 + 2 * n, rows[n] + 80, 2); /* d */
            memcpy(out + 1312 + 2 * n, rows[n] + 82, 2); /* dmin */
        }
    }
}

/* one super-block of an IQ4_XS tile: the codes in the int4 layout, the 6-bit ls_j as a plane of
 * low nibbles (byte 16 (j / 2) + n, even j low) and of top 2-bit pairs (byte 16 (j / 4) + n, bits
 * 2 (j % 4)), d[16] */
static void pack_iq4_xs_super(const uint8_t *const *rows, uint8_t *out) {
    memset(out + 2048, 0, 96);
    for (int n = 0; n < TILE; n++) {
        const uint8_t *blk = rows[n], *qs = blk + 8;
        const unsigned high = (unsigned)blk[2] | (unsigned)blk[3] << 8;
        uint8_t q[SUPER];
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 16; i++) q[32 * j + i] = qs[16 * j + i] & 15, q[32 * j + 16 + i] = qs[16 * j + i] >> 4;
        for (int b = 0; b < 32; b++)
            for (int i = 0; i < 4; i++) out[64 * b + 4 * n + i] = (uint8_t)(q[8 * b + i] | q[8 * b + 4 + i] << 4);
        for (int j = 0; j < 8; j++) {
            const unsigned ls = ((blk[4 + j / 2] >> (4 * (j % 2))) & 15) | ((high >> (2 * j)) & 3) << 4;
            out[2048 + 16 * (j / 2) + n] |= (uint8_t)((ls & 15) << (4 * (j % 2)));
            out[2112 + 16 * (j / 4) + n] |= (uint8_t)((ls >> 4) << (2 * (j % 4)));
        }
        memcpy(out + 2144 + 2 * n, blk, 2); /* d */
    }
}

/* the inputs and file bytes of one block of `kind`; 0 for a kind this file does not read */
static int block_geometry(int kind, int64_t *inputs, int64_t *block) {
    switch (kind) {
        case SPECDEC_TILE_Q4_K: *inputs = SUPER, *block = 144; return 1;
        case SPECDEC_TILE_Q5_K: *inputs = SUPER, *block = 176; return 1;
        case SPECDEC_TILE_Q6_K: *inputs = SUPER, *block = 210; return 1;
        case SPECDEC_TILE_Q4_0: *inputs = GROUP, *block = 18; return 1;
        case SPECDEC_TILE_Q4_1: *inputs = GROUP, *block = 20; return 1;
        case SPECDEC_TILE_IQ4_NL: *inputs = GROUP, *block = 18; return 1;
        case SPECDEC_TILE_MXFP4: *inputs = GROUP, *block = 17; return 1;
        case SPECDEC_TILE_IQ4_XS: *inputs = SUPER, *block = 136; return 1;
        case SPECDEC_TILE_Q3_K: *inputs = SUPER, *block = 110; return 1;
        case SPECDEC_TILE_Q2_K: *inputs = SUPER, *block = 84; return 1;
        case SPECDEC_TILE_Q5_0: *inputs = GROUP, *block = 22; return 1;
        case SPECDEC_TILE_Q8_0: *inputs = GROUP, *block = 34; return 1;
        default: return 0;
    }
}

/* raw [n, k / inputs per block * block bytes] (rows `row_stride` bytes apart) of `kind`
 * (a SPECDEC_TILE_ kind block_geometry knows) -> out [n / 16 tiles of their blocks] in the tile
 * layout of that kind. SPECDEC_ERR_INVALID_ARGUMENT for sizes off the tile grid or another kind. */
int kquant_pack(const uint8_t *raw, int64_t row_stride, int64_t n, int64_t k, int kind, uint8_t *out, int threads) {
    int64_t inputs, block; /* per block: inputs, bytes in the file */
    if (!block_geometry(kind, &inputs, &block)) return SPECDEC_ERR_INVALID_ARGUMENT;
    const int64_t bytes = TILE * block; /* a block's bytes in a tile (16 rows) */
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
            case SPECDEC_TILE_Q4_K: pack_k_super(rows, 0, dst); break;
            case SPECDEC_TILE_Q5_K: pack_k_super(rows, 1, dst); break;
            case SPECDEC_TILE_Q4_0: case SPECDEC_TILE_IQ4_NL: pack_q4_01_group(rows, 0, 0, dst); break;
            case SPECDEC_TILE_Q4_1: pack_q4_01_group(rows, 1, 0, dst); break;
            case SPECDEC_TILE_MXFP4: pack_q4_01_group(rows, 0, 1, dst); break;
            case SPECDEC_TILE_IQ4_XS: pack_iq4_xs_super(rows, dst); break;
            case SPECDEC_TILE_Q3_K: pack_k2_super(rows, 1, dst); break;
            case SPECDEC_TILE_Q2_K: pack_k2_super(rows, 0, dst); break;
            case SPECDEC_TILE_Q6_K: pack_q6_k_super(rows, dst); break;
            case SPECDEC_TILE_Q5_0: pack_q5_0_group(rows, dst); break;
            default: pack_q8_0_group(rows, dst); break;
        }
    }
    return SPECDEC_OK;
}

/* fp16 bits -> fp32, exact (subnormals, infinities and NaNs included) */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (exp == 0x1f) u = sign | 0x7f800000u | man << 13;
    else if (exp) u = sign | (exp + 112) << 23 | man << 13;
    else if (!man) u = sign;
    else { /* subnormal: normalise */
        int e = -1;
        uint32_t m = man;
        do e++, m <<= 1; while (!(m & 0x400));
        u = sign | (uint32_t)(112 - e) << 23 | (m & 0x3ff) << 13;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float f16_at(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | p[1] << 8)); }

/* ggml's e8m0_to_fp32_half: 2^(e - 128), subnormal below e = 2 */
static float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static const int8_t IQ4_NL_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static void store_value(void *out, int out_bf16, int64_t i, float v) {
    if (!out_bf16) {
        ((float *)out)[i] = v;
        return;
    }
    uint32_t u; /* round to nearest even, as torch casts */
    memcpy(&u, &v, 4);
    ((uint16_t *)out)[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 /* torch's NaN */
                                                           : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Rows `ids` [n] of a GGUF tensor of `kind` (a SPECDEC_TILE_ kind block_geometry knows) whose rows
 * of k values lie `row_stride` bytes apart in `raw` (rows rows in all) -> out [n, k], fp32 or (out_bf16)
 * bf16 rounded to nearest even: an embedding lookup. The values are gguf_dequant.py's (ggml's)
 * exactly: every product of a scale and a quant is exact in fp32, so only the final add rounds.
 * SPECDEC_ERR_INVALID_ARGUMENT for another kind, k off the block grid or an id outside [0, rows). */
int gguf_rows(const uint8_t *raw, int64_t row_stride, int64_t rows, const int64_t *ids, int64_t n, int64_t k,
              int kind, void *out, int out_bf16) {
    int64_t inputs, block;
    if (!block_geometry(kind, &inputs, &block)) return SPECDEC_ERR_INVALID_ARGUMENT;
    if (!raw || !ids || !out || n < 0 || k <= 0 || k % inputs || row_stride < k / inputs * block)
        return SPECDEC_ERR_INVALID_ARGUMENT;
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= rows) return SPECDEC_ERR_INVALID_ARGUMENT;
    uint8_t q[SUPER];
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = raw + ids[r] * row_stride;
        for (int64_t b = 0; b < k / inputs; b++) {
            const uint8_t *blk = row + b * block;
            const int64_t at = r * k + b * inputs;
            if (kind == SPECDEC_TILE_Q4_K || kind == SPECDEC_TILE_Q5_K) {
                const float d = f16_at(blk), dmin = f16_at(blk + 2);
                k_values(blk, kind == SPECDEC_TILE_Q5_K, q);
                for (int j = 0; j < 8; j++) {
                    uint8_t sc, m;
                    scale_min_k4(j, blk + 4, &sc, &m);
                    const float ds = d * (float)sc, dm = dmin * (float)m;
                    for (int l = 0; l < 32; l++) store_value(out, out_bf16, at + 32 * j + l, ds * (float)q[32 * j + l] - dm);
                }
            } else if (kind == SPECDEC_TILE_Q6_K) {
                const float d = f16_at(blk + 208);
                q6_k_values(blk, q);
                for (int j = 0; j < 16; j++) {
                    const float ds = d * (float)(int8_t)blk[192 + j];
                    for (int l = 0; l < 16; l++) store_value(out, out_bf16, at + 16 * j + l, ds * (float)((int)q[16 * j + l] - 32));
                }
            } else if (kind == SPECDEC_TILE_Q5_0) {
                const float d = f16_at(blk);
                const uint32_t qh = (uint32_t)blk[2] | (uint32_t)blk[3] << 8 | (uint32_t)blk[4] << 16 | (uint32_t)blk[5] << 24;
                for (int j = 0; j < 16; j++) {
                    store_value(out, out_bf16, at + j, d * (float)((int)((blk[6 + j] & 15) | ((qh >> j) & 1) << 4) - 16));
                    store_value(out, out_bf16, at + 16 + j, d * (float)((int)((blk[6 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16));
                }
            } else if (kind == SPECDEC_TILE_Q3_K || kind == SPECDEC_TILE_Q2_K) { /* as gguf: (d * sc) * q (- dmin * m) */
                const int three = kind == SPECDEC_TILE_Q3_K;
                uint8_t sc[16];
                k2_values(blk, three, q, sc);
                const float d = f16_at(blk + (three ? 108 : 80)), dmin = three ? 0.0f : f16_at(blk + 82);
                for (int j = 0; j < 16; j++) {
                    const float dl = three ? d * (float)((int)sc[j] - 32) : d * (float)(sc[j] & 15), ml = dmin * (float)(sc[j] >> 4);
                    for (int l = 0; l < 16; l++)
                        store_value(out, out_bf16, at + 16 * j + l, three ? dl * (float)((int)q[16 * j + l] - 4) : dl * (float)q[16 * j + l] - ml);
                }
            } else if (kind == SPECDEC_TILE_IQ4_XS) { /* (d * (ls_j - 32)) * table[q], as gguf */
                const float d = f16_at(blk);
                const unsigned high = (unsigned)blk[2] | (unsigned)blk[3] << 8;
                for (int j = 0; j < 8; j++) {
                    const int ls = (int)(((blk[4 + j / 2] >> (4 * (j % 2))) & 15) | ((high >> (2 * j)) & 3) << 4);
                    const float dl = d * (float)(ls - 32);
                    for (int i = 0; i < 16; i++) {
                        store_value(out, out_bf16, at + 32 * j + i, dl * (float)IQ4_NL_VALUES[blk[8 + 16 * j + i] & 15]);
                        store_value(out, out_bf16, at + 32 * j + 16 + i, dl * (float)IQ4_NL_VALUES[blk[8 + 16 * j + i] >> 4]);
                    }
                }
            } else if (kind == SPECDEC_TILE_IQ4_NL || kind == SPECDEC_TILE_MXFP4) { /* d * table[q] */
                const int mx = kind == SPECDEC_TILE_MXFP4;
                const int8_t *table = mx ? MXFP4_VALUES : IQ4_NL_VALUES;
                const float d = mx ? e8m0_half(blk[0]) : f16_at(blk);
                const uint8_t *qs = blk + (mx ? 1 : 2);
                for (int j = 0; j < 16; j++) {
                    store_value(out, out_bf16, at + j, d * (float)table[qs[j] & 15]);
                    store_value(out, out_bf16, at + 16 + j, d * (float)table[qs[j] >> 4]);
                }
            } else if (kind == SPECDEC_TILE_Q4_0 || kind == SPECDEC_TILE_Q4_1) { /* d * (q - 8); d * q + m */
                const int q41 = kind == SPECDEC_TILE_Q4_1;
                const float d = f16_at(blk), m = q41 ? f16_at(blk + 2) : 0.0f;
                const uint8_t *qs = blk + (q41 ? 4 : 2);
                for (int j = 0; j < 16; j++) {
                    const int a = qs[j] & 15, b = qs[j] >> 4;
                    store_value(out, out_bf16, at + j, q41 ? d * (float)a + m : d * (float)(a - 8));
                    store_value(out, out_bf16, at + 16 + j, q41 ? d * (float)b + m : d * (float)(b - 8));
                }
            } else {
                const float d = f16_at(blk);
                for (int j = 0; j < 32; j++) store_value(out, out_bf16, at + j, (float)(int8_t)blk[2 + j] * d);
            }
        }
    }
    return SPECDEC_OK;
}
