/* qgemm's tiles in GGUF's own k-quant formats (included by qgemm.c after `tile_rows`): Q4_K and
 * Q6_K weights repacked at load (`kquant.py`) with the file's bytes per weight, 4.5 and 6.5625
 * bits, and read as they are: the weights are exactly the file's.
 *
 * A k-quant tile is 16 output channels by K inputs in super-blocks of 256 inputs; its activations
 * are int8 with one scale per row and super-block (`struct super_consts`, as llama.cpp's Q8_K),
 * so the integer sub-scales multiply the exact integer sums in integer arithmetic (`vpmaddwd`) and
 * a super-block takes one float conversion per output:
 *   Q4_K  w = d * sc_j * q - dmin * m_j           (q 0..15, sub-blocks j of 32, sc, m 0..63)
 *         y += xs * (d * cvt(sum_j sc_j * sum(q * xq)) - dmin * cvt(sum_j m_j * sum_j(xq)))
 *   Q6_K  w = d * sc_j * (q - 32)                 (q 0..63, sub-blocks j of 16, sc -128..127)
 *         y += (d * xs) * cvt(sum_j sc_j * (sum(q * xq) - 32 * sum_j(xq)))
 * Integer sums are exact and the float steps are the same 256-bit operations at every level, so
 * every level returns bitwise the same results, and a row's result never depends on the others.
 *
 * Super-block layout of a tile (bytes; outputs n = 0..15; a "block" is 8 inputs x 16 outputs):
 *   Q4_K (2304 = 16 x 144): 32 blocks of 64 B in the int4 tiles' layout (byte 4n+i: q[n][8b+i] |
 *     q[n][8b+4+i] << 4); 128 B [j][n]: sc_j & 15 | (m_j & 15) << 4; 64 B [j/2][n]: the top two
 *     bits of sc_j, m_j at bits 0-1, 2-3 for even j and 4-5, 6-7 for odd j; d[16], dmin[16] fp16.
 *   Q5_K (2816 = 16 x 176): Q4_K's 2304 bytes (its low nibbles), then per sub-block j of 32 inputs
 *     64 B of top bits in block32_tiles.h's Q5_0 plane (byte 4n+i, bit 2b+h: the top bit of
 *     q[n][32j+8b+4h+i]); w = d * sc_j * q - dmin * m_j with q 0..31, computed as Q4_K's.
 *   IQ4_XS (2176 = 16 x 136): 32 blocks of 64 B of 4-bit codes in the int4 layout; 64 B [j/2][n]:
 *     the low 4 bits of ls_j (even j) | of ls_j+1 << 4; 32 B [j/4][n]: the top 2 bits of ls_j at bits
 *     2 (j % 4); d[16] fp16. w = d * (ls_j - 32) * kvalues_iq4nl[q] (sub-blocks j of 32):
 *         y += (d * xs) * cvt(sum_j (ls_j - 32) * sum(v * xq))
 *     with v the table's signed values (256 bits: `vpsignb` products) or v + 128 (512 bits:
 *     `vpdpbusd`, minus 128 * sum_j(xq)): the same integers.
 *   Q3_K (1760 = 16 x 110) and Q2_K (1344 = 16 x 84): 16 pairs of blocks of 64 B of 2-bit values
 *     (byte 4n+i of pair P, bits 2(2b'+h): the low 2 bits of q[n][16P+8b'+4h+i]); Q3_K then per 32
 *     inputs 64 B of third bits in block32_tiles.h's Q5_0 plane, 128 B [j/2][n] of the 6-bit
 *     sub-scales' low nibbles (even j low), 64 B [j/4][n] of their top 2 bits (at 2 (j % 4)), d[16];
 *     Q2_K then 256 B [j][n] of the file's scale bytes (sc_j | m_j << 4), d[16], dmin[16]:
 *       Q3_K  w = d * (sc_j - 32) * (q - 4)     (q 0..7, sub-blocks of 16: computed as Q6_K's, offset 4)
 *       Q2_K  w = d * sc_j * q - dmin * m_j     (q 0..3, sc, m 0..15, sub-blocks of 16: as Q4_K's)
 *   Q6_K (3360 = 16 x 210): 32 blocks of 96 B: 64 B low nibbles as Q4_K's, then 32 B of top bits
 *     (bits 2v, 2v+1 of byte i: the top two bits of value i of the block's vector v, v = 0..3 the
 *     32-byte vectors low nibbles of bytes 0-31, of 32-63, high nibbles of 0-31, of 32-63);
 *     256 B sc [j][n] int8 (16 sub-blocks); d[16] fp16.
 */

#define SUPER 256
#define Q4K_SUPER_BYTES 2304
#define Q5K_SUPER_BYTES 2816
#define IQ4XS_SUPER_BYTES 2176
#define Q3K_SUPER_BYTES 1760
#define Q2K_SUPER_BYTES 1344
#define Q6K_SUPER_BYTES 3360
/* Rows per register pass over a tile: their sums and the weights about fill the ymm registers. 4:
 * a 4-row verify window in one pass, not 3 + 1 (`kernel_ab.py` at avx2: Q4_K 1.13-1.16x, Q6_K
 * 1.20-1.22x at 4 rows, 1.09-1.12x at 7); qgemm.c still runs 5 and 6 rows as 3 + 2 and 3 + 3, and
 * passes over a decoded tile keep 3 (KQUANT_UNPACKED_PASS: 4 there made 8-64 rows 0.84-0.94x). */
#define KQUANT_PASS 4

/* One row's activations over one super-block. */
struct super_consts {
    float scale;       /* xs */
    int16_t sum16[16]; /* sum(xq) per 16 inputs (Q6_K's sub-blocks) */
    int16_t sum32[8];  /* sum(xq) per 32 inputs (Q4_K's) */
};

/* i0 += madd(maddubs(w0, a) + maddubs(w2, a + 4), s0) and i1 the same with w1, w3, s1: one
 * block's 8 inputs of one row (a: its activations; w0, w1 the halves' first 4 inputs, w2, w3 their
 * last 4) times the sub-block's scales, in int32. asm for MADDUBS_ACC2's reason (qgemm_tiles.h). */
#define KQ_ROW(i0, i1, w0, w1, w2, w3, s0, s1, a)                                                 \
    do {                                                                                           \
        __m256i t_, u_, v_, x_;                                                                    \
        __asm__("vpbroadcastd %10, %2\n\tvpbroadcastd %11, %3\n\t"                                  \
                "vpmaddubsw %2, %6, %4\n\tvpmaddubsw %3, %8, %5\n\tvpaddw %5, %4, %4\n\t"            \
                "vpmaddwd %12, %4, %4\n\tvpaddd %4, %0, %0\n\t"                                       \
                "vpmaddubsw %2, %7, %4\n\tvpmaddubsw %3, %9, %5\n\tvpaddw %5, %4, %4\n\t"            \
                "vpmaddwd %13, %4, %4\n\tvpaddd %4, %1, %1"                                             \
                : "+x"(i0), "+x"(i1), "=&x"(t_), "=&x"(u_), "=&x"(v_), "=&x"(x_)                      \
                : "x"(w0), "x"(w1), "x"(w2), "x"(w3), "m"(*(const int32_t *)(a)),                      \
                  "m"(*(const int32_t *)((a) + 4)), "x"(s0), "x"(s1));                                \
    } while (0)

