/* qgemm's tiles in GGUF's blocks of 32 inputs with one fp16 d per block (included by qgemm.c after
 * kquant_tiles.h), repacked at load (`kquant.py`) with the file's bytes per 32 weights and read as
 * they are: Q5_0 (w = d * (q - 16), q 0..31, 22 bytes), Q4_0 (w = d * (q - 8), q 0..15, 18 bytes)
 * and Q4_1 (w = d * q + m, q 0..15, fp16 m, 20 bytes), and the tables of 16 values IQ4_NL (w = d *
 * kvalues_iq4nl[q], 18 bytes) and MXFP4 (w = e8m0_half(e) * kvalues_mxfp4[q], one exponent byte e,
 * 17 bytes; gpt-oss's experts). Activations are the int4 / int8 tiles' (int8 per row and group of
 * 32, `struct group_consts`):
 *     y += (d * xs) * cvt(sum(q * xq) - off * sum(xq))     (off 16, 8; 0 for Q4_1)
 *     y += m * (xs * sum(xq))                               (Q4_1)
 * where a table's q is its value plus an offset that makes it unsigned: MXFP4 v + 12 (0..24) at
 * every level; IQ4_NL v + 128 at AVX-512 VNNI (`vpdpbusd`), while the 256-bit passes multiply its
 * signed values by sign-moved activations (`vpsignb`: v + 128 would overflow `vpmaddubsw`). Both
 * give the same integer sum(v * xq).
 * The integer sum is exact and the float steps are the same 256-bit operations at every level, so
 * every level returns bitwise the same results. (GGUF's Q8_0 tiles are the int8 tiles with fp16
 * steps: `tile_rows` reads them.) Each function takes the kind as a constant (`kind`, inlined), so
 * a Q4_0 tile's loop has no top bits and no branch.
 *
 * Group layout (outputs n = 0..15): 4 blocks of 64 B with the low nibbles in the int4 tiles'
 * layout (byte 4n+i: (q[n][8b+i] & 15) | (q[n][8b+4+i] & 15) << 4); Q5_0 then 64 B of top bits
 * (byte 4n+i, bit 2b+h: the top bit of q[n][8b+4h+i]); then d[16] fp16 (MXFP4: e[16]); Q4_1 then
 * m[16] fp16. 352 = 16 x 22, 288 = 16 x 18, 320 = 16 x 20, 272 = 16 x 17 bytes.
 */

static inline int b32_group_bytes(int kind) {
    return kind == SPECDEC_TILE_Q5_0 ? 352 : kind == SPECDEC_TILE_Q4_1 ? 320 : kind == SPECDEC_TILE_MXFP4 ? 272 : 288;
}
static inline int b32_d_at(int kind) { return kind == SPECDEC_TILE_Q5_0 ? 320 : 256; } /* m (Q4_1): d + 32 */
static inline int b32_offset(int kind) { /* the 256-bit passes' */
    return kind == SPECDEC_TILE_Q5_0 ? 16 : kind == SPECDEC_TILE_Q4_0 ? 8 : kind == SPECDEC_TILE_MXFP4 ? 12 : 0;
}
/* a decoded group (b32_unpack_tile): 4 blocks x 4 vectors x 32 B, d of both halves as fp32 (and Q4_1's m) */
static inline int b32_unpacked_bytes(int kind) { return kind == SPECDEC_TILE_Q4_1 ? 640 : 576; }
static inline int is_table(int kind) { return kind == SPECDEC_TILE_IQ4_NL || kind == SPECDEC_TILE_MXFP4; }
static inline int is_block32(int bits) {
    return bits == SPECDEC_TILE_Q5_0 || bits == SPECDEC_TILE_Q4_0 || bits == SPECDEC_TILE_Q4_1 || is_table(bits);
}

/* The 16 values of a table kind, as bytes in each 128-bit lane (`vpshufb` looks up per lane):
 * IQ4_NL's signed, MXFP4's plus 12; `wide`: IQ4_NL's plus 128 (for `vpdpbusd`). */
static inline __m128i b32_table(int kind, int wide) {
    if (kind == SPECDEC_TILE_MXFP4) return _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    return iq4nl_table(wide);
}

