/* qgemm's inner loop per instruction-set level (included by qgemm.c, after `struct group_consts`):
 * `tile_rows` multiplies one weight tile (16 outputs) by R rows of quantized activations and
 * leaves the 16 fp32 results of row r in acc[r]; `MAX_ROWS` is the most rows one call takes.
 *
 * The integer sum of a group (32 inputs x 16 outputs x R rows) is exact at every level; it is
 * then scaled with the same fp32 operations in the same order, so the levels agree bitwise:
 *   acc += step * (cvt(isum) * xs - off * xs * sum(xq)) + zero * xs * sum(xq)   (int4)
 *   acc += step * (cvt(isum) * xs - 128 * xs * sum(xq))                         (int8)
 * where isum = sum(q * xq) with the unsigned weights q (0..15, or 1..255). GGUF's Q8_0 tiles are
 * int8 tiles whose steps are the file's fp16 d (q + 128 may be 0 there: the AVX2 products then
 * reach 2 x 128 x 127, still inside int16).
 */

/* What a pass over a tile prefetches, as a distance from the bytes it reads (`ahead`). The tile's
 * first pass streams it from memory, PREFETCH_BYTES ahead. A later pass (more rows than one pass
 * takes, or an int8 tile's second half) reads the tile from cache, so it prefetches the next tile
 * at the same place (`next_ahead` = next tile - this tile): memory keeps streaming while the rows
 * of later passes compute, and a verify window of 4-8 rows costs about max(memory, compute), not
 * their sum. `tile_rows` takes `first` (its rows start the tile) and picks; the first pass keeps
 * a constant distance, so its code is what it was without the second pass's prefetch. */

/* The VEX `vpmaddubsw` step every level can run (AVX2's int4 and int8 paths, and every level's
 * k-quant tiles, kquant_tiles.h). asm so that gcc keeps the steps in this order (see below). */
/* acc0 (int16) += the byte-pair sums of w0 (unsigned) times the 4 signed bytes at a, in every lane,
 * and acc1 the same with w1: both halves of a tile from one broadcast. */
#define MADDUBS_ACC2(acc0, acc1, w0, w1, a)                                                        \
    do {                                                                                           \
        __m256i t_, u_;                                                                            \
        __asm__("vpbroadcastd %6, %2\n\tvpmaddubsw %2, %4, %3\n\tvpaddw %3, %0, %0\n\t"           \
                "vpmaddubsw %2, %5, %2\n\tvpaddw %2, %1, %1"                                      \
                : "+x"(acc0), "+x"(acc1), "=&x"(t_), "=&x"(u_)                                      \
                : "x"(w0), "x"(w1), "m"(*(const int32_t *)(a)));                                     \
    } while (0)

/* acc0 (int32) += w0 . a and acc1 += w1 . a for signed weight bytes w (m: |w|, ones: int16 1s):
 * |w| times the activations with w's signs, pairs summed in int16 (at most 2 x 127 x 127), then
 * widened at once. asm for MADDUBS_ACC2's reason (above). */
#define SIGNED_ACC2(acc0, acc1, w0, w1, m0, m1, ones, a)                                           \
    do {                                                                                           \
        __m256i b_, t_, u_;                                                                        \
        __asm__("vpbroadcastd %10, %2\n\tvpsignb %5, %2, %3\n\tvpmaddubsw %3, %7, %3\n\t"          \
                "vpmaddwd %9, %3, %3\n\tvpaddd %3, %0, %0\n\t"                                      \
                "vpsignb %6, %2, %4\n\tvpmaddubsw %4, %8, %4\n\tvpmaddwd %9, %4, %4\n\tvpaddd %4, %1, %1" \
                : "+x"(acc0), "+x"(acc1), "=&x"(b_), "=&x"(t_), "=&x"(u_)                              \
                : "x"(w0), "x"(w1), "x"(m0), "x"(m1), "x"(ones), "m"(*(const int32_t *)(a)));          \
    } while (0)

#if defined(__AVX512VNNI__) && defined(__AVX512F__)

#define MAX_ROWS 6

/* acc += w (16 x 4 unsigned bytes) . the 4 signed bytes at `a`, broadcast to every lane. Written in
 * asm so the broadcast stays a memory operand: with the intrinsic, gcc hoists the broadcasts into
 * vectors spilled to the stack. */
#define DPBUSD_BCST(acc, w, a) \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)(a)))

/* Two int32 accumulators per row (even and odd halves of each group) halve the dependency chains
 * of `vpdpbusd`, whose latency otherwise bounds the loop. */