/* a0 += maddubs(w0, a) + maddubs(w2, a + 4) and a1 the same with w1, w3, in int16: one block's 8
 * inputs of one row for Q4_K, whose sub-block of 4 blocks sums in int16 (at most 4 x 2 x 2 x 15 x
 * 127 = 30480) before its scales multiply it once. Two temporaries. */
#define KQ_ROW16(a0, a1, w0, w1, w2, w3, a)                                                         \
    do {                                                                                           \
        __m256i t_, p_;                                                                            \
        __asm__("vpbroadcastd %8, %2\n\tvpmaddubsw %2, %4, %3\n\tvpaddw %3, %0, %0\n\t"           \
                "vpmaddubsw %2, %5, %2\n\tvpaddw %2, %1, %1\n\t"                                    \
                "vpbroadcastd %9, %2\n\tvpmaddubsw %2, %6, %3\n\tvpaddw %3, %0, %0\n\t"           \
                "vpmaddubsw %2, %7, %2\n\tvpaddw %2, %1, %1"                                         \
                : "+x"(a0), "+x"(a1), "=&x"(t_), "=&x"(p_)                                             \
                : "x"(w0), "x"(w1), "x"(w2), "x"(w3), "m"(*(const int32_t *)(a)),                      \
                  "m"(*(const int32_t *)((a) + 4)));                                                   \
    } while (0)

/* [v[0], v[0], v[1], v[1], ...] of 16 bytes, widened to int16: outputs 0-7 (lo) or 8-15 (hi) as
 * `vpmaddwd` pairs; `sign`: the bytes are int8, else uint8. */
static inline __m256i pairs16_lo(__m128i v, int sign) {
    const __m128i d = _mm_unpacklo_epi8(v, v);
    return sign ? _mm256_cvtepi8_epi16(d) : _mm256_cvtepu8_epi16(d);
}
static inline __m256i pairs16_hi(__m128i v, int sign) {
    const __m128i d = _mm_unpackhi_epi8(v, v);
    return sign ? _mm256_cvtepi8_epi16(d) : _mm256_cvtepu8_epi16(d);
}
/* [a[n], b[n]] as int16 pairs for outputs 0-7 (lo) or 8-15 (hi), a and b uint8 or int8 */
static inline __m256i zip16_lo(__m128i a, __m128i b, int sign) {
    const __m128i d = _mm_unpacklo_epi8(a, b);
    return sign ? _mm256_cvtepi8_epi16(d) : _mm256_cvtepu8_epi16(d);
}
static inline __m256i zip16_hi(__m128i a, __m128i b, int sign) {
    const __m128i d = _mm_unpackhi_epi8(a, b);
    return sign ? _mm256_cvtepi8_epi16(d) : _mm256_cvtepu8_epi16(d);
}

/* sc_j and m_j (6 bits, 16 outputs) of a Q4_K super-block's scales `s` */
static inline void q4k_scales(const uint8_t *s, int j, __m128i *sc, __m128i *m) {
    const __m128i low = _mm_loadu_si128((const __m128i *)(s + 16 * j));
    const __m128i top = _mm_srli_epi16(_mm_loadu_si128((const __m128i *)(s + 128 + 16 * (j / 2))), 4 * (j & 1));
    const __m128i f = _mm_set1_epi8(0x0F), three = _mm_set1_epi8(0x03);
    *sc = _mm_or_si128(_mm_and_si128(low, f), _mm_slli_epi16(_mm_and_si128(top, three), 4));
    *m = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(low, 4), f), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(top, 2), three), 4));
}

/* lo[r], hi[r] += a Q4_K super-block's share of R rows from its integer sums i (quants) and m
 * (mins): xs * (d * cvt(i) - dmin * cvt(m)); c: row 0's consts of the super-block, `supers` apart */
static inline __attribute__((always_inline)) void q4k_scale_rows(__m256 d0, __m256 d1, __m256 dm0, __m256 dm1,
                                                                const __m256i *i0, const __m256i *i1, const __m256i *m0,
                                                                const __m256i *m1, const struct super_consts *c,
                                                                int64_t supers, const int R, __m256 *lo, __m256 *hi) {
    for (int r = 0; r < R; r++) {
        const __m256 xs = _mm256_set1_ps(c[r * supers].scale);
        const __m256 t0 = _mm256_fmsub_ps(d0, _mm256_cvtepi32_ps(i0[r]), _mm256_mul_ps(dm0, _mm256_cvtepi32_ps(m0[r])));
        const __m256 t1 = _mm256_fmsub_ps(d1, _mm256_cvtepi32_ps(i1[r]), _mm256_mul_ps(dm1, _mm256_cvtepi32_ps(m1[r])));
        lo[r] = _mm256_fmadd_ps(xs, t0, lo[r]);
        hi[r] = _mm256_fmadd_ps(xs, t1, hi[r]);
    }
}

/* bit s (0..7) of every byte of t moved to bit 4, the rest cleared (as block32_tiles.h's b32_top) */
static inline __attribute__((always_inline)) __m256i k5_top(__m256i t, int s) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    return _mm256_and_si256(s <= 4 ? _mm256_slli_epi16(t, 4 - s) : _mm256_srli_epi16(t, s - 4), bit4);
}

/* R <= KQUANT_PASS rows (xq `k` apart, consts `supers` apart) against a Q4_K tile or, `five`, a Q5_K
 * tile: lo[r], hi[r] receive outputs 0-7 and 8-15. `ahead`: the prefetch distance. A sub-block's
 * products sum in int16 over its 4 blocks (Q4_K) or 2 (Q5_K: at most 2 x 2 x 2 x 31 x 127 = 31496)
 * before its scales multiply them: the same integers either way. */
