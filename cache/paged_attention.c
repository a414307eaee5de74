/* Attention over a paged bf16 KV cache on the CPU, in one call per layer: decode and verify
 * windows and prompt chunks alike.
 *
 * For a flat batch of query windows (the layout of `AttentionMetadata`), `rope_write_attend`:
 *   1. rotates each row's query and key heads in place by the row's position (optional: neox
 *      layout, `x * cos + swap_halves(x) * signed_sin`, rounded to bf16 after each product and the
 *      sum, exactly as `apply_rope` does in bf16);
 *   2. writes each row's key and value heads into its cache slot;
 *   3. attends: query row i of sequence b sits at position seq_len_b - query_len_b + i and sees
 *      keys 0..that position, read in place through the block table (nothing gathered or padded);
 *      with a->tree_masks (a token tree's window), of the window's keys only those whose bit is
 *      set in the row's mask (its ancestors and itself), read as one run after the prefix's, so
 *      a tree node's row is bitwise its path's row fed as a chain.
 *
 * Attention runs in fp32 with an online softmax over chunks of 16 keys (one 16-lane exp per
 * chunk) and rounds the output to bf16. Written on `simd.h`'s 16-lane vectors, so the AVX-512
 * and AVX2 builds compute bitwise the same. A work item is one query row and a group of the query
 * heads that share a KV head (GQA), computed by one thread in a fixed order: each key and value
 * is read (and widened to fp32) once for the whole group, while every head's arithmetic is the
 * one it would get alone, in the same order. So neither the grouping (chosen by the row count
 * and threads) nor what else is in the batch changes a bit of a row's result: verifying k+1 rows
 * gives bitwise the rows that k+1 single-row steps give, and a prompt prefilled in any chunks
 * gives bitwise the rows it gets in one.
 *
 * `latent_attend` is the same attention for multi-head latent attention's absorbed path: one KV
 * "head" per token, the latent (rank + rope wide), whose first dv values are the values; every
 * query head shares it (MQA), so a work item reads each latent once for up to GROUP_MAX heads.
 * The step's latents are already in the cache (the model writes them); nothing is rotated here.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernel_abi.h"
#include "simd.h"

#define KEYS 16 /* keys per softmax chunk: one zmm of scores */
#define GROUP_MAX 8 /* query heads attended together over one read of their KV head */
#define PREFETCH_KEYS 8 /* how far ahead a key row is prefetched */
#define KEY_MAX (SPECDEC_MAX_LATENT_DIM > SPECDEC_MAX_HEAD_DIM ? SPECDEC_MAX_LATENT_DIM : SPECDEC_MAX_HEAD_DIM)

/* Rotate `heads` heads of `d` bf16 values at x in place (neox halves), as apply_rope does in bf16. */
static void rope_heads(uint16_t *x, int64_t heads, int64_t d, const float *cos, const float *sin) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *v = x + h * d;
        for (int64_t i = 0; i < half; i += 16) { /* lanes i.. of both halves at once */
            const vf x1 = vf_load_bf16(v + i), x2 = vf_load_bf16(v + half + i);
            const vf c1 = vf_round_bf16(vf_load(cos + i)), c2 = vf_round_bf16(vf_load(cos + half + i));
            const vf s1 = vf_round_bf16(vf_load(sin + i)), s2 = vf_round_bf16(vf_load(sin + half + i));
            const vf y1 = vf_add(vf_round_bf16(vf_mul(x1, c1)), vf_round_bf16(vf_mul(x2, s1)));
            const vf y2 = vf_add(vf_round_bf16(vf_mul(x2, c2)), vf_round_bf16(vf_mul(x1, s2)));
            vf_store_bf16(v + i, y1);
            vf_store_bf16(v + half + i, y2);
        }
    }
}

