/* 16-lane fp32 vectors for specdec's C kernels: one source for every instruction-set level.
 *
 * Built with AVX-512 (the avx512-vnni level) a `vf` is one zmm; built with AVX2 + FMA (the avx2
 * and avx-vnni levels) it is a pair of ymm, lanes 0-7 and 8-15. Every operation is lane-wise IEEE
 * (add, mul, fma, div, max, conversions, bf16 rounding) or a reduction in one fixed tree, and
 * `vf_exp` is one polynomial with one 2^n, so a kernel written on `vf` computes bitwise the same
 * result at every level: the AVX2 path gives the tokens the AVX-512 path gives.
 *
 * `specdec.native` puts this folder on the include path and keys every build on this header.
 */
#ifndef SPECDEC_SIMD_H
#define SPECDEC_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* Lanes 0..7 summed as (((0+4)+(2+6)) + ((1+5)+(3+7))): the second half of every reduction. */
static inline float reduce_add8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

static inline float reduce_max8(__m256 v) {
    __m128 a = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
}

/* fp32 bits -> the same bits rounded to the nearest bf16 (even on ties) in the top 16, as torch. */
#define BF16_ROUND_BITS(u, SET1, ADD, AND, SRLI) \
    ADD(u, ADD(AND(SRLI(u, 16), SET1(1)), SET1(0x7FFF)))

#if defined(__AVX512F__)