static inline __attribute__((always_inline)) void q4k_rows(const uint8_t *tile, int64_t ahead, int64_t supers,
                                                          const int five, const int8_t *xq, const struct super_consts *sc,
                                                          int64_t k, const int R, __m256 *lo, __m256 *hi) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const int bytes = five ? Q5K_SUPER_BYTES : Q4K_SUPER_BYTES, share = bytes / 8;
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *p = tile + s * bytes;
        __m128i scs[8], mins[8];
        for (int j = 0; j < 8; j++) q4k_scales(p + 2048, j, &scs[j], &mins[j]);
        __m256i i0[KQUANT_PASS], i1[KQUANT_PASS], m0[KQUANT_PASS], m1[KQUANT_PASS];
        for (int r = 0; r < R; r++) i0[r] = i1[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            for (int line = 0; line < (share + 63) / 64; line++) /* a sub-block's share of the super-block */
                _mm_prefetch((const char *)p + ahead + share * j + 64 * line, _MM_HINT_T0);
            const __m256i sc0 = pairs16_lo(scs[j], 0), sc1 = pairs16_hi(scs[j], 0);
            __m256i t0 = _mm256_setzero_si256(), t1 = t0;
            if (five)
                t0 = _mm256_loadu_si256((const __m256i *)(p + 2304 + 64 * j)), t1 = _mm256_loadu_si256((const __m256i *)(p + 2336 + 64 * j));
            __m256i a0[KQUANT_PASS], a1[KQUANT_PASS];
            for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_si256();
            for (int b = 0; b < 4; b++) {
                const uint8_t *w = p + 64 * (4 * j + b);
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)w), v1 = _mm256_loadu_si256((const __m256i *)(w + 32));
                __m256i l0 = _mm256_and_si256(v0, nibble), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
                __m256i l1 = _mm256_and_si256(v1, nibble), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
                if (five) {
                    l0 = _mm256_or_si256(l0, k5_top(t0, 2 * b)), l1 = _mm256_or_si256(l1, k5_top(t1, 2 * b));
                    h0 = _mm256_or_si256(h0, k5_top(t0, 2 * b + 1)), h1 = _mm256_or_si256(h1, k5_top(t1, 2 * b + 1));
                }
                for (int r = 0; r < R; r++)
                    KQ_ROW16(a0[r], a1[r], l0, l1, h0, h1, xq + r * k + s * SUPER + 32 * j + 8 * b);
                if (b == 3 || (five && b == 1)) {
                    for (int r = 0; r < R; r++) {
                        i0[r] = _mm256_add_epi32(i0[r], _mm256_madd_epi16(a0[r], sc0));
                        i1[r] = _mm256_add_epi32(i1[r], _mm256_madd_epi16(a1[r], sc1));
                        a0[r] = a1[r] = _mm256_setzero_si256();
                    }
                }
            }
        }
        for (int r = 0; r < R; r++) m0[r] = m1[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2) { /* sum_j m_j * sum_j(xq), the mins of j and j + 1 as pairs */
            const __m256i mp0 = zip16_lo(mins[j], mins[j + 1], 0), mp1 = zip16_hi(mins[j], mins[j + 1], 0);
            for (int r = 0; r < R; r++) {
                const __m256i xs = _mm256_set1_epi32(*(const int32_t *)&sc[r * supers + s].sum32[j]);
                m0[r] = _mm256_add_epi32(m0[r], _mm256_madd_epi16(mp0, xs));
                m1[r] = _mm256_add_epi32(m1[r], _mm256_madd_epi16(mp1, xs));
            }
        }
        const uint16_t *dd = (const uint16_t *)(p + 2240);
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dd));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + 8)));
        const __m256 dm0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + 16)));
        const __m256 dm1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + 24)));
        q4k_scale_rows(d0, d1, dm0, dm1, i0, i1, m0, m1, sc + s, supers, R, lo, hi);
    }
}

/* IQ4_NL's 16 values (ggml's kvalues_iq4nl) in a 128-bit lane for `vpshufb`; `wide`: plus 128 */
static inline __m128i iq4nl_table(int wide) {
    if (wide) return _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166, (char)181,
                                   (char)197, (char)217, (char)241);
    return _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
}

/* sc_j - 32 (int8, 16 outputs) of 6-bit sub-scales held as a plane of low nibbles (`nib` bytes:
 * [j/2][n], even j low) and of top 2-bit pairs ([j/4][n], at 2 (j % 4)) at `s`: IQ4_XS's (nib 64),
 * Q3_K's (nib 128) */
static inline __m128i six_bit_scales(const uint8_t *s, int nib, int j) {
    const __m128i low = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(s + 16 * (j / 2))), 4 * (j & 1)), _mm_set1_epi8(0x0F));
    const __m128i top = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(s + nib + 16 * (j / 4))), 2 * (j % 4)), _mm_set1_epi8(0x03));
    return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(top, 4)), _mm_set1_epi8(32));
}
static inline __m128i iq4xs_scales(const uint8_t *s, int j) { return six_bit_scales(s, 64, j); }

/* The four vectors of block b (8 inputs) of a Q3_K or Q2_K super-block at p, as q6k_block's: the
 * 2-bit values from their pair's plane and, `three`, Q3_K's third bits (moved to bit 2). */
static inline __attribute__((always_inline)) void k2_block(const uint8_t *p, int b, const int three, __m256i *v) {
    const __m256i mask = _mm256_set1_epi8(0x03), bit2 = _mm256_set1_epi8(0x04);
    const __m256i w0 = _mm256_loadu_si256((const __m256i *)(p + 64 * (b / 2))), w1 = _mm256_loadu_si256((const __m256i *)(p + 64 * (b / 2) + 32));
    const int s = 4 * (b % 2);
    v[0] = _mm256_and_si256(_mm256_srli_epi16(w0, s), mask), v[1] = _mm256_and_si256(_mm256_srli_epi16(w1, s), mask);
    v[2] = _mm256_and_si256(_mm256_srli_epi16(w0, s + 2), mask), v[3] = _mm256_and_si256(_mm256_srli_epi16(w1, s + 2), mask);
    if (three) {
        const __m256i t0 = _mm256_loadu_si256((const __m256i *)(p + 1024 + 64 * (b / 4)));
        const __m256i t1 = _mm256_loadu_si256((const __m256i *)(p + 1024 + 64 * (b / 4) + 32));
        for (int h = 0; h < 2; h++) { /* bit 2 (b % 4) + h of the plane to bit 2 */
            const int t = 2 * (b % 4) + h;
            const __m256i a = t >= 2 ? _mm256_srli_epi16(t0, t - 2) : _mm256_slli_epi16(t0, 2 - t);
            const __m256i c = t >= 2 ? _mm256_srli_epi16(t1, t - 2) : _mm256_slli_epi16(t1, 2 - t);
            v[2 * h] = _mm256_or_si256(v[2 * h], _mm256_and_si256(a, bit2));
            v[2 * h + 1] = _mm256_or_si256(v[2 * h + 1], _mm256_and_si256(c, bit2));
        }
    }
}

/* R <= KQUANT_PASS rows against a Q3_K tile (`three`) or a Q2_K tile, as q6k_rows / q4k_rows:
 *   Q3_K  y += (d * xs) * cvt(sum_j (sc_j - 32) * (sum(q * xq) - 4 * sum_j(xq)))
 *   Q2_K  y += xs * (d * cvt(sum_j sc_j * sum(q * xq)) - dmin * cvt(sum_j m_j * sum_j(xq))) */