/* `g` query heads q[g][dk] (fp32) sharing one KV head against its keys 0..num_keys-1; head h's
 * softmax . V (dv wide) goes to out + h * dv. Each key and value is widened once for the g heads;
 * each head's operations are those of a lone head, in the same order (one head: g = 1). The heads
 * are the innermost loop, on accumulators that stay in registers for a constant g (`attend_group`
 * instantiates one body per g): independent FMA chains, not one head's latency-bound chain after
 * another. */
static inline __attribute__((always_inline)) void attend_heads(
        const float *q, const int64_t g, int64_t num_keys, int64_t dk, int64_t dv, const uint16_t *k_cache,
        const uint16_t *v_cache, const int32_t *blocks, int64_t block_size, int64_t slot_stride, float scale,
        const int use_tree, int64_t tree_start, uint64_t tree, float *acc, uint16_t *out) {
    const int64_t kvecs = dk / 16, vecs = dv / 16, d = dv; /* acc and out rows are dv wide */
    float max[GROUP_MAX], sum[GROUP_MAX], rescale[GROUP_MAX], s[GROUP_MAX][KEYS];
    vf a[GROUP_MAX], dot[GROUP_MAX];
    for (int64_t h = 0; h < g; h++) {
        max[h] = -INFINITY;
        sum[h] = 0.0f;
        for (int64_t v = 0; v < vecs; v++) vf_store(acc + h * d + 16 * v, vf_zero());
    }
    /* A token tree's row sees the prefix (keys 0..tree_start-1) and, of the window, only its
     * ancestors and itself: those keys are read in order as ONE run of keys (`rows`: their window
     * rows), so a node's arithmetic is exactly that of its path fed as a chain (same keys, same
     * chunks of 16, same lanes), and a tree's greedy tokens are the chain's bitwise. */
    int64_t rows[64], prefix = num_keys;
    if (use_tree) {
        const int64_t window = num_keys - tree_start; /* the row's window row + 1 (<= 64) */
        uint64_t bits = window >= 64 ? tree : tree & ((UINT64_C(1) << window) - 1);
        int64_t seen = 0;
        for (; bits; bits &= bits - 1) rows[seen++] = __builtin_ctzll(bits);
        prefix = tree_start;
        num_keys = tree_start + seen;
    }
    int64_t block = 0, in_block = 0; /* key j0 + j's block table entry and slot in it (prefix keys) */
    int64_t ahead = 0, ahead_block = 0, ahead_in_block = 0; /* the key PREFETCH_KEYS on, likewise */
    for (; ahead < prefix && ahead < PREFETCH_KEYS; ahead++)
        if (++ahead_in_block == block_size) ahead_in_block = 0, ahead_block++;
    for (int64_t j0 = 0; j0 < num_keys; j0 += KEYS) {
        const int64_t n = num_keys - j0 < KEYS ? num_keys - j0 : KEYS;
        int64_t offs[KEYS];
        for (int64_t j = 0; j < n; j++) {
            if (!use_tree || j0 + j < prefix) {
                offs[j] = ((int64_t)blocks[block] * block_size + in_block) * slot_stride;
                if (++in_block == block_size) in_block = 0, block++;
            } else { /* a tree's window key: the position of its window row */
                const int64_t pos = tree_start + rows[j0 + j - prefix];
                offs[j] = ((int64_t)blocks[pos / block_size] * block_size + pos % block_size) * slot_stride;
            }
            /* Rows scattered over blocks, read once: the value row for this chunk's P.V, and the
             * key row PREFETCH_KEYS on, are asked for now rather than waited for. */
            for (int64_t o = 0; o < dv; o += 32) __builtin_prefetch(v_cache + offs[j] + o);
            if (ahead < prefix) {
                const uint16_t *next = k_cache + ((int64_t)blocks[ahead_block] * block_size + ahead_in_block) * slot_stride;
                for (int64_t o = 0; o < dk; o += 32) __builtin_prefetch(next + o);
                if (++ahead_in_block == block_size) ahead_in_block = 0, ahead_block++;
                ahead++;
            }
            const uint16_t *key = k_cache + offs[j];
            for (int64_t h = 0; h < g; h++) dot[h] = vf_zero();
            for (int64_t v = 0; v < kvecs; v++) {
                const vf kv = vf_load_bf16(key + 16 * v); /* exact */
                for (int64_t h = 0; h < g; h++) dot[h] = vf_fmadd(vf_load(q + h * dk + 16 * v), kv, dot[h]);
            }
            for (int64_t h = 0; h < g; h++) s[h][j] = vf_reduce_add(dot[h]) * scale;
        }
        for (int64_t h = 0; h < g; h++) {
            for (int64_t j = n; j < KEYS; j++) s[h][j] = -INFINITY; /* a short last chunk */
            const vf sv = vf_load(s[h]);
            const float chunk_max = vf_reduce_max(sv);
            const float new_max = chunk_max > max[h] ? chunk_max : max[h];
            rescale[h] = max[h] == -INFINITY ? 0.0f : expf(max[h] - new_max);
            vf_store(s[h], vf_exp(vf_sub(sv, vf_set1(new_max))));
            for (int64_t j = n; j < KEYS; j++) s[h][j] = 0.0f; /* e^-inf: vf_exp holds its input to -87 */
            sum[h] = sum[h] * rescale[h] + vf_reduce_add(vf_load(s[h]));
            max[h] = new_max;
        }
        for (int64_t v = 0; v < vecs; v++) {
            for (int64_t h = 0; h < g; h++) a[h] = vf_mul(vf_load(acc + h * d + 16 * v), vf_set1(rescale[h]));
            for (int64_t j = 0; j < n; j++) {
                const vf value = vf_load_bf16(v_cache + offs[j] + 16 * v);
                for (int64_t h = 0; h < g; h++) a[h] = vf_fmadd(vf_set1(s[h][j]), value, a[h]);
            }
            for (int64_t h = 0; h < g; h++) vf_store(acc + h * d + 16 * v, a[h]);
        }
    }
    for (int64_t h = 0; h < g; h++) {
        const vf inv = vf_set1(sum[h] > 0.0f ? 1.0f / sum[h] : 0.0f);
        for (int64_t v = 0; v < vecs; v++) vf_store_bf16(out + h * d + 16 * v, vf_mul(vf_load(acc + h * d + 16 * v), inv));
    }
}