/* ggml's e8m0_to_fp32_half of 8 exponent bytes: 2^(e - 128), subnormal below e = 2 */
static inline __m256 b32_e8m0_x8(const uint8_t *e) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e));
    const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(x, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), x);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(small, big, _mm256_cmpgt_epi32(x, _mm256_set1_epi32(1))));
}

/* Rows per pass. 3 rows' int16 and int32 sums and both halves' weights are more than the 16 ymm
 * registers, yet at AVX2 a pass of 3 beats 2 + 1 and the decoded-once path at 3-6 rows: the
 * default draft's 3-row forward 12.8-14.9 ms against 17.8-18.2, 4 rows 18.8-19.6 against 22.5-24.6
 * (7336cd4c7a51:docs/results/issue38/draft_forward_ab.sh). */
#define B32_PASS 3
#define B32_UNPACKED_GROUP 640 /* the most bytes of a decoded group (b32_unpacked_bytes) */
#define B32_UNPACKED_ROWS (2 * B32_PASS + 1) /* decoded once when a call makes more than two passes */
#define B32_UNPACKED_PASS 3 /* rows per pass over a decoded tile (its vectors loaded, not kept) */

/* bit s (0..7) of every byte of t moved to bit 4, the rest cleared */
static inline __attribute__((always_inline)) __m256i b32_top(__m256i t, int s) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    return _mm256_and_si256(s <= 4 ? _mm256_slli_epi16(t, 4 - s) : _mm256_srli_epi16(t, s - 4), bit4);
}

/* The 4 vectors of block b of a group at p (t0, t1: Q5_0's top bits, p + 256 and p + 288): both
 * halves' values of inputs 8b..8b+3, then of 8b+4..8b+7. */
static inline __attribute__((always_inline)) void b32_block(const uint8_t *p, __m256i t0, __m256i t1, int b, const int kind,
                                                           __m256i *v) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)(p + 64 * b)), v1 = _mm256_loadu_si256((const __m256i *)(p + 64 * b + 32));
    v[0] = _mm256_and_si256(v0, nibble);
    v[1] = _mm256_and_si256(v1, nibble);
    v[2] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
    v[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
    if (kind == SPECDEC_TILE_Q5_0) {
        v[0] = _mm256_or_si256(v[0], b32_top(t0, 2 * b)), v[1] = _mm256_or_si256(v[1], b32_top(t1, 2 * b));
        v[2] = _mm256_or_si256(v[2], b32_top(t0, 2 * b + 1)), v[3] = _mm256_or_si256(v[3], b32_top(t1, 2 * b + 1));
    }
    if (is_table(kind)) {
        const __m256i table = _mm256_broadcastsi128_si256(b32_table(kind, 0));
        for (int i = 0; i < 4; i++) v[i] = _mm256_shuffle_epi8(table, v[i]);
    }
}

/* lo[r], hi[r] += group g's share of row r: (d * xs) * cvt(i - off * sum(xq)) (+ m * xs * sum(xq)) */
static inline __attribute__((always_inline)) void b32_group_scale(const __m256i *i0, const __m256i *i1, __m256 d0, __m256 d1,
                                                                 __m256 m0, __m256 m1, const struct group_consts *gc,
                                                                 int64_t groups, int64_t g, const int kind, const int R,
                                                                 __m256 *lo, __m256 *hi) {
    for (int r = 0; r < R; r++) {
        const struct group_consts *c = &gc[r * groups + g];
        const __m256i off = _mm256_set1_epi32(b32_offset(kind) * c->isum);
        const __m256 xs = _mm256_set1_ps(c->scale);
        lo[r] = _mm256_fmadd_ps(_mm256_mul_ps(d0, xs), _mm256_cvtepi32_ps(_mm256_sub_epi32(i0[r], off)), lo[r]);
        hi[r] = _mm256_fmadd_ps(_mm256_mul_ps(d1, xs), _mm256_cvtepi32_ps(_mm256_sub_epi32(i1[r], off)), hi[r]);
        if (kind == SPECDEC_TILE_Q4_1) {
            const __m256 sum = _mm256_set1_ps(c->sum);
            lo[r] = _mm256_fmadd_ps(m0, sum, lo[r]);
            hi[r] = _mm256_fmadd_ps(m1, sum, hi[r]);
        }
    }
}