static inline __attribute__((always_inline)) void k2_rows(const uint8_t *tile, int64_t ahead, int64_t supers,
                                                         const int three, const int8_t *xq, const struct super_consts *sc,
                                                         int64_t k, const int R, __m256 *lo, __m256 *hi) {
    const int bytes = three ? Q3K_SUPER_BYTES : Q2K_SUPER_BYTES;
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *p = tile + s * bytes;
        __m128i scs[16], mins[16];
        __m256i i0[KQUANT_PASS], i1[KQUANT_PASS], m0[KQUANT_PASS], m1[KQUANT_PASS];
        for (int r = 0; r < R; r++) i0[r] = i1[r] = m0[r] = m1[r] = _mm256_setzero_si256();
        for (int j = 0; j < 16; j++) {
            for (int line = 0; line < 2; line++) /* 84-110 bytes a sub-block: the super-block's share */
                _mm_prefetch((const char *)p + ahead + bytes / 16 * j + 64 * line, _MM_HINT_T0);
            if (three) scs[j] = six_bit_scales(p + 1536, 128, j);
            else {
                const __m128i sb = _mm_loadu_si128((const __m128i *)(p + 1024 + 16 * j));
                scs[j] = _mm_and_si128(sb, _mm_set1_epi8(0x0F));
                mins[j] = _mm_and_si128(_mm_srli_epi16(sb, 4), _mm_set1_epi8(0x0F));
            }
            const __m256i sc0 = pairs16_lo(scs[j], three), sc1 = pairs16_hi(scs[j], three);
            for (int b = 2 * j; b < 2 * j + 2; b++) {
                __m256i v[4];
                k2_block(p, b, three, v);
                for (int r = 0; r < R; r++)
                    KQ_ROW(i0[r], i1[r], v[0], v[1], v[2], v[3], sc0, sc1, xq + r * k + s * SUPER + 8 * b);
            }
        }
        for (int j = 0; j < 16; j += 2) { /* Q3_K: minus 4 * sum_j sc_j * sum_j(xq); Q2_K: sum_j m_j * sum_j(xq) */
            const __m256i p0 = three ? _mm256_slli_epi16(zip16_lo(scs[j], scs[j + 1], 1), 2) : zip16_lo(mins[j], mins[j + 1], 0);
            const __m256i p1 = three ? _mm256_slli_epi16(zip16_hi(scs[j], scs[j + 1], 1), 2) : zip16_hi(mins[j], mins[j + 1], 0);
            for (int r = 0; r < R; r++) {
                const __m256i xs = _mm256_set1_epi32(*(const int32_t *)&sc[r * supers + s].sum16[j]);
                m0[r] = _mm256_add_epi32(m0[r], _mm256_madd_epi16(p0, xs));
                m1[r] = _mm256_add_epi32(m1[r], _mm256_madd_epi16(p1, xs));
            }
        }
        if (three) {
            const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 1728)));
            const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 1744)));
            for (int r = 0; r < R; r++) {
                const __m256 xs = _mm256_set1_ps(sc[r * supers + s].scale);
                lo[r] = _mm256_fmadd_ps(_mm256_mul_ps(d0, xs), _mm256_cvtepi32_ps(_mm256_sub_epi32(i0[r], m0[r])), lo[r]);
                hi[r] = _mm256_fmadd_ps(_mm256_mul_ps(d1, xs), _mm256_cvtepi32_ps(_mm256_sub_epi32(i1[r], m1[r])), hi[r]);
            }
            continue;
        }
        const uint16_t *dd = (const uint16_t *)(p + 1280);
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dd));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + 8)));
        const __m256 dm0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + 16)));
        const __m256 dm1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + 24)));
        q4k_scale_rows(d0, d1, dm0, dm1, i0, i1, m0, m1, sc + s, supers, R, lo, hi);
    }
}

/* R <= KQUANT_PASS rows against an IQ4_XS tile (as q4k_rows): each sub-block's signed products
 * widened block by block (SIGNED_ACC2), times ls_j - 32 in int32 (`vpmulld`: exact). */
static inline __attribute__((always_inline)) void iq4xs_rows(const uint8_t *tile, int64_t ahead, int64_t supers,
                                                            const int8_t *xq, const struct super_consts *sc,
                                                            int64_t k, const int R, __m256 *lo, __m256 *hi) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i table = _mm256_broadcastsi128_si256(iq4nl_table(0));
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *p = tile + s * IQ4XS_SUPER_BYTES;
        __m256i i0[KQUANT_PASS], i1[KQUANT_PASS];
        for (int r = 0; r < R; r++) i0[r] = i1[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            for (int line = 0; line < 5; line++) /* 272 bytes a sub-block: the super-block's share */
                _mm_prefetch((const char *)p + ahead + 272 * j + 64 * line, _MM_HINT_T0);
            __m256i a0[KQUANT_PASS], a1[KQUANT_PASS];
            for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_si256();
            for (int b = 0; b < 4; b++) {
                const uint8_t *w = p + 64 * (4 * j + b);
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)w), v1 = _mm256_loadu_si256((const __m256i *)(w + 32));
                const __m256i l0 = _mm256_shuffle_epi8(table, _mm256_and_si256(v0, nibble));
                const __m256i l1 = _mm256_shuffle_epi8(table, _mm256_and_si256(v1, nibble));
                const __m256i h0 = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble));
                const __m256i h1 = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble));
                const __m256i ml0 = _mm256_abs_epi8(l0), ml1 = _mm256_abs_epi8(l1);
                const __m256i mh0 = _mm256_abs_epi8(h0), mh1 = _mm256_abs_epi8(h1);
                for (int r = 0; r < R; r++) {
                    const int8_t *a = xq + r * k + s * SUPER + 32 * j + 8 * b;
                    SIGNED_ACC2(a0[r], a1[r], l0, l1, ml0, ml1, ones, a);
                    SIGNED_ACC2(a0[r], a1[r], h0, h1, mh0, mh1, ones, a + 4);
                }
            }
            const __m128i scj = iq4xs_scales(p + 2048, j);
            const __m256i s0 = _mm256_cvtepi8_epi32(scj), s1 = _mm256_cvtepi8_epi32(_mm_srli_si128(scj, 8));
            for (int r = 0; r < R; r++) {
                i0[r] = _mm256_add_epi32(i0[r], _mm256_mullo_epi32(a0[r], s0));
                i1[r] = _mm256_add_epi32(i1[r], _mm256_mullo_epi32(a1[r], s1));
            }
        }
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2144)));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2160)));
        for (int r = 0; r < R; r++) {
            const __m256 xs = _mm256_set1_ps(sc[r * supers + s].scale);
            lo[r] = _mm256_fmadd_ps(_mm256_mul_ps(d0, xs), _mm256_cvtepi32_ps(i0[r]), lo[r]);
            hi[r] = _mm256_fmadd_ps(_mm256_mul_ps(d1, xs), _mm256_cvtepi32_ps(i1[r]), hi[r]);
        }
    }
}