/* attend_heads with g (1..GROUP_MAX) a constant in each body. */
static void attend_group(const float *q, int64_t g, int64_t num_keys, int64_t dk, int64_t dv,
                         const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *blocks,
                         int64_t block_size, int64_t slot_stride, float scale, int64_t tree_start, uint64_t tree,
                         float *acc, uint16_t *out) {
/* a body per g, and per window kind: causal (tree all ones: no mask code at all) or a tree */
#define ATTEND_HEADS(G, TREE) \
    case G: attend_heads(q, G, num_keys, dk, dv, k_cache, v_cache, blocks, block_size, slot_stride, scale, \
                         TREE, tree_start, tree, acc, out); break
    if (tree == ~(uint64_t)0) {
        switch (g) {
            ATTEND_HEADS(1, 0); ATTEND_HEADS(2, 0); ATTEND_HEADS(3, 0); ATTEND_HEADS(4, 0);
            ATTEND_HEADS(5, 0); ATTEND_HEADS(6, 0); ATTEND_HEADS(7, 0); ATTEND_HEADS(8, 0);
        }
    } else {
        switch (g) {
            ATTEND_HEADS(1, 1); ATTEND_HEADS(2, 1); ATTEND_HEADS(3, 1); ATTEND_HEADS(4, 1);
            ATTEND_HEADS(5, 1); ATTEND_HEADS(6, 1); ATTEND_HEADS(7, 1); ATTEND_HEADS(8, 1);
        }
    }
#undef ATTEND_HEADS
}

/* Query heads a work item takes together: the most (a divisor of the group, at most GROUP_MAX)
 * that still leave every thread an item. Results do not depend on it. */
