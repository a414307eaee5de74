/* Decode/verify attention over a paged bf16 KV cache on the CPU, in one call per layer.
 *
 * For a flat batch of query windows (the layout of `AttentionMetadata`), `rope_write_attend`:
 *   1. rotates each row's query and key heads in place by the row's position (optional: neox
 *      layout, `x * cos + swap_halves(x) * signed_sin`, rounded to bf16 after each product and the
 *      sum, exactly as `apply_rope` does in bf16);
 *   2. writes each row's key and value heads into its cache slot;
 *   3. attends: query row i of sequence b sits at position seq_len_b - query_len_b + i and sees
 *      keys 0..that position, read in place through the block table (nothing gathered or padded).
 *
 * Attention runs in fp32 with an online softmax over chunks of 16 keys (one AVX-512 exp per
 * chunk) and rounds the output to bf16. Each (query row, query head) is one work item computed by
 * one thread in a fixed order, so a row's result does not depend on what else is in the batch:
 * verifying k+1 rows gives bitwise the rows that k+1 single-row steps give.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "avx512_common.h"
#include "kernel_abi.h"

#define KEYS 16 /* keys per softmax chunk: one zmm of scores */

static inline __m512 round_bf16(__m512 v) { /* fp32 -> nearest bf16, kept in fp32 */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* Rotate `heads` heads of `d` bf16 values at x in place (neox halves), as apply_rope does in bf16. */
static void rope_heads(uint16_t *x, int64_t heads, int64_t d, const float *cos, const float *sin) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *v = x + h * d;
        for (int64_t i = 0; i < half; i += 16) { /* lanes i.. of both halves at once */
            const __m512 x1 = bf16x16_to_fp32(v + i), x2 = bf16x16_to_fp32(v + half + i);
            const __m512 c1 = round_bf16(_mm512_loadu_ps(cos + i));
            const __m512 c2 = round_bf16(_mm512_loadu_ps(cos + half + i));
            const __m512 s1 = round_bf16(_mm512_loadu_ps(sin + i));
            const __m512 s2 = round_bf16(_mm512_loadu_ps(sin + half + i));
            const __m512 y1 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, c1)), round_bf16(_mm512_mul_ps(x2, s1)));
            const __m512 y2 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c2)), round_bf16(_mm512_mul_ps(x1, s2)));
            _mm256_storeu_si256((__m256i *)(v + i), fp32x16_to_bf16(y1));
            _mm256_storeu_si256((__m256i *)(v + half + i), fp32x16_to_bf16(y2));
        }
    }
}

/* One query head q[d] (fp32) against keys 0..num_keys-1 of one KV head; out[d] = softmax . V. */
static void attend_one(const float *q, int64_t num_keys, int64_t d, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int32_t *blocks, int64_t block_size,
                       int64_t slot_stride, float scale, float *acc, uint16_t *out) {
    const int64_t vecs = d / 16;
    float max = -INFINITY, sum = 0.0f;
    for (int64_t v = 0; v < vecs; v++) _mm512_storeu_ps(acc + 16 * v, _mm512_setzero_ps());
    for (int64_t j0 = 0; j0 < num_keys; j0 += KEYS) {
        const int64_t n = num_keys - j0 < KEYS ? num_keys - j0 : KEYS;
        int64_t offs[KEYS];
        float s[KEYS];
        for (int64_t j = 0; j < n; j++) {
            const int64_t key = j0 + j;
            offs[j] = ((int64_t)blocks[key / block_size] * block_size + key % block_size) * slot_stride;
            const uint16_t *kp = k_cache + offs[j];
            __m512 dot = _mm512_setzero_ps();
            for (int64_t v = 0; v < vecs; v++)
                dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * v), bf16x16_to_fp32(kp + 16 * v), dot);
            s[j] = _mm512_reduce_add_ps(dot) * scale;
        }
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, s);
        const float chunk_max = _mm512_reduce_max_ps(sv);
        const float new_max = chunk_max > max ? chunk_max : max;
        const float rescale = max == -INFINITY ? 0.0f : expf(max - new_max);
        const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(new_max))));
        _mm512_storeu_ps(s, p);
        sum = sum * rescale + _mm512_reduce_add_ps(p);
        max = new_max;
        for (int64_t v = 0; v < vecs; v++) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * v), _mm512_set1_ps(rescale));
            for (int64_t j = 0; j < n; j++)
                a = _mm512_fmadd_ps(_mm512_set1_ps(s[j]), bf16x16_to_fp32(v_cache + offs[j] + 16 * v), a);
            _mm512_storeu_ps(acc + 16 * v, a);
        }
    }
    const __m512 inv = _mm512_set1_ps(sum > 0.0f ? 1.0f / sum : 0.0f);
    for (int64_t v = 0; v < vecs; v++)
        _mm256_storeu_si256((__m256i *)(out + 16 * v), fp32x16_to_bf16(_mm512_mul_ps(_mm512_loadu_ps(acc + 16 * v), inv)));
}

/* Checks the sizes and indices before anything is read or written: SPECDEC_OK when they are all
 * in range, else the status saying what is not (SPECDEC_ERR_INVALID_ARGUMENT: head sizes the
 * kernel does not take or a missing buffer). */