/* The four 6-bit vectors of a Q6_K block at w (see the layout above). */
static inline void q6k_block(const uint8_t *w, __m256i *v) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i a = _mm256_loadu_si256((const __m256i *)w), b = _mm256_loadu_si256((const __m256i *)(w + 32));
    const __m256i t = _mm256_loadu_si256((const __m256i *)(w + 64));
    v[0] = _mm256_or_si256(_mm256_and_si256(a, nibble), _mm256_and_si256(_mm256_slli_epi16(t, 4), top));
    v[1] = _mm256_or_si256(_mm256_and_si256(b, nibble), _mm256_and_si256(_mm256_slli_epi16(t, 2), top));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), nibble), _mm256_and_si256(t, top));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), nibble), _mm256_and_si256(_mm256_srli_epi16(t, 2), top));
}

/* q6k_rows: as q4k_rows, for a Q6_K tile. */
static inline __attribute__((always_inline)) void q6k_rows(const uint8_t *tile, int64_t ahead, int64_t supers,
                                                          const int8_t *xq, const struct super_consts *sc,
                                                          int64_t k, const int R, __m256 *lo, __m256 *hi) {
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *p = tile + s * Q6K_SUPER_BYTES, *scales = p + 3072;
        __m256i i0[KQUANT_PASS], i1[KQUANT_PASS];
        for (int r = 0; r < R; r++) i0[r] = i1[r] = _mm256_setzero_si256();
        for (int j = 0; j < 16; j++) {
            for (int line = 0; line < 4; line++) /* 210 bytes a sub-block: the super-block's share */
                _mm_prefetch((const char *)p + ahead + 210 * j + 64 * line, _MM_HINT_T0);
            const __m128i scj = _mm_loadu_si128((const __m128i *)(scales + 16 * j));
            const __m256i sc0 = pairs16_lo(scj, 1), sc1 = pairs16_hi(scj, 1);
            for (int b = 0; b < 2; b++) {
                __m256i v[4];
                q6k_block(p + 96 * (2 * j + b), v);
                for (int r = 0; r < R; r++) /* int16 pair sums: at most 2 x 2 x 63 x 127 = 32004 */
                    KQ_ROW(i0[r], i1[r], v[0], v[1], v[2], v[3], sc0, sc1, xq + r * k + s * SUPER + 16 * j + 8 * b);
            }
        }
        for (int j = 0; j < 16; j += 2) { /* minus 32 * sum_j sc_j * sum_j(xq) */
            const __m128i a = _mm_loadu_si128((const __m128i *)(scales + 16 * j));
            const __m128i b = _mm_loadu_si128((const __m128i *)(scales + 16 * j + 16));
            const __m256i sp0 = _mm256_slli_epi16(zip16_lo(a, b, 1), 5), sp1 = _mm256_slli_epi16(zip16_hi(a, b, 1), 5);
            for (int r = 0; r < R; r++) {
                const __m256i xs = _mm256_set1_epi32(*(const int32_t *)&sc[r * supers + s].sum16[j]);
                i0[r] = _mm256_sub_epi32(i0[r], _mm256_madd_epi16(sp0, xs));
                i1[r] = _mm256_sub_epi32(i1[r], _mm256_madd_epi16(sp1, xs));
            }
        }
        const uint16_t *dd = (const uint16_t *)(p + 3328);
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dd));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dd + 8)));
        for (int r = 0; r < R; r++) {
            const __m256 xs = _mm256_set1_ps(sc[r * supers + s].scale);
            lo[r] = _mm256_fmadd_ps(_mm256_mul_ps(d0, xs), _mm256_cvtepi32_ps(i0[r]), lo[r]);
            hi[r] = _mm256_fmadd_ps(_mm256_mul_ps(d1, xs), _mm256_cvtepi32_ps(i1[r]), hi[r]);
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512BW__)
/* AVX-512 VNNI, 512 bits: a k-quant tile's 16 outputs in one zmm (the 64-byte blocks' dword lanes
 * are the outputs), passes of up to MAX_ROWS rows. The same integer sums and, lane by lane, the
 * same fp32 operations as q4k_rows / q6k_rows, so the results are bitwise theirs; half the
 * instructions for the same work, and a verify window of 4-6 rows in one pass. `kernel_ab.py` on
 * a Zen 4 against the 256-bit passes: Q4_K 1.1-1.4x at 1-7 rows, Q6_K 1.03-1.2x; the default
 * target's 4-row forward 1.27-1.32x, 6-row 1.1-1.24x, 1-2 rows unchanged (memory-bound). */
#define KQUANT_WIDE 1

/* [a[n], b[n]] as int16 pairs for the 16 outputs (zip16_lo, then zip16_hi) */
static inline __m512i zip16_wide(__m128i a, __m128i b, int sign) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(zip16_lo(a, b, sign)), zip16_hi(a, b, sign), 1);
}

static inline __attribute__((always_inline)) __m512i k5_top_wide(__m512i t, int s) {
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    return _mm512_and_si512(s <= 4 ? _mm512_slli_epi16(t, 4 - s) : _mm512_srli_epi16(t, s - 4), bit4);
}

/* acc[r] = R <= MAX_ROWS rows (xq `k` apart, consts `supers` apart) times a Q4_K tile (`five`: Q5_K) */
static inline __attribute__((always_inline)) void q4k_rows_wide(const uint8_t *tile, int64_t ahead, int64_t supers,
                                                               const int five, const int8_t *xq,
                                                               const struct super_consts *sc, int64_t k, const int R,
                                                               __m512 *acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const int bytes = five ? Q5K_SUPER_BYTES : Q4K_SUPER_BYTES, share = bytes / 8;
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *p = tile + s * bytes;
        const int8_t *xs0 = xq + s * SUPER;
        __m512i i[MAX_ROWS], m[MAX_ROWS];
        __m128i mins[8];
        for (int r = 0; r < R; r++) i[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            for (int line = 0; line < (share + 63) / 64; line++) /* a sub-block's share of the super-block */
                _mm_prefetch((const char *)p + ahead + share * j + 64 * line, _MM_HINT_T0);
            __m512i a[MAX_ROWS];
            for (int r = 0; r < R; r++) a[r] = _mm512_setzero_si512();
            const __m512i t = five ? _mm512_loadu_si512((const void *)(p + 2304 + 64 * j)) : _mm512_setzero_si512();
            for (int b = 0; b < 4; b++) {
                const __m512i w = _mm512_loadu_si512((const void *)(p + 64 * (4 * j + b)));
                __m512i l = _mm512_and_si512(w, nibble), h = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
                if (five) l = _mm512_or_si512(l, k5_top_wide(t, 2 * b)), h = _mm512_or_si512(h, k5_top_wide(t, 2 * b + 1));
                for (int r = 0; r < R; r++) {
                    DPBUSD_BCST(a[r], l, xs0 + r * k + 32 * j + 8 * b);
                    DPBUSD_BCST(a[r], h, xs0 + r * k + 32 * j + 8 * b + 4);
                }
            }
            __m128i scj;
            q4k_scales(p + 2048, j, &scj, &mins[j]);
            const __m512i s32 = _mm512_cvtepu8_epi32(scj); /* the sub-block's sums times its scale, once */
            for (int r = 0; r < R; r++) i[r] = _mm512_add_epi32(i[r], _mm512_mullo_epi32(a[r], s32));
        }
        for (int r = 0; r < R; r++) m[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j += 2) { /* sum_j m_j * sum_j(xq), the mins of j and j + 1 as pairs */
            const __m512i mp = zip16_wide(mins[j], mins[j + 1], 0);
            for (int r = 0; r < R; r++)
                m[r] = _mm512_add_epi32(m[r], _mm512_madd_epi16(mp, _mm512_set1_epi32(*(const int32_t *)&sc[r * supers + s].sum32[j])));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2240)));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2272)));
        for (int r = 0; r < R; r++) { /* as q4k_scale_rows */
            const __m512 t = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(i[r]), _mm512_mul_ps(dm, _mm512_cvtepi32_ps(m[r])));
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sc[r * supers + s].scale), t, acc[r]);
        }
    }
}