static int64_t heads_per_item(int64_t group, int64_t row_heads, int threads) {
    for (int64_t g = group < GROUP_MAX ? group : GROUP_MAX; g > 1; g--)
        if (group % g == 0 && row_heads * (group / g) >= threads) return g;
    return 1;
}

/* Each sequence's lengths against its block table and the table's entries against the cache:
 * SPECDEC_OK, SPECDEC_ERR_LENGTHS or SPECDEC_ERR_BLOCK (both kernels' checks end with it). */
static int check_sequences(const struct specdec_attention *a) {
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
    return SPECDEC_OK;
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
    const int rc = check_sequences(a);
    if (rc != SPECDEC_OK) return rc;
    for (int64_t t = 0; t < a->query_start_loc[a->num_seqs]; t++) {
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
    const int64_t g = heads_per_item(hq / hkv, num_rows * hkv, threads), items_per_row = hq / g;
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
        /* checked: d <= SPECDEC_MAX_HEAD_DIM; g <= GROUP_MAX */
        float q[GROUP_MAX * SPECDEC_MAX_HEAD_DIM], acc[GROUP_MAX * SPECDEC_MAX_HEAD_DIM];
#pragma omp for schedule(static, 1) /* interleaved: a prompt chunk's later rows see more keys */
        for (int64_t item = 0; item < num_rows * items_per_row; item++) {
            const int64_t t = item / items_per_row, h = item % items_per_row * g; /* heads h..h+g-1 */
            int64_t b = 0;
            while (query_start_loc[b + 1] <= t) b++;
            const int64_t query_len = query_start_loc[b + 1] - query_start_loc[b];
            const int64_t num_keys = seq_lens[b] - query_len + (t - query_start_loc[b]) + 1;
            const uint16_t *qp = qkv + t * row_stride + h * d;
            for (int64_t v = 0; v < g * d / 16; v++) vf_store(q + 16 * v, vf_load_bf16(qp + 16 * v));
            const int64_t kv_head = h / (hq / hkv);
            attend_group(q, g, num_keys, d, d, k_cache + kv_head * d, v_cache + kv_head * d,
                         block_tables + b * max_blocks, block_size, kv_width, scale, seq_lens[b] - query_len,
                         a->tree_masks ? (uint64_t)a->tree_masks[t] : ~(uint64_t)0, acc, out + t * hq * d + h * d);
        }
    }
    return SPECDEC_OK;
}

/* Checks latent_attend's sizes and indices as `check` does rope_write_attend's. */
static int check_latent(const struct specdec_attention *a, const uint16_t *q, const uint16_t *cache, int64_t dv,
                        const uint16_t *out) {
    if (!q || !cache || !out || !a->block_tables || !a->seq_lens || !a->query_start_loc || a->d <= 0 ||
        a->d % 16 || a->d > SPECDEC_MAX_LATENT_DIM || dv <= 0 || dv % 16 || dv > a->d || dv > SPECDEC_MAX_HEAD_DIM ||
        a->hq <= 0 || a->hkv != 1 || a->num_seqs < 0 || a->block_size <= 0)
        return SPECDEC_ERR_INVALID_ARGUMENT;
    return check_sequences(a);
}

/* q [T, hq, d] bf16 (d = a->d: latent rank + rope, a multiple of 16 up to SPECDEC_MAX_LATENT_DIM)
 * attends over the cache's latents bf16 [num_slots, d] (a->hkv = 1) as keys and their first dv
 * values (a multiple of 16, at most SPECDEC_MAX_HEAD_DIM) as values, row t of sequence b seeing
 * keys 0..seq_len_b - query_len_b + (t - start_b). out [T, hq, dv] bf16. Returns SPECDEC_OK, or
 * the status of `check_latent`. */