/* i0[r], i1[r] (int32) += one group's products of R rows (xg: the group's activations, `k` apart)
 * with its blocks' vectors: from the tile (p, t0, t1) or, `unpacked`, loaded from q. The products
 * (at most 5 bits) sum in int16 over two blocks (at most 4 x 2 x 31 x 127 = 31496), then in int32. */
static inline __attribute__((always_inline)) void b32_group_sums(const uint8_t *p, __m256i t0, __m256i t1, const uint8_t *q,
                                                                const int unpacked, const int kind, const int8_t *xg,
                                                                int64_t k, const int R, __m256i *i0, __m256i *i1) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++) i0[r] = i1[r] = _mm256_setzero_si256();
    if (kind == SPECDEC_TILE_IQ4_NL) { /* signed values: widened block by block */
        for (int b = 0; b < 4; b++) {
            __m256i v[4], m[4];
            if (unpacked)
                for (int i = 0; i < 4; i++) v[i] = _mm256_load_si256((const __m256i *)(q + 128 * b + 32 * i));
            else b32_block(p, t0, t1, b, kind, v);
            for (int i = 0; i < 4; i++) m[i] = _mm256_abs_epi8(v[i]);
            for (int r = 0; r < R; r++) {
                SIGNED_ACC2(i0[r], i1[r], v[0], v[1], m[0], m[1], ones, xg + r * k + 8 * b);
                SIGNED_ACC2(i0[r], i1[r], v[2], v[3], m[2], m[3], ones, xg + r * k + 8 * b + 4);
            }
        }
        return;
    }
    for (int pair = 0; pair < 2; pair++) {
        __m256i s0[B32_UNPACKED_PASS], s1[B32_UNPACKED_PASS];
        for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm256_setzero_si256();
        for (int b = 2 * pair; b < 2 * pair + 2; b++) {
            __m256i v[4];
            if (unpacked)
                for (int i = 0; i < 4; i++) v[i] = _mm256_load_si256((const __m256i *)(q + 128 * b + 32 * i));
            else b32_block(p, t0, t1, b, kind, v);
            for (int r = 0; r < R; r++) {
                MADDUBS_ACC2(s0[r], s1[r], v[0], v[1], xg + r * k + 8 * b);
                MADDUBS_ACC2(s0[r], s1[r], v[2], v[3], xg + r * k + 8 * b + 4);
            }
        }
        for (int r = 0; r < R; r++) {
            i0[r] = _mm256_add_epi32(i0[r], _mm256_madd_epi16(s0[r], ones));
            i1[r] = _mm256_add_epi32(i1[r], _mm256_madd_epi16(s1[r], ones));
        }
    }
}

static inline __m256 b32_f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* the steps d of outputs 0-7 (half 0) or 8-15 of the group at p: fp16, or MXFP4's exponents */
static inline __m256 b32_d(const uint8_t *p, const int kind, int half) {
    return kind == SPECDEC_TILE_MXFP4 ? b32_e8m0_x8(p + 256 + 8 * half) : b32_f16x8(p + b32_d_at(kind) + 16 * half);
}

/* R <= B32_PASS rows (xq `k` apart, consts `groups` apart) against a tile of `kind`: lo[r], hi[r]
 * receive outputs 0-7 and 8-15. `ahead`: the prefetch distance. */
static inline __attribute__((always_inline)) void b32_rows(const uint8_t *tile, int64_t ahead, int64_t groups, const int kind,
                                                          const int8_t *xq, const struct group_consts *gc,
                                                          int64_t k, const int R, __m256 *lo, __m256 *hi) {
    const int bytes = b32_group_bytes(kind), at = b32_d_at(kind);
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = tile + g * bytes;
        for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)p + ahead + line, _MM_HINT_T0);
        __m256i t0 = _mm256_setzero_si256(), t1 = t0;
        if (kind == SPECDEC_TILE_Q5_0)
            t0 = _mm256_loadu_si256((const __m256i *)(p + 256)), t1 = _mm256_loadu_si256((const __m256i *)(p + 288));
        __m256i i0[B32_PASS], i1[B32_PASS];
        b32_group_sums(p, t0, t1, NULL, 0, kind, xq + g * GROUP, k, R, i0, i1);
        const __m256 m0 = kind == SPECDEC_TILE_Q4_1 ? b32_f16x8(p + at + 32) : _mm256_setzero_ps();
        const __m256 m1 = kind == SPECDEC_TILE_Q4_1 ? b32_f16x8(p + at + 48) : _mm256_setzero_ps();
        b32_group_scale(i0, i1, b32_d(p, kind, 0), b32_d(p, kind, 1), m0, m1, gc, groups, g, kind, R, lo, hi);
    }
}