/* iq4xs_rows in 512 bits: the codes looked up as v + 128 and summed by `vpdpbusd`, minus 128 *
 * sum_j(xq): each sub-block's sum(v * xq), then times ls_j - 32, as the 256-bit passes. */
static inline __attribute__((always_inline)) void iq4xs_rows_wide(const uint8_t *tile, int64_t ahead, int64_t supers,
                                                                 const int8_t *xq, const struct super_consts *sc,
                                                                 int64_t k, const int R, __m512 *acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), table = _mm512_broadcast_i32x4(iq4nl_table(1));
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *p = tile + s * IQ4XS_SUPER_BYTES;
        const int8_t *xs0 = xq + s * SUPER;
        __m512i i[MAX_ROWS];
        for (int r = 0; r < R; r++) i[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            for (int line = 0; line < 5; line++) /* 272 bytes a sub-block: the super-block's share */
                _mm_prefetch((const char *)p + ahead + 272 * j + 64 * line, _MM_HINT_T0);
            __m512i a[MAX_ROWS];
            for (int r = 0; r < R; r++) a[r] = _mm512_setzero_si512();
            for (int b = 0; b < 4; b++) {
                const __m512i w = _mm512_loadu_si512((const void *)(p + 64 * (4 * j + b)));
                const __m512i l = _mm512_shuffle_epi8(table, _mm512_and_si512(w, nibble));
                const __m512i h = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble));
                for (int r = 0; r < R; r++) {
                    DPBUSD_BCST(a[r], l, xs0 + r * k + 32 * j + 8 * b);
                    DPBUSD_BCST(a[r], h, xs0 + r * k + 32 * j + 8 * b + 4);
                }
            }
            const __m512i s32 = _mm512_cvtepi8_epi32(iq4xs_scales(p + 2048, j));
            for (int r = 0; r < R; r++) {
                const __m512i v = _mm512_sub_epi32(a[r], _mm512_set1_epi32(128 * sc[r * supers + s].sum32[j]));
                i[r] = _mm512_add_epi32(i[r], _mm512_mullo_epi32(v, s32));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2144)));
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(sc[r * supers + s].scale)), _mm512_cvtepi32_ps(i[r]), acc[r]);
    }
}

/* k2_rows in 512 bits: a block's 16 outputs in one zmm, `vpdpbusd` sums per sub-block times its
 * scale in int32, the same integers and fp32 steps as k2_rows. */
static inline __attribute__((always_inline)) void k2_rows_wide(const uint8_t *tile, int64_t ahead, int64_t supers,
                                                              const int three, const int8_t *xq,
                                                              const struct super_consts *sc, int64_t k, const int R,
                                                              __m512 *acc) {
    const int bytes = three ? Q3K_SUPER_BYTES : Q2K_SUPER_BYTES;
    const __m512i mask = _mm512_set1_epi8(0x03), bit2 = _mm512_set1_epi8(0x04);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *p = tile + s * bytes;
        const int8_t *xs0 = xq + s * SUPER;
        __m128i scs[16], mins[16];
        __m512i i[MAX_ROWS], m[MAX_ROWS];
        for (int r = 0; r < R; r++) i[r] = m[r] = _mm512_setzero_si512();
        for (int j = 0; j < 16; j++) {
            for (int line = 0; line < 2; line++)
                _mm_prefetch((const char *)p + ahead + bytes / 16 * j + 64 * line, _MM_HINT_T0);
            if (three) scs[j] = six_bit_scales(p + 1536, 128, j);
            else {
                const __m128i sb = _mm_loadu_si128((const __m128i *)(p + 1024 + 16 * j));
                scs[j] = _mm_and_si128(sb, _mm_set1_epi8(0x0F));
                mins[j] = _mm_and_si128(_mm_srli_epi16(sb, 4), _mm_set1_epi8(0x0F));
            }
            __m512i a[MAX_ROWS];
            for (int r = 0; r < R; r++) a[r] = _mm512_setzero_si512();
            for (int b = 2 * j; b < 2 * j + 2; b++) {
                const __m512i w = _mm512_loadu_si512((const void *)(p + 64 * (b / 2)));
                const int sh = 4 * (b % 2);
                __m512i l = _mm512_and_si512(_mm512_srli_epi16(w, sh), mask), h = _mm512_and_si512(_mm512_srli_epi16(w, sh + 2), mask);
                if (three) {
                    const __m512i t = _mm512_loadu_si512((const void *)(p + 1024 + 64 * (b / 4)));
                    for (int half = 0; half < 2; half++) { /* bit 2 (b % 4) + half of the plane to bit 2 */
                        const int tb = 2 * (b % 4) + half;
                        const __m512i top = _mm512_and_si512(tb >= 2 ? _mm512_srli_epi16(t, tb - 2) : _mm512_slli_epi16(t, 2 - tb), bit2);
                        if (half) h = _mm512_or_si512(h, top);
                        else l = _mm512_or_si512(l, top);
                    }
                }
                for (int r = 0; r < R; r++) {
                    DPBUSD_BCST(a[r], l, xs0 + r * k + 8 * b);
                    DPBUSD_BCST(a[r], h, xs0 + r * k + 8 * b + 4);
                }
            }
            const __m512i s32 = three ? _mm512_cvtepi8_epi32(scs[j]) : _mm512_cvtepu8_epi32(scs[j]);
            for (int r = 0; r < R; r++) i[r] = _mm512_add_epi32(i[r], _mm512_mullo_epi32(a[r], s32));
        }
        for (int j = 0; j < 16; j += 2) {
            const __m512i pr = three ? _mm512_slli_epi16(zip16_wide(scs[j], scs[j + 1], 1), 2) : zip16_wide(mins[j], mins[j + 1], 0);
            for (int r = 0; r < R; r++)
                m[r] = _mm512_add_epi32(m[r], _mm512_madd_epi16(pr, _mm512_set1_epi32(*(const int32_t *)&sc[r * supers + s].sum16[j])));
        }
        if (three) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 1728)));
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(sc[r * supers + s].scale)),
                                         _mm512_cvtepi32_ps(_mm512_sub_epi32(i[r], m[r])), acc[r]);
            continue;
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 1280)));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 1312)));
        for (int r = 0; r < R; r++) { /* as q4k_scale_rows */
            const __m512 t = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(i[r]), _mm512_mul_ps(dm, _mm512_cvtepi32_ps(m[r])));
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(sc[r * supers + s].scale), t, acc[r]);
        }
    }
}