int latent_attend(const struct specdec_attention *a, const uint16_t *q, const uint16_t *cache, int64_t dv,
                  float scale, uint16_t *out, int threads) {
    const int rc = check_latent(a, q, cache, dv, out);
    if (rc != SPECDEC_OK) return rc;
    const int32_t *block_tables = a->block_tables, *seq_lens = a->seq_lens, *query_start_loc = a->query_start_loc;
    const int64_t max_blocks = a->max_blocks, num_seqs = a->num_seqs, block_size = a->block_size;
    const int64_t hq = a->hq, d = a->d;
    const int64_t num_rows = query_start_loc[num_seqs];
    const int64_t g = heads_per_item(hq, num_rows, threads), items_per_row = hq / g;
#pragma omp parallel num_threads(threads)
    {
        /* checked: d <= SPECDEC_MAX_LATENT_DIM, dv <= SPECDEC_MAX_HEAD_DIM; g <= GROUP_MAX */
        float qf[GROUP_MAX * SPECDEC_MAX_LATENT_DIM], acc[GROUP_MAX * SPECDEC_MAX_HEAD_DIM];
#pragma omp for schedule(static)
        for (int64_t item = 0; item < num_rows * items_per_row; item++) {
            const int64_t t = item / items_per_row, h = item % items_per_row * g; /* heads h..h+g-1 */
            int64_t b = 0;
            while (query_start_loc[b + 1] <= t) b++;
            const int64_t query_len = query_start_loc[b + 1] - query_start_loc[b];
            const int64_t num_keys = seq_lens[b] - query_len + (t - query_start_loc[b]) + 1;
            const uint16_t *qp = q + (t * hq + h) * d;
            for (int64_t v = 0; v < g * d / 16; v++) vf_store(qf + 16 * v, vf_load_bf16(qp + 16 * v));
            attend_group(qf, g, num_keys, d, dv, cache, cache, block_tables + b * max_blocks, block_size, d, scale,
                         seq_lens[b] - query_len, a->tree_masks ? (uint64_t)a->tree_masks[t] : ~(uint64_t)0, acc,
                         out + (t * hq + h) * dv);
        }
    }
    return SPECDEC_OK;
}

/* One row of one head of MLA's per-head products (see head_matmul): acc [n] fp32 = x [k] . W, W bf16
 * [k, n] (transposed 0: acc[:] = sum over i ascending of x[i] * W[i][:]) or [n, k] (transposed 1:
 * acc[j] = dot(x, W[j])). n and k multiples of 16. */
static void head_row(const void *x, int x_bf16, int64_t xi, int64_t k, int64_t n, const uint16_t *wh, int transposed,
                     float *acc) {
    if (!transposed) {
        for (int64_t j = 0; j < n; j += 16) vf_store(acc + j, vf_zero());
        for (int64_t i = 0; i < k; i++) {
            const vf xv = vf_set1(load_float(x, x_bf16, xi + i));
            for (int64_t j = 0; j < n; j += 16) vf_store(acc + j, vf_fmadd(xv, vf_load_bf16(wh + i * n + j), vf_load(acc + j)));
        }
    } else {
        for (int64_t j = 0; j < n; j++) {
            vf dot = vf_zero();
            for (int64_t i = 0; i < k; i += 16) dot = vf_fmadd(load_floats(x, x_bf16, xi + i), vf_load_bf16(wh + j * k + i), dot);
            acc[j] = vf_reduce_add(dot);
        }
    }
}

/* MLA's per-head products around the absorbed attention, one head's weights read once for all
 * the call's rows: out[t][h] = x[t][h] . W[h] with x [T, H, k] and out [T, H, n] (bf16 or fp32 as
 * the flags say) and W bf16, head h's matrix at w + h * w_head_stride:
 *   transposed 0: W[h] is [k, n] (rows of n): out[t][h][:] = sum over i ascending of x[t][h][i] * W[h][i][:]
 *                 (W_UK: q_nope -> the latent query);
 *   transposed 1: W[h] is [n, k] (rows of k): out[t][h][j] = dot(x[t][h][:], W[h][j][:])  (W_UV).
 * fp32 throughout, each row's operations in a fixed order: a row's result does not depend on the
 * other rows. n and k multiples of 16. Returns SPECDEC_OK or SPECDEC_ERR_INVALID_ARGUMENT. */