typedef __m512 vf;

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_halves(__m256 lo, __m256 hi) { return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  /* a * b + c */
static inline vf vf_fmsub(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }  /* a * b - c */
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a * b */
static inline vf vf_round(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_ldexp(vf p, vf n) { return _mm512_scalef_ps(p, n); } /* p * 2^n, n integral */

static inline float vf_reduce_add(vf v) {
    return reduce_add8(_mm256_add_ps(_mm512_castps512_ps256(v),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

static inline float vf_reduce_max(vf v) {
    return reduce_max8(_mm256_max_ps(_mm512_castps512_ps256(v),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

/* 16 bf16 values at p -> fp32 (exact). */
static inline vf vf_load_bf16(const uint16_t *p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

/* 16 fp16 values at p -> fp32 (exact, subnormals too). */
static inline vf vf_load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* fp32 -> nearest bf16, kept in fp32. */
static inline vf vf_round_bf16(vf v) {
    __m512i u = _mm512_castps_si512(v);
    u = BF16_ROUND_BITS(u, _mm512_set1_epi32, _mm512_add_epi32, _mm512_and_si512, _mm512_srli_epi32);
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* fp32 -> nearest bf16, 16 values stored at p. */
static inline void vf_store_bf16(uint16_t *p, vf v) {
    __m512i u = _mm512_castps_si512(v);
    u = BF16_ROUND_BITS(u, _mm512_set1_epi32, _mm512_add_epi32, _mm512_and_si512, _mm512_srli_epi32);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

#else /* AVX2 + FMA: two ymm */

typedef struct {
    __m256 lo, hi;
} vf;

#define VF1(f, a) ((vf){f((a).lo), f((a).hi)})
#define VF2(f, a, b) ((vf){f((a).lo, (b).lo), f((a).hi, (b).hi)})
#define VF3(f, a, b, c) ((vf){f((a).lo, (b).lo, (c).lo), f((a).hi, (b).hi, (c).hi)})

static inline __m256 round8(__m256 v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

static inline vf vf_zero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf vf_halves(__m256 lo, __m256 hi) { return (vf){lo, hi}; } /* lanes 0-7, 8-15 */
static inline vf vf_set1(float a) { return (vf){_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
static inline vf vf_load(const float *p) { return (vf){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline vf vf_add(vf a, vf b) { return VF2(_mm256_add_ps, a, b); }
static inline vf vf_sub(vf a, vf b) { return VF2(_mm256_sub_ps, a, b); }
static inline vf vf_mul(vf a, vf b) { return VF2(_mm256_mul_ps, a, b); }
static inline vf vf_div(vf a, vf b) { return VF2(_mm256_div_ps, a, b); }
static inline vf vf_max(vf a, vf b) { return VF2(_mm256_max_ps, a, b); }
static inline vf vf_min(vf a, vf b) { return VF2(_mm256_min_ps, a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return VF3(_mm256_fmadd_ps, a, b, c); }
static inline vf vf_fmsub(vf a, vf b, vf c) { return VF3(_mm256_fmsub_ps, a, b, c); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return VF3(_mm256_fnmadd_ps, a, b, c); }
static inline vf vf_round(vf v) { return VF1(round8, v); }

/* p * 2^n for integral n in -126..128 with one rounding, as AVX-512's scalef: 2^n is split in two
 * normal halves, and p * 2^(n/2) is exact for p in vf_exp's range. */
static inline __m256 ldexp8(__m256 p, __m256 n) {
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), rest = _mm256_sub_epi32(ni, half);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}
static inline vf vf_ldexp(vf p, vf n) { return VF2(ldexp8, p, n); }

static inline float vf_reduce_add(vf v) { return reduce_add8(_mm256_add_ps(v.lo, v.hi)); }
static inline float vf_reduce_max(vf v) { return reduce_max8(_mm256_max_ps(v.lo, v.hi)); }

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
static inline vf vf_load_bf16(const uint16_t *p) { return (vf){load_bf16x8(p), load_bf16x8(p + 8)}; }
static inline vf vf_load_f16(const uint16_t *p) {
    return (vf){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}

static inline __m256i bf16_bits8(__m256 v) { /* the rounded bf16 in the top half of each lane */
    __m256i u = _mm256_castps_si256(v);
    return BF16_ROUND_BITS(u, _mm256_set1_epi32, _mm256_add_epi32, _mm256_and_si256, _mm256_srli_epi32);
}
static inline __m256 round_bf16x8(__m256 v) {
    return _mm256_castsi256_ps(_mm256_and_si256(bf16_bits8(v), _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline vf vf_round_bf16(vf v) { return VF1(round_bf16x8, v); }

static inline void vf_store_bf16(uint16_t *p, vf v) {
    const __m256i lo = _mm256_srli_epi32(bf16_bits8(v.lo), 16), hi = _mm256_srli_epi32(bf16_bits8(v.hi), 16);
    /* packus interleaves 128-bit lanes (lo0 hi0 lo1 hi1): put them back in order */
    _mm256_storeu_si256((__m256i *)p, _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8));
}

#endif

/* e^x (Cephes expf: x = n ln2 + r, e^r by a degree-6 polynomial, times 2^n); relative error
 * ~2e-7, e^-87 below -87, inf above ~88.7 (x is held to 89 first, where e^x is already inf,
 * so that 2^n stays in vf_ldexp's range). */
static inline vf vf_exp(vf x) {
    x = vf_min(vf_max(x, vf_set1(-87.0f)), vf_set1(89.0f));
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693359375f), x);
    r = vf_fnmadd(n, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fmadd(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fmadd(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fmadd(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fmadd(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fmadd(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fmadd(p, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    return vf_ldexp(p, n);
}

/* Element i of a buffer of bf16 (flag set) or fp32 values, as fp32; and 16 of them from i on. */
static inline float load_float(const void *p, int bf16, int64_t i) {
    if (bf16) {
        uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        __builtin_memcpy(&f, &u, 4);
        return f;
    }
    return ((const float *)p)[i];
}

static inline vf load_floats(const void *p, int bf16, int64_t i) {
    return bf16 ? vf_load_bf16((const uint16_t *)p + i) : vf_load((const float *)p + i);
}

/* One fp32 value rounded to bf16 (to nearest even, as torch casts), as bits and as fp32. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float rounded_bf16(float f) {
    const uint16_t b = to_bf16(f);
    return load_float(&b, 1, 0);
}

#endif