/* q4k_rows_wide for a Q6_K tile: a block's two 512-bit vectors (its 4 inputs of each half of the
 * tile, then the other 4) take their top bits from one broadcast plane, shifted per half. */
static inline __attribute__((always_inline)) void q6k_rows_wide(const uint8_t *tile, int64_t ahead, int64_t supers,
                                                               const int8_t *xq, const struct super_consts *sc,
                                                               int64_t k, const int R, __m512 *acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    /* per 16-bit lane: the low half (outputs 0-7) shifts its plane by 4 (left) and 0, the high by 2 and 2 */
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *p = tile + s * Q6K_SUPER_BYTES, *scales = p + 3072;
        const int8_t *xs0 = xq + s * SUPER;
        __m512i i[MAX_ROWS];
        for (int r = 0; r < R; r++) i[r] = _mm512_setzero_si512();
        for (int j = 0; j < 16; j++) {
            for (int line = 0; line < 4; line++) /* 210 bytes a sub-block: the super-block's share */
                _mm_prefetch((const char *)p + ahead + 210 * j + 64 * line, _MM_HINT_T0);
            __m512i a[MAX_ROWS];
            for (int r = 0; r < R; r++) a[r] = _mm512_setzero_si512();
            for (int b = 0; b < 2; b++) {
                const uint8_t *w = p + 96 * (2 * j + b);
                const __m512i v = _mm512_loadu_si512((const void *)w);
                const __m512i t = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 64)));
                const __m512i l = _mm512_or_si512(_mm512_and_si512(v, nibble), _mm512_and_si512(_mm512_sllv_epi16(t, up), top));
                const __m512i h = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), nibble),
                                                  _mm512_and_si512(_mm512_srlv_epi16(t, down), top));
                for (int r = 0; r < R; r++) {
                    DPBUSD_BCST(a[r], l, xs0 + r * k + 16 * j + 8 * b);
                    DPBUSD_BCST(a[r], h, xs0 + r * k + 16 * j + 8 * b + 4);
                }
            }
            const __m512i s32 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(scales + 16 * j)));
            for (int r = 0; r < R; r++) i[r] = _mm512_add_epi32(i[r], _mm512_mullo_epi32(a[r], s32));
        }
        for (int j = 0; j < 16; j += 2) { /* minus 32 * sum_j sc_j * sum_j(xq) */
            const __m128i a = _mm_loadu_si128((const __m128i *)(scales + 16 * j));
            const __m128i b = _mm_loadu_si128((const __m128i *)(scales + 16 * j + 16));
            const __m512i sp = _mm512_slli_epi16(zip16_wide(a, b, 1), 5);
            for (int r = 0; r < R; r++)
                i[r] = _mm512_sub_epi32(i[r], _mm512_madd_epi16(sp, _mm512_set1_epi32(*(const int32_t *)&sc[r * supers + s].sum16[j])));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 3328)));
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(sc[r * supers + s].scale)), _mm512_cvtepi32_ps(i[r]), acc[r]);
    }
}
#endif

/* Many rows (a prefill chunk, at least KQUANT_UNPACKED_ROWS): each tile is decoded once per call
 * into a per-thread buffer (`kquant_unpack`: the vectors q4k_rows / q6k_rows compute in every
 * pass, stored), and passes of KQUANT_UNPACKED_PASS rows load them (`kquant_rows_unpacked`): the same
 * integer sums and fp32 operations, so the results are bitwise the register path's.
 * `kernel_ab.py` (docs/results/issue38) at avx2: 1.21x (Q4_K) and 1.38x (Q6_K) at 512 rows, Q4_K
 * about even at 16-64. (Sharing one source with the register path made its 1-3 row passes 5-20%
 * slower.) At AVX-512 VNNI the 512-bit passes above run every row count instead: 1.4-1.7x this
 * path at 8-512 rows, so nothing is decoded once there. */
#define Q4K_UNPACKED 4992 /* 32 blocks x 4 x 32 B, sc pairs 8 x 64 B, min pairs 4 x 64 B, d, d1, dmin, dmin1 x 32 B */
#define Q6K_UNPACKED 5696 /* 32 blocks x 4 x 32 B, sc pairs 16 x 64 B, offset pairs 8 x 64 B, d, d1 x 32 B */
#define KQUANT_UNPACKED_MAX Q6K_UNPACKED
#define KQUANT_UNPACKED_ROWS 8
#define KQUANT_UNPACKED_PASS 3

static inline void store256(uint8_t *q, __m256i v) { _mm256_store_si256((__m256i *)q, v); }
static inline __m256i load256(const uint8_t *q) { return _mm256_load_si256((const __m256i *)q); }
static inline __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* Decode super-block s of a k-quant tile of `kind` into q (KQUANT_UNPACKED_MAX bytes, 64-byte
 * aligned): what q4k_rows / q6k_rows compute in registers, stored. */
static inline __attribute__((always_inline)) void kquant_unpack(int kind, const uint8_t *tile, int64_t s, uint8_t *q) {
    const int q4 = kind != SPECDEC_TILE_Q6_K, five = kind == SPECDEC_TILE_Q5_K; /* Q4_K's layout, Q5_K's top bits */
    const int bytes = five ? Q5K_SUPER_BYTES : q4 ? Q4K_SUPER_BYTES : Q6K_SUPER_BYTES;
    const uint8_t *p = tile + s * bytes;
    for (int line = 0; line < bytes; line += 64)
        _mm_prefetch((const char *)p + PREFETCH_BYTES + line, _MM_HINT_T0);
    for (int b = 0; b < 32; b++) {
        __m256i v[4];
        if (q4) {
            const __m256i nibble = _mm256_set1_epi8(0x0F);
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(p + 64 * b)), v1 = _mm256_loadu_si256((const __m256i *)(p + 64 * b + 32));
            v[0] = _mm256_and_si256(v0, nibble), v[1] = _mm256_and_si256(v1, nibble);
            v[2] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble), v[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
            if (five) {
                const __m256i t0 = _mm256_loadu_si256((const __m256i *)(p + 2304 + 64 * (b / 4)));
                const __m256i t1 = _mm256_loadu_si256((const __m256i *)(p + 2336 + 64 * (b / 4)));
                v[0] = _mm256_or_si256(v[0], k5_top(t0, 2 * (b % 4))), v[1] = _mm256_or_si256(v[1], k5_top(t1, 2 * (b % 4)));
                v[2] = _mm256_or_si256(v[2], k5_top(t0, 2 * (b % 4) + 1)), v[3] = _mm256_or_si256(v[3], k5_top(t1, 2 * (b % 4) + 1));
            }
        } else {
            q6k_block(p + 96 * b, v);
        }
        for (int i = 0; i < 4; i++) store256(q + 128 * b + 32 * i, v[i]);
    }
    if (q4) {
        __m128i scs[8], mins[8];
        for (int j = 0; j < 8; j++) {
            q4k_scales(p + 2048, j, &scs[j], &mins[j]);
            store256(q + 4096 + 64 * j, pairs16_lo(scs[j], 0)), store256(q + 4096 + 64 * j + 32, pairs16_hi(scs[j], 0));
        }
        for (int j = 0; j < 8; j += 2)
            store256(q + 4608 + 32 * j, zip16_lo(mins[j], mins[j + 1], 0)), store256(q + 4608 + 32 * j + 32, zip16_hi(mins[j], mins[j + 1], 0));
        for (int i = 0; i < 4; i++) _mm256_store_ps((float *)(q + 4864 + 32 * i), f16x8(p + 2240 + 16 * i));
        return;
    }
    const uint8_t *scales = p + 3072;
    for (int j = 0; j < 16; j++) {
        const __m128i scj = _mm_loadu_si128((const __m128i *)(scales + 16 * j));
        store256(q + 4096 + 64 * j, pairs16_lo(scj, 1)), store256(q + 4096 + 64 * j + 32, pairs16_hi(scj, 1));
    }
    for (int j = 0; j < 16; j += 2) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(scales + 16 * j));
        const __m128i b = _mm_loadu_si128((const __m128i *)(scales + 16 * j + 16));
        store256(q + 5120 + 32 * j, _mm256_slli_epi16(zip16_lo(a, b, 1), 5));
        store256(q + 5120 + 32 * j + 32, _mm256_slli_epi16(zip16_hi(a, b, 1), 5));
    }
    for (int i = 0; i < 2; i++) _mm256_store_ps((float *)(q + 5632 + 32 * i), f16x8(p + 3328 + 16 * i));
}