static inline __attribute__((always_inline)) void tile_rows_ahead(
    const uint8_t *tile, int64_t ahead, int bits, int64_t groups, const int8_t *xq,
    const struct group_consts *gc, int64_t k, const int R, vf *acc) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *p = tile;
    for (int64_t g = 0; g < groups; g++) {
        __m512i even[MAX_ROWS], odd[MAX_ROWS];
        for (int r = 0; r < R; r++) even[r] = odd[r] = _mm512_setzero_si512();
        const int8_t *xg = xq + g * GROUP;
        if (bits == 4) {
            for (int b = 0; b < 4; b++, p += 64) {
                _mm_prefetch((const char *)p + ahead, _MM_HINT_T0);
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
                _mm_prefetch((const char *)p + ahead, _MM_HINT_T0);
                _mm_prefetch((const char *)p + ahead + 64, _MM_HINT_T0);
                __m512i w0 = _mm512_loadu_si512((const void *)p);
                __m512i w1 = _mm512_loadu_si512((const void *)(p + 64));
                for (int r = 0; r < R; r++) {
                    const int8_t *a = xg + r * k + 4 * b;
                    DPBUSD_BCST(even[r], w0, a);
                    DPBUSD_BCST(odd[r], w1, a + 4);
                }
            }
        }
        const __m512 step = bits == SPECDEC_TILE_Q8_0 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p))
                                                      : vf_load_bf16((const uint16_t *)p); /* int8, Q8_0 */
        p += 32;
        if (bits == 4) {
            const __m512 zero = vf_load_bf16((const uint16_t *)p);
            p += 32;
            for (int r = 0; r < R; r++) {
                const struct group_consts *c = &gc[r * groups + g];
                __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(even[r], odd[r]));
                t = _mm512_fmsub_ps(t, _mm512_set1_ps(c->scale), _mm512_set1_ps(c->int4_offset));
                acc[r] = _mm512_fmadd_ps(step, t, acc[r]);
                acc[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(c->sum), acc[r]);
            }
        } else {
            for (int r = 0; r < R; r++) {
                const struct group_consts *c = &gc[r * groups + g];
                __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(even[r], odd[r]));
                t = _mm512_fmsub_ps(t, _mm512_set1_ps(c->scale), _mm512_set1_ps(c->int8_offset));
                acc[r] = _mm512_fmadd_ps(step, t, acc[r]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *tile, int first, int64_t next_ahead, int bits, int64_t groups, const int8_t *xq,
    const struct group_consts *gc, int64_t k, const int R, vf *acc) {
    if (first) tile_rows_ahead(tile, PREFETCH_BYTES, bits, groups, xq, gc, k, R, acc);
    else tile_rows_ahead(tile, next_ahead, bits, groups, xq, gc, k, R, acc);
}

#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)

/* 256 bits: a tile is two halves of 8 outputs (the first and last 32 bytes of each 64-byte block).
 * int4 tiles take both halves in one pass of up to 3 rows (`int4_rows_both_halves`: one broadcast
 * of 4 activations feeds both halves' products; 1.1-1.27x faster than a pass per half with
 * AVX-VNNI, up to 1.14x with AVX2, `bench_qgemm`); int8 tiles take a pass per half, whose
 * accumulators (R fp32 + R integer), weights and a broadcast about fit the 16 ymm registers. */
#define MAX_ROWS 6

/* The steps below are asm so that gcc keeps them in this order: with intrinsics it hoists every
 * broadcast and product of the unrolled group ahead of the adds (integer adds reassociate) and
 * spills them to the stack, which made the kernel ~2x slower. */
#if defined(__AVXVNNI__)
/* acc0 += w0 . a and acc1 += w1 . a (both halves of a tile) from one broadcast */
#define DOT4_2(acc0, acc1, w0, w1, a)                                                              \
    do {                                                                                           \
        __m256i t_;                                                                                \
        __asm__("vpbroadcastd %5, %2\n\t%{vex%} vpdpbusd %2, %3, %0\n\t%{vex%} vpdpbusd %2, %4, %1"  \
                : "+x"(acc0), "+x"(acc1), "=&x"(t_) : "x"(w0), "x"(w1), "m"(*(const int32_t *)(a)));  \
    } while (0)
/* acc += w (8 x 4 unsigned bytes) . the 4 signed bytes at a, in every lane */
#define DOT4(acc, w, a)                                                                            \
    do {                                                                                           \
        __m256i t_;                                                                                \
        __asm__("vpbroadcastd %3, %1\n\t%{vex%} vpdpbusd %1, %2, %0"                                 \
                : "+x"(acc), "=&x"(t_) : "x"(w), "m"(*(const int32_t *)(a)));                        \
    } while (0)
#else
/* acc (int32) += (|s| . sign(the 4 signed bytes at a, s)) summed by lane: s . a for signed s */
#define SIGNED_DOT4(acc, s, mag, ones, a)                                                          \
    do {                                                                                           \
        __m256i t_;                                                                                \
        __asm__("vpbroadcastd %5, %1\n\tvpsignb %2, %1, %1\n\tvpmaddubsw %1, %3, %1\n\t"          \
                "vpmaddwd %4, %1, %1\n\tvpaddd %1, %0, %0"                                        \
                : "+x"(acc), "=&x"(t_) : "x"(s), "x"(mag), "x"(ones), "m"(*(const int32_t *)(a)));  \
    } while (0)
#endif

/* isum[r] = the 8 exact int32 sums of one int8 group half (`w`: its first block + 32 h). AVX2
 * multiplies the signed weights q - 128 (|.| <= 127, so a
 * byte pair stays under 2^15) by sign-moved activations and adds 128 * sum(xq) back. */
static inline __attribute__((always_inline)) void dot_int8(const uint8_t *w, const int8_t *xg, int64_t k,
                                                          const struct group_consts *gc, int64_t groups,
                                                          const int R, __m256i *isum) {
    for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
    for (int b = 0; b < 8; b++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 64 * b));
#if defined(__AVXVNNI__)
        for (int r = 0; r < R; r++) DOT4(isum[r], v, xg + r * k + 4 * b);
#else
        const __m256i s = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)), mag = _mm256_abs_epi8(s);
        const __m256i ones = _mm256_set1_epi16(1);
        for (int r = 0; r < R; r++) SIGNED_DOT4(isum[r], s, mag, ones, xg + r * k + 4 * b);