int head_matmul(const void *x, int x_bf16, int64_t t, int64_t heads, int64_t k, int64_t n, const uint16_t *w,
                int64_t w_head_stride, int transposed, void *out, int out_bf16, int threads) {
    if (!x || !w || !out || t < 0 || heads <= 0 || k <= 0 || n <= 0 || k % 16 || n % 16 || n > SPECDEC_MAX_LATENT_DIM ||
        w_head_stride < k * n)
        return SPECDEC_ERR_INVALID_ARGUMENT;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < heads; h++) {
        float acc[SPECDEC_MAX_LATENT_DIM];
        for (int64_t r = 0; r < t; r++) {
            const int64_t oi = (r * heads + h) * n;
            head_row(x, x_bf16, (r * heads + h) * k, k, n, w + h * w_head_stride, transposed, acc);
            for (int64_t j = 0; j < n; j += 16) {
                if (out_bf16) vf_store_bf16((uint16_t *)out + oi + j, vf_load(acc + j));
                else vf_store((float *)out + oi + j, vf_load(acc + j));
            }
        }
    }
    return SPECDEC_OK;
}

/* x [r] bf16 -> out [r] bf16 rotated by one position's tables (fp32 [r], signed_sin = [-sin, sin]),
 * neox halves, as apply_rope does in bf16 (each product and the sum rounded); with `interleave`,
 * x's pairs (x0, x1), (x2, x3), ... are first laid out as halves [x0, x2, ... | x1, x3, ...]
 * (DeepSeek's rope, as the model's `_deinterleave`). Scalar: any even r. */
static void rope_row(const uint16_t *x, int64_t r, int interleave, const float *cos, const float *signed_sin,
                     uint16_t *out) {
    const int64_t half = r / 2;
    float v[SPECDEC_MAX_HEAD_DIM];
    for (int64_t j = 0; j < half; j++) {
        v[j] = load_float(x, 1, interleave ? 2 * j : j);
        v[half + j] = load_float(x, 1, interleave ? 2 * j + 1 : half + j);
    }
    for (int64_t j = 0; j < r; j++) {
        const float c = rounded_bf16(cos[j]), s = rounded_bf16(signed_sin[j]);
        out[j] = to_bf16(rounded_bf16(v[j] * c) + rounded_bf16(v[j < half ? j + half : j - half] * s));
    }
}

/* The rows' positions (against the rotary tables) and slots (against the cache), for the latent
 * kernels that rotate or write: SPECDEC_OK, SPECDEC_ERR_POSITION or SPECDEC_ERR_SLOT. */
static int check_rows(const struct specdec_attention *a, int64_t num_rows) {
    for (int64_t t = 0; t < num_rows; t++) {
        if (a->positions[t] < 0 || a->positions[t] >= a->num_positions) return SPECDEC_ERR_POSITION;
        if (a->slots[t] < 0 || a->slots[t] >= a->num_slots) return SPECDEC_ERR_SLOT;
    }
    return SPECDEC_OK;
}

/* Multi-head latent attention's cache write: row t of kv_a [T, row_stride] bf16 holds the latent c
 * (rank = a->d - rope_dim) and the key's rope part (rope_dim); its slot gets [rmsnorm(c) | rope(k)]:
 * c normalised in fp32 (x * 1 / sqrt(mean(x^2) + eps)), rounded to bf16, times the weight [rank]
 * (bf16 or fp32, norm_bf16) and rounded again, as the model's RMSNorm does; k rotated by the row's
 * position (a->cos / a->signed_sin are [num_positions, rope_dim]; `interleave` as rope_row). T is
 * the descriptor's row count. Returns SPECDEC_OK or the status saying what is out of range. */