/* KQUANT_UNPACKED_PASS rows against a tile decoded into u (`kquant_unpack` of each super-block,
 * KQUANT_UNPACKED_MAX bytes apart): lo[r], hi[r] receive outputs 0-7 and 8-15, as q4k_rows and
 * q6k_rows compute them. */
static inline __attribute__((always_inline)) void kquant_rows_unpacked(int kind, const uint8_t *u, int64_t supers,
                                                                      const int8_t *xq, const struct super_consts *sc,
                                                                      int64_t k, __m256 *lo, __m256 *hi) {
    const int R = KQUANT_UNPACKED_PASS, q4 = kind != SPECDEC_TILE_Q6_K, per = q4 ? 4 : 2; /* blocks per sub-block */
    const int five = kind == SPECDEC_TILE_Q5_K; /* Q4_K's sums, in int16 over 2 blocks instead of 4 */
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        const uint8_t *q = u + s * KQUANT_UNPACKED_MAX;
        __m256i i0[KQUANT_PASS], i1[KQUANT_PASS], m0[KQUANT_PASS], m1[KQUANT_PASS];
        for (int r = 0; r < R; r++) i0[r] = i1[r] = _mm256_setzero_si256();
        for (int j = 0; j < 32 / per; j++) {
            const __m256i sc0 = load256(q + 4096 + 64 * j), sc1 = load256(q + 4096 + 64 * j + 32);
            if (q4) { /* the sub-block's products in int16, then times its scales once (as q4k_rows) */
                __m256i a0[KQUANT_PASS], a1[KQUANT_PASS];
                for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_si256();
                for (int b = per * j; b < per * j + per; b++) {
                    const uint8_t *w = q + 128 * b;
                    const __m256i v0 = load256(w), v1 = load256(w + 32), v2 = load256(w + 64), v3 = load256(w + 96);
                    for (int r = 0; r < R; r++) KQ_ROW16(a0[r], a1[r], v0, v1, v2, v3, xq + r * k + s * SUPER + 8 * b);
                    if (b % 4 == 3 || (five && b % 4 == 1))
                        for (int r = 0; r < R; r++) {
                            i0[r] = _mm256_add_epi32(i0[r], _mm256_madd_epi16(a0[r], sc0));
                            i1[r] = _mm256_add_epi32(i1[r], _mm256_madd_epi16(a1[r], sc1));
                            a0[r] = a1[r] = _mm256_setzero_si256();
                        }
                }
                continue;
            }
            for (int b = per * j; b < per * j + per; b++) {
                const uint8_t *w = q + 128 * b;
                const __m256i v0 = load256(w), v1 = load256(w + 32), v2 = load256(w + 64), v3 = load256(w + 96);
                for (int r = 0; r < R; r++)
                    KQ_ROW(i0[r], i1[r], v0, v1, v2, v3, sc0, sc1, xq + r * k + s * SUPER + 8 * b);
            }
        }
        /* the offsets' sums: Q4_K's mins times the sums per 32, Q6_K's 32 * sc times the sums per 16 */
        for (int r = 0; r < R; r++) m0[r] = m1[r] = _mm256_setzero_si256();
        for (int j = 0; j < (q4 ? 8 : 16); j += 2) {
            const uint8_t *pairs = q + (q4 ? 4608 : 5120) + 32 * j;
            const __m256i p0 = load256(pairs), p1 = load256(pairs + 32);
            for (int r = 0; r < R; r++) {
                const struct super_consts *c = &sc[r * supers + s];
                const __m256i xs = _mm256_set1_epi32(*(const int32_t *)(q4 ? &c->sum32[j] : &c->sum16[j]));
                m0[r] = _mm256_add_epi32(m0[r], _mm256_madd_epi16(p0, xs));
                m1[r] = _mm256_add_epi32(m1[r], _mm256_madd_epi16(p1, xs));
            }
        }
        if (q4) {
            const __m256 d0 = _mm256_load_ps((const float *)(q + 4864)), d1 = _mm256_load_ps((const float *)(q + 4896));
            const __m256 dm0 = _mm256_load_ps((const float *)(q + 4928)), dm1 = _mm256_load_ps((const float *)(q + 4960));
            q4k_scale_rows(d0, d1, dm0, dm1, i0, i1, m0, m1, sc + s, supers, R, lo, hi);
            continue;
        }
        for (int r = 0; r < R; r++) /* exact in int32 however it is summed */
            i0[r] = _mm256_sub_epi32(i0[r], m0[r]), i1[r] = _mm256_sub_epi32(i1[r], m1[r]);
        const __m256 d0 = _mm256_load_ps((const float *)(q + 5632)), d1 = _mm256_load_ps((const float *)(q + 5664));
        for (int r = 0; r < R; r++) {
            const __m256 xs = _mm256_set1_ps(sc[r * supers + s].scale);
            lo[r] = _mm256_fmadd_ps(_mm256_mul_ps(d0, xs), _mm256_cvtepi32_ps(i0[r]), lo[r]);
            hi[r] = _mm256_fmadd_ps(_mm256_mul_ps(d1, xs), _mm256_cvtepi32_ps(i1[r]), hi[r]);
        }
    }
}