#endif
    }
#if !defined(__AVXVNNI__)
    for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_set1_epi32(128 * gc[r * groups].isum));
#else
    (void)gc, (void)groups;
#endif
}

static inline __m256 load_bf16x8_bytes(const uint8_t *p) { return load_bf16x8((const uint16_t *)p); }

/* s0[r], s1[r] += the products of one int4 block (8 inputs; l0, l1: both halves' low nibbles,
 * h0, h1: their high ones) with the 8 activations at `a` of each of R rows (`k` apart). */
static inline __attribute__((always_inline)) void int4_block_rows(__m256i *s0, __m256i *s1, __m256i l0, __m256i l1,
                                                                 __m256i h0, __m256i h1, const int8_t *a, int64_t k,
                                                                 const int R) {
    for (int r = 0; r < R; r++) {
#if defined(__AVXVNNI__)
        DOT4_2(s0[r], s1[r], l0, l1, a + r * k);
        DOT4_2(s0[r], s1[r], h0, h1, a + r * k + 4);
#else
        MADDUBS_ACC2(s0[r], s1[r], l0, l1, a + r * k);
        MADDUBS_ACC2(s0[r], s1[r], h0, h1, a + r * k + 4);
#endif
    }
}

/* lo[r], hi[r] += group g's share of row r: the int4 formula of the header, from the integer sums
 * s0[r] and s1[r] (int16 pairs at AVX2, int32 at AVX-VNNI) and the halves' steps and zeros. */
static inline __attribute__((always_inline)) void int4_group_scale(
    __m256i *s0, __m256i *s1, __m256 step0, __m256 step1, __m256 zero0, __m256 zero1,
    const struct group_consts *gc, int64_t groups, int64_t g, const int R, __m256 *lo, __m256 *hi) {
    for (int r = 0; r < R; r++) {
#if !defined(__AVXVNNI__)
        s0[r] = _mm256_madd_epi16(s0[r], _mm256_set1_epi16(1));
        s1[r] = _mm256_madd_epi16(s1[r], _mm256_set1_epi16(1));
#endif
        const struct group_consts *c = &gc[r * groups + g];
        const __m256 scale = _mm256_set1_ps(c->scale), off = _mm256_set1_ps(c->int4_offset), sum = _mm256_set1_ps(c->sum);
        lo[r] = _mm256_fmadd_ps(step0, _mm256_fmsub_ps(_mm256_cvtepi32_ps(s0[r]), scale, off), lo[r]);
        lo[r] = _mm256_fmadd_ps(zero0, sum, lo[r]);
        hi[r] = _mm256_fmadd_ps(step1, _mm256_fmsub_ps(_mm256_cvtepi32_ps(s1[r]), scale, off), hi[r]);
        hi[r] = _mm256_fmadd_ps(zero1, sum, hi[r]);
    }
}