/* Many rows (the draft's catch-up windows, prefill chunks; at least B32_UNPACKED_ROWS): the tile
 * is decoded once per call into a per-thread buffer, b32_unpacked_bytes a group (its blocks'
 * 4 vectors, then d and m of both halves as fp32), which passes of B32_UNPACKED_PASS rows load: the
 * same integer sums and fp32 operations as b32_rows, so the results are bitwise its. */
static void b32_unpack_tile(const uint8_t *tile, int64_t groups, const int kind, uint8_t *u) {
    const int bytes = b32_group_bytes(kind), at = b32_d_at(kind);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = tile + g * bytes;
        for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)p + PREFETCH_BYTES + line, _MM_HINT_T0);
        __m256i t0 = _mm256_setzero_si256(), t1 = t0;
        if (kind == SPECDEC_TILE_Q5_0)
            t0 = _mm256_loadu_si256((const __m256i *)(p + 256)), t1 = _mm256_loadu_si256((const __m256i *)(p + 288));
        uint8_t *q = u + g * b32_unpacked_bytes(kind);
        for (int b = 0; b < 4; b++) {
            __m256i v[4];
            b32_block(p, t0, t1, b, kind, v);
            for (int i = 0; i < 4; i++) _mm256_store_si256((__m256i *)(q + 128 * b + 32 * i), v[i]);
        }
        for (int i = 0; i < 2; i++) _mm256_store_ps((float *)(q + 512 + 32 * i), b32_d(p, kind, i));
        for (int i = 2; i < (kind == SPECDEC_TILE_Q4_1 ? 4 : 2); i++) _mm256_store_ps((float *)(q + 512 + 32 * i), b32_f16x8(p + at + 16 * i));
    }
}

static inline __attribute__((always_inline)) void b32_rows_unpacked(const uint8_t *u, int64_t groups, const int kind,
                                                                   const int8_t *xq, const struct group_consts *gc,
                                                                   int64_t k, const int R, __m256 *lo, __m256 *hi) {
    const __m256i none = _mm256_setzero_si256();
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *q = u + g * b32_unpacked_bytes(kind);
        __m256i i0[B32_UNPACKED_PASS], i1[B32_UNPACKED_PASS];
        b32_group_sums(NULL, none, none, q, 1, kind, xq + g * GROUP, k, R, i0, i1);
        const __m256 m0 = kind == SPECDEC_TILE_Q4_1 ? _mm256_load_ps((const float *)(q + 576)) : _mm256_setzero_ps();
        const __m256 m1 = kind == SPECDEC_TILE_Q4_1 ? _mm256_load_ps((const float *)(q + 608)) : _mm256_setzero_ps();
        b32_group_scale(i0, i1, _mm256_load_ps((const float *)(q + 512)), _mm256_load_ps((const float *)(q + 544)), m0, m1,
                        gc, groups, g, kind, R, lo, hi);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
/* AVX-512 VNNI: a group's 16 outputs in one zmm (the tile's 64-byte blocks are the int4 tiles' dword
 * lanes, output n in lane n), products summed by `vpdpbusd` in int32, passes of up to MAX_ROWS rows,
 * and the packed tile or the decoded one read by the same loop. The integer sums are the AVX2
 * path's, and the fp32 steps the same operations per output, so the results are bitwise its. */
#define B32_WIDE 1
#undef B32_UNPACKED_ROWS
#define B32_UNPACKED_ROWS (2 * MAX_ROWS + 1) /* decoded once when a call makes more than two passes */

/* b32_e8m0_x8 of 16 exponent bytes */
static inline __m512 b32_e8m0_x16(const uint8_t *e) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)e));
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(x, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), x);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(x, _mm512_set1_epi32(1)), small, big));
}