int latent_write(const struct specdec_attention *a, const uint16_t *kv_a, int64_t row_stride, int64_t rope_dim,
                 int interleave, const void *norm_w, int norm_bf16, float eps, uint16_t *cache, int threads) {
    const int64_t d = a->d, rank = d - rope_dim;
    if (!kv_a || !cache || !norm_w || !a->positions || !a->cos || !a->signed_sin || !a->slots || !a->query_start_loc ||
        a->num_seqs < 0 || rope_dim <= 0 || rope_dim % 2 || rope_dim > SPECDEC_MAX_HEAD_DIM || rank <= 0 ||
        row_stride < d || a->hkv != 1)
        return SPECDEC_ERR_INVALID_ARGUMENT;
    const int64_t num_rows = a->query_start_loc[a->num_seqs];
    const int rc = check_rows(a, num_rows);
    if (rc != SPECDEC_OK) return rc;
#pragma omp parallel for num_threads(threads) schedule(static) if (num_rows > 1)
    for (int64_t t = 0; t < num_rows; t++) {
        const uint16_t *x = kv_a + t * row_stride;
        uint16_t *slot = cache + a->slots[t] * d;
        float sum = 0.0f;
        for (int64_t i = 0; i < rank; i++) sum += load_float(x, 1, i) * load_float(x, 1, i);
        const float inv = 1.0f / sqrtf(sum / (float)rank + eps);
        for (int64_t i = 0; i < rank; i++)
            slot[i] = to_bf16(load_float(norm_w, norm_bf16, i) * rounded_bf16(load_float(x, 1, i) * inv));
        const int64_t p = a->positions[t] * rope_dim;
        rope_row(x + rank, rope_dim, interleave, a->cos + p, a->signed_sin + p, slot + rank);
    }
    return SPECDEC_OK;
}

/* Multi-head latent attention's absorbed queries: row t of q [T, row_stride] bf16 holds a->hq
 * heads of [q_nope (nope) | q_rope (rope_dim)]; query [T, hq, a->d] bf16 gets, per head,
 * [q_nope . W_UK[h] | rope(q_rope)]: W_UK[h] [nope, rank] bf16 at w_uk + h * w_head_stride (rank =
 * a->d - rope_dim), products as head_matmul's (transposed 0), rope as latent_write's. Returns
 * SPECDEC_OK or the status saying what is out of range. */
int latent_query(const struct specdec_attention *a, const uint16_t *q, int64_t row_stride, int64_t nope,
                 int64_t rope_dim, int interleave, const uint16_t *w_uk, int64_t w_head_stride, uint16_t *query,
                 int threads) {
    const int64_t d = a->d, rank = d - rope_dim, heads = a->hq;
    if (!q || !w_uk || !query || !a->positions || !a->cos || !a->signed_sin || !a->slots || !a->query_start_loc ||
        a->num_seqs < 0 || heads <= 0 || nope <= 0 || nope % 16 || rope_dim <= 0 || rope_dim % 2 ||
        rope_dim > SPECDEC_MAX_HEAD_DIM || rank <= 0 || rank % 16 || rank > SPECDEC_MAX_LATENT_DIM ||
        row_stride < heads * (nope + rope_dim) || w_head_stride < nope * rank)
        return SPECDEC_ERR_INVALID_ARGUMENT;
    const int64_t num_rows = a->query_start_loc[a->num_seqs];
    const int rc = check_rows(a, num_rows);
    if (rc != SPECDEC_OK) return rc;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < heads; h++) {
        float acc[SPECDEC_MAX_LATENT_DIM];
        for (int64_t t = 0; t < num_rows; t++) {
            const uint16_t *x = q + t * row_stride + h * (nope + rope_dim);
            uint16_t *out = query + (t * heads + h) * d;
            head_row(x, 1, 0, nope, rank, w_uk + h * w_head_stride, 0, acc);
            for (int64_t j = 0; j < rank; j += 16) vf_store_bf16(out + j, vf_load(acc + j));
            const int64_t p = a->positions[t] * rope_dim;
            rope_row(x + nope, rope_dim, interleave, a->cos + p, a->signed_sin + p, out + rank);
        }
    }
    return SPECDEC_OK;
}