/* An int4 tile against R <= 3 rows, both halves in one pass: each broadcast of 4 activations
 * feeds the products of both halves (half the broadcasts of a pass per half). lo[r] and hi[r]
 * receive outputs 0-7 and 8-15. AVX2 sums the byte pairs of `vpmaddubsw` in int16 through the
 * group (at most 8 x 2 x 15 x 127 = 30480), then in int32 (`vpmaddwd`). */
static inline __attribute__((always_inline)) void int4_rows_both_halves(
    const uint8_t *tile, int64_t ahead, int64_t groups, const int8_t *xq, const struct group_consts *gc,
    int64_t k, const int R, __m256 *lo, __m256 *hi) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = tile + g * 320;
        for (int64_t line = 0; line < 320; line += 64) _mm_prefetch((const char *)p + ahead + line, _MM_HINT_T0);
        const int8_t *xg = xq + g * GROUP;
        __m256i s0[3], s1[3];
        for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm256_setzero_si256();
        for (int b = 0; b < 4; b++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(p + 64 * b));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(p + 64 * b + 32));
            const __m256i l0 = _mm256_and_si256(v0, nibble), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
            const __m256i l1 = _mm256_and_si256(v1, nibble), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
            int4_block_rows(s0, s1, l0, l1, h0, h1, xg + 8 * b, k, R);
        }
        int4_group_scale(s0, s1, load_bf16x8_bytes(p + 256), load_bf16x8_bytes(p + 272), load_bf16x8_bytes(p + 288),
                         load_bf16x8_bytes(p + 304), gc, groups, g, R, lo, hi);
    }
}

/* Many rows (a prefill chunk, at least UNPACKED_MIN_ROWS): each int4 tile is unpacked once per
 * call into a per-thread buffer, UNPACKED_GROUP bytes a group: per block its low and high nibbles
 * of both halves as bytes (l0, l1, h0, h1: 32 B each), then step0, step1, zero0, zero1 widened to
 * fp32 (32 B each). The passes of UNPACKED_PASS rows then load what `int4_rows_both_halves`
 * computes again in every pass of 3 (the weight registers freed by the unpacking take a fourth
 * row): the same integer sums and fp32 operations, so the results are bitwise the packed path's.
 * `prefetch_ab.py` at avx2, old and new alternating: 1.03-1.08x at 7-8 rows, 1.1-1.25x at 16-512;
 * at 4-6 rows the packed passes (the second prefetching the next tile) are as fast or faster. */
#define UNPACKED_GROUP 640
#if defined(__AVXVNNI__)
#define UNPACKED_MIN_ROWS 32 /* avx-vnni: 1.1x slower at 7 rows, even at 16, 1.03-1.09x faster at 64-512 */
#else
#define UNPACKED_MIN_ROWS 7
#endif
#define UNPACKED_PASS 4 /* rows per pass: 3 + the weight registers the unpacking frees */

/* Stream an int4 tile (PREFETCH_BYTES ahead) into its unpacked form `u`. */
static inline void unpack_int4_tile(const uint8_t *tile, int64_t groups, uint8_t *u) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = tile + g * 320;
        for (int64_t line = 0; line < 320; line += 64) _mm_prefetch((const char *)p + PREFETCH_BYTES + line, _MM_HINT_T0);
        uint8_t *q = u + g * UNPACKED_GROUP;
        for (int b = 0; b < 4; b++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(p + 64 * b));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(p + 64 * b + 32));
            _mm256_store_si256((__m256i *)(q + 128 * b), _mm256_and_si256(v0, nibble));
            _mm256_store_si256((__m256i *)(q + 128 * b + 32), _mm256_and_si256(v1, nibble));
            _mm256_store_si256((__m256i *)(q + 128 * b + 64), _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble));
            _mm256_store_si256((__m256i *)(q + 128 * b + 96), _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble));
        }
        for (int i = 0; i < 4; i++) _mm256_store_ps((float *)(q + 512 + 32 * i), load_bf16x8_bytes(p + 256 + 16 * i));
    }
}

/* int4_rows_both_halves from an unpacked tile, R <= UNPACKED_PASS rows; it prefetches the next
 * packed tile (`next`), which the next unpacking then finds in cache. */