static inline __attribute__((always_inline)) __m512i b32_top_wide(__m512i t, int s) {
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    return _mm512_and_si512(s <= 4 ? _mm512_slli_epi16(t, 4 - s) : _mm512_srli_epi16(t, s - 4), bit4);
}

/* acc[r] = R rows' (xq `k` apart, consts `groups` apart) products with a tile of `kind`: packed at
 * `tile` (prefetching `ahead`), or decoded by b32_unpack_tile (`unpacked`). Two int32 sums per
 * row (the low and high nibbles' inputs) halve the chains of `vpdpbusd`. */
static inline __attribute__((always_inline)) void b32_rows_wide(const uint8_t *tile, int64_t ahead, const int unpacked,
                                                               int64_t groups, const int kind, const int8_t *xq,
                                                               const struct group_consts *gc, int64_t k, const int R,
                                                               vf *acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i table = _mm512_broadcast_i32x4(b32_table(kind, 1));
    const int bytes = b32_group_bytes(kind), at = b32_d_at(kind);
    const int off = kind == SPECDEC_TILE_IQ4_NL ? 128 : b32_offset(kind);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *xg = xq + g * GROUP;
        __m512i lo_sum[MAX_ROWS], hi_sum[MAX_ROWS];
        for (int r = 0; r < R; r++) lo_sum[r] = hi_sum[r] = _mm512_setzero_si512();
        __m512 d, m = _mm512_setzero_ps();
        if (unpacked) {
            const uint8_t *q = tile + g * b32_unpacked_bytes(kind);
            for (int b = 0; b < 4; b++) {
                __m512i lo = _mm512_load_si512((const void *)(q + 128 * b));
                __m512i hi = _mm512_load_si512((const void *)(q + 128 * b + 64));
                if (kind == SPECDEC_TILE_IQ4_NL) /* decoded signed (b32_unpack_tile): plus 128 */
                    lo = _mm512_xor_si512(lo, _mm512_set1_epi8((char)0x80)), hi = _mm512_xor_si512(hi, _mm512_set1_epi8((char)0x80));
                for (int r = 0; r < R; r++) {
                    DPBUSD_BCST(lo_sum[r], lo, xg + r * k + 8 * b);
                    DPBUSD_BCST(hi_sum[r], hi, xg + r * k + 8 * b + 4);
                }
            }
            d = _mm512_load_ps((const float *)(q + 512));
            if (kind == SPECDEC_TILE_Q4_1) m = _mm512_load_ps((const float *)(q + 576));
        } else {
            const uint8_t *p = tile + g * bytes;
            for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)p + ahead + line, _MM_HINT_T0);
            const __m512i t = kind == SPECDEC_TILE_Q5_0 ? _mm512_loadu_si512((const void *)(p + 256)) : _mm512_setzero_si512();
            for (int b = 0; b < 4; b++) {
                const __m512i w = _mm512_loadu_si512((const void *)(p + 64 * b));
                __m512i lo = _mm512_and_si512(w, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
                if (kind == SPECDEC_TILE_Q5_0)
                    lo = _mm512_or_si512(lo, b32_top_wide(t, 2 * b)), hi = _mm512_or_si512(hi, b32_top_wide(t, 2 * b + 1));
                if (is_table(kind)) lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
                for (int r = 0; r < R; r++) {
                    DPBUSD_BCST(lo_sum[r], lo, xg + r * k + 8 * b);
                    DPBUSD_BCST(hi_sum[r], hi, xg + r * k + 8 * b + 4);
                }
            }
            d = kind == SPECDEC_TILE_MXFP4 ? b32_e8m0_x16(p + 256) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + at)));
            if (kind == SPECDEC_TILE_Q4_1) m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + at + 32)));
        }
        for (int r = 0; r < R; r++) { /* as b32_group_scale */
            const struct group_consts *c = &gc[r * groups + g];
            const __m512i i = _mm512_sub_epi32(_mm512_add_epi32(lo_sum[r], hi_sum[r]), _mm512_set1_epi32(off * c->isum));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(c->scale)), _mm512_cvtepi32_ps(i), acc[r]);
            if (kind == SPECDEC_TILE_Q4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(c->sum), acc[r]);
        }
    }
}
#endif