static int check(const struct specdec_attention *a, const uint16_t *qkv, int64_t row_stride,
                 const uint16_t *k_cache, const uint16_t *v_cache, const uint16_t *out) {
    if (!qkv || !k_cache || !v_cache || !out || !a->slots || !a->block_tables || !a->seq_lens ||
        !a->query_start_loc || (a->positions && (!a->cos || !a->signed_sin)) || a->d <= 0 ||
        a->d % 32 || a->d > SPECDEC_MAX_HEAD_DIM || a->hq <= 0 || a->hkv <= 0 || a->hq % a->hkv ||
        row_stride < (a->hq + 2 * a->hkv) * a->d || a->num_seqs < 0 || a->block_size <= 0)
        return SPECDEC_ERR_INVALID_ARGUMENT;
    const int32_t *query_start_loc = a->query_start_loc, *seq_lens = a->seq_lens;
    if (query_start_loc[0] != 0) return SPECDEC_ERR_LENGTHS;
    for (int64_t b = 0; b < a->num_seqs; b++) {
        const int64_t query_len = query_start_loc[b + 1] - query_start_loc[b];
        if (query_len < 0 || query_len > seq_lens[b] || seq_lens[b] > a->max_blocks * a->block_size)
            return SPECDEC_ERR_LENGTHS;
        for (int64_t i = 0; i < (seq_lens[b] + a->block_size - 1) / a->block_size; i++) {
            const int32_t block = a->block_tables[b * a->max_blocks + i];
            if (block < 0 || block >= a->num_blocks) return SPECDEC_ERR_BLOCK;
        }
    }
    for (int64_t t = 0; t < query_start_loc[a->num_seqs]; t++) {
        if (a->positions && (a->positions[t] < 0 || a->positions[t] >= a->num_positions)) return SPECDEC_ERR_POSITION;
        if (a->slots[t] < 0 || a->slots[t] >= a->num_slots) return SPECDEC_ERR_SLOT;
    }
    return SPECDEC_OK;
}

/* qkv [T, row_stride] bf16 holds each row's q (a->hq heads), k (a->hkv heads) and v (a->hkv heads)
 * of head_dim a->d (a multiple of 32, at most SPECDEC_MAX_HEAD_DIM); q and k are rotated in place
 * unless a->positions is NULL (a->cos and a->signed_sin are fp32 [num_positions, d] tables indexed
 * by positions [T]). Caches are bf16 [num_slots, hkv, d]; a->slots [T] is each row's slot;
 * block_tables [B, max_blocks], seq_lens [B] and query_start_loc [B+1] are int32. out [T, hq * d]
 * bf16. Returns SPECDEC_OK, or the status of `check`. */
int rope_write_attend(const struct specdec_attention *a, uint16_t *qkv, int64_t row_stride,
                      uint16_t *k_cache, uint16_t *v_cache, float scale, uint16_t *out, int threads) {
    const int rc = check(a, qkv, row_stride, k_cache, v_cache, out);
    if (rc != SPECDEC_OK) return rc;
    const int64_t *positions = a->positions, *slots = a->slots;
    const float *cos = a->cos, *signed_sin = a->signed_sin;
    const int32_t *block_tables = a->block_tables, *seq_lens = a->seq_lens, *query_start_loc = a->query_start_loc;
    const int64_t max_blocks = a->max_blocks, num_seqs = a->num_seqs, block_size = a->block_size;
    const int64_t hq = a->hq, hkv = a->hkv, d = a->d;
    const int64_t num_rows = query_start_loc[num_seqs];
    const int64_t kv_width = hkv * d;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_rows; t++) {
            uint16_t *row = qkv + t * row_stride;
            if (positions) {
                const float *c = cos + positions[t] * d, *s = signed_sin + positions[t] * d;
                rope_heads(row, hq + hkv, d, c, s);
            }
            memcpy(k_cache + slots[t] * kv_width, row + hq * d, (size_t)kv_width * 2);
            memcpy(v_cache + slots[t] * kv_width, row + (hq + hkv) * d, (size_t)kv_width * 2);
        }
        /* implicit barrier: every key of this step is in the cache before anyone attends */
        float q[SPECDEC_MAX_HEAD_DIM], acc[SPECDEC_MAX_HEAD_DIM]; /* checked: d <= SPECDEC_MAX_HEAD_DIM */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_rows * hq; item++) {
            const int64_t t = item / hq, h = item % hq;
            int64_t b = 0;
            while (query_start_loc[b + 1] <= t) b++;
            const int64_t query_len = query_start_loc[b + 1] - query_start_loc[b];
            const int64_t num_keys = seq_lens[b] - query_len + (t - query_start_loc[b]) + 1;
            const uint16_t *qp = qkv + t * row_stride + h * d;
            for (int64_t v = 0; v < d / 16; v++) _mm512_storeu_ps(q + 16 * v, bf16x16_to_fp32(qp + 16 * v));
            const int64_t kv_head = h / (hq / hkv);
            attend_one(q, num_keys, d, k_cache + kv_head * d, v_cache + kv_head * d,
                       block_tables + b * max_blocks, block_size, kv_width, scale, acc,
                       out + t * hq * d + h * d);
        }
    }
    return SPECDEC_OK;
}