static inline __attribute__((always_inline)) void int4_rows_unpacked(
    const uint8_t *u, const uint8_t *next, int64_t groups, const int8_t *xq, const struct group_consts *gc,
    int64_t k, const int R, __m256 *lo, __m256 *hi) {
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *q = u + g * UNPACKED_GROUP;
        for (int64_t line = 0; line < 320; line += 64) _mm_prefetch((const char *)next + g * 320 + line, _MM_HINT_T0);
        const int8_t *xg = xq + g * GROUP;
        __m256i s0[UNPACKED_PASS], s1[UNPACKED_PASS];
        for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm256_setzero_si256();
        for (int b = 0; b < 4; b++) {
            const __m256i l0 = _mm256_load_si256((const __m256i *)(q + 128 * b));
            const __m256i l1 = _mm256_load_si256((const __m256i *)(q + 128 * b + 32));
            const __m256i h0 = _mm256_load_si256((const __m256i *)(q + 128 * b + 64));
            const __m256i h1 = _mm256_load_si256((const __m256i *)(q + 128 * b + 96));
            int4_block_rows(s0, s1, l0, l1, h0, h1, xg + 8 * b, k, R);
        }
        int4_group_scale(s0, s1, _mm256_load_ps((const float *)(q + 512)), _mm256_load_ps((const float *)(q + 544)),
                         _mm256_load_ps((const float *)(q + 576)), _mm256_load_ps((const float *)(q + 608)), gc, groups,
                         g, R, lo, hi);
    }
}

/* acc[r] of R <= UNPACKED_PASS rows against an unpacked int4 tile */
static inline __attribute__((always_inline)) void unpacked_rows(const uint8_t *u, const uint8_t *next, int64_t groups,
                                                               const int8_t *xq, const struct group_consts *gc,
                                                               int64_t k, const int R, vf *acc) {
    __m256 lo[UNPACKED_PASS], hi[UNPACKED_PASS];
    int4_rows_unpacked(u, next, groups, xq, gc, k, R, lo, hi);
    for (int r = 0; r < R; r++) acc[r] = (vf){lo[r], hi[r]};
}

static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *tile, int first, int64_t next_ahead, int bits, int64_t groups, const int8_t *xq,
    const struct group_consts *gc, int64_t k, const int R, vf *acc) {
    if (bits == 4) { /* rows in one or two balanced passes of at most 3 */
        const int rows1 = R <= 3 ? R : (R + 1) / 2, rows2 = R - rows1;
        __m256 lo[3], hi[3];
        if (first) int4_rows_both_halves(tile, PREFETCH_BYTES, groups, xq, gc, k, rows1, lo, hi);
        else int4_rows_both_halves(tile, next_ahead, groups, xq, gc, k, rows1, lo, hi);
        for (int r = 0; r < rows1; r++) acc[r] = (vf){lo[r], hi[r]};
        if (rows2 > 0) {
            int4_rows_both_halves(tile, next_ahead, groups, xq + rows1 * k, gc + rows1 * groups, k, rows2, lo, hi);
            for (int r = 0; r < rows2; r++) acc[rows1 + r] = (vf){lo[r], hi[r]};
        }
        return;
    }
    for (int h = 0; h < 2; h++) { /* int8: a pass per half */
        const int64_t ahead = first && h == 0 ? PREFETCH_BYTES : next_ahead;
        __m256 out[MAX_ROWS];
        for (int r = 0; r < R; r++) out[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *p = tile + g * 544;
            for (int64_t line = 0; line < 544; line += 64) _mm_prefetch((const char *)p + ahead + line, _MM_HINT_T0);
            __m256i isum[MAX_ROWS];
            dot_int8(p + 32 * h, xq + g * GROUP, k, gc + g, groups, R, isum);
            const __m256 step = bits == SPECDEC_TILE_Q8_0 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 512 + 16 * h)))
                                                          : load_bf16x8_bytes(p + 512 + 16 * h); /* int8, Q8_0 */
            for (int r = 0; r < R; r++) {
                const struct group_consts *c = &gc[r * groups + g];
                __m256 t = _mm256_fmsub_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(c->scale),
                                           _mm256_set1_ps(c->int8_offset));
                out[r] = _mm256_fmadd_ps(step, t, out[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            if (h == 0) acc[r].lo = out[r];
            else acc[r].hi = out[r];
        }
    }
}

#else
#error "qgemm needs AVX-512 VNNI, or AVX2 with FMA (optionally AVX-VNNI)"
#endif
