/* A mixture-of-experts MLP block for a window of rows, in one call (built into the decoder library
 * beside qgemm.c, whose `qgemm` runs every expert GEMM: the experts are QLinear tiles like the
 * dense linears, so a change of tile format reaches them unchanged).
 *
 *   xn      = rmsnorm(x)                              fp32, per row
 *   p       = softmax(xn @ router^T)                  fp32 [T, E], per row
 *   ids, w  = top k of p (renormalized: norm_topk)    ties to the lower expert id
 *   out[r]  = sum over r's experts e, in ascending e: w * down_e(silu(gate_e) * up_e)(xn[r])
 *             + sigmoid(xn[r] . shared_gate) * shared(xn[r])   (Qwen2-MoE's shared expert;
 *                                                               DeepSeek's: no gate, times 1)
 *   y       = residual + out                          rounded as qgemm's residual add
 *
 * The rows are grouped by expert: each chosen expert runs gate|up and down once over just its
 * rows, so its tiles are read once per call whatever the number of rows that chose it (a verify
 * window of k+1 rows reads the union of its rows' experts, each once). Every step is per row in a
 * fixed order (the router's dot products, qgemm's rows, the sum over a row's experts in expert
 * order), so a row's result is bitwise independent of the other rows in the call: speculative
 * verification equals one-row decoding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_abi.h"
#include "simd.h"

/* a . b over n (a multiple of 16) fp32 values of a and n values of b (bf16 or fp32) */
static inline float dot(const float *a, const void *b, int b_bf16, int64_t n) {
    vf s0 = vf_zero(), s1 = vf_zero();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = vf_fmadd(vf_load(a + i), load_floats(b, b_bf16, i), s0);
        s1 = vf_fmadd(vf_load(a + i + 16), load_floats(b, b_bf16, i + 16), s1);
    }
    for (; i < n; i += 16) s0 = vf_fmadd(vf_load(a + i), load_floats(b, b_bf16, i), s0);
    return vf_reduce_add(vf_add(s0, s1));
}

/* xn [m, h] fp32 = x, or RMSNorm(x) * norm_w (as qgemm's fused norm: fp32 throughout) */
static void normalize_rows(const void *x, int x_bf16, int64_t m, int64_t h, const void *norm_w, int norm_bf16,
                           float eps, float *xn, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (m * h > (1 << 16))
    for (int64_t r = 0; r < m; r++) {
        float inv = 1.0f;
        if (norm_w) {
            float sum = 0.0f;
            for (int64_t i = 0; i < h; i++) {
                const float v = load_float(x, x_bf16, r * h + i);
                sum += v * v;
            }
            inv = 1.0f / sqrtf(sum / (float)h + eps);
        }
        for (int64_t i = 0; i < h; i += 16) {
            vf v = load_floats(x, x_bf16, r * h + i);
            if (norm_w) v = vf_mul(vf_mul(v, vf_set1(inv)), load_floats(norm_w, norm_bf16, i));
            vf_store(xn + r * h + i, v);
        }
    }
}

/* Per row: softmax over the router's logits, the top k (ids, w), renormalized if asked. */
static void route(const float *xn, int64_t m, const struct specdec_moe *e, float *logits, int32_t *ids,
                  float *w, int threads) {
    const int64_t h = e->hidden, n = e->num_experts, k = e->top_k;
#pragma omp parallel for num_threads(threads) schedule(static) if (m * n * h > (1 << 18))
    for (int64_t idx = 0; idx < m * n; idx++)
        logits[idx] = dot(xn + (idx / n) * h, (const uint8_t *)e->router + (idx % n) * h * (e->router_bf16 ? 2 : 4),
                          (int)e->router_bf16, h);
    for (int64_t r = 0; r < m; r++) {
        float *p = logits + r * n, top = -INFINITY, sum = 0.0f, kept = 0.0f;
        for (int64_t j = 0; j < n; j++) top = fmaxf(top, p[j]);
        for (int64_t j = 0; j < n; j++) sum += (p[j] = expf(p[j] - top));
        for (int64_t j = 0; j < n; j++) p[j] /= sum;
        for (int64_t s = 0; s < k; s++) { /* selection: k is small; a NaN row (overflowed
                                             * activations) still picks k distinct experts */
            int64_t best = -1;
            for (int64_t j = 0; j < n; j++)
                if (p[j] != -1.0f && (best < 0 || p[j] > p[best])) best = j;
            ids[r * k + s] = (int32_t)best;
            kept += (w[r * k + s] = p[best]);
            p[best] = -1.0f; /* taken */
        }
        if (e->norm_topk)
            for (int64_t s = 0; s < k; s++) w[r * k + s] /= kept;
    }
}

/* acc[r] += scale * y for one row of h values */
static inline void add_scaled(float *acc, const float *y, float scale, int64_t h) {
    const vf s = vf_set1(scale);
    for (int64_t i = 0; i < h; i += 16) vf_store(acc + i, vf_fmadd(s, vf_load(y + i), vf_load(acc + i)));
}

/* One SiLU-GLU MLP over n rows of xn: out [n, h] fp32; gu: scratch [n, 2I] fp32. */
static int run_expert(const float *xn, int64_t n, const struct specdec_linear *gate_up,
                      const struct specdec_linear *down, float *gu, float *out, int threads) {
    int rc = qgemm(xn, 0, n, gate_up->in_features, 0, gate_up->tiles, gate_up->tile_offsets, gate_up->tile_bits,
                   gate_up->out_features, gate_up->bias, NULL, gu, 0, NULL, 0, 0.0f, threads);
    if (rc != SPECDEC_OK) return rc;
    return qgemm(gu, 0, n, down->in_features, 1, down->tiles, down->tile_offsets, down->tile_bits,
                 down->out_features, down->bias, NULL, out, 0, NULL, 0, 0.0f, threads);
}

/* One row (m == 1): every chosen expert's gate|up in ONE qgemm call over their tiles end to end (a
 * tile's output does not depend on the other tiles of the call, so the values are bitwise those of
 * one call per expert), then the experts' downs, each on one thread where the threads divide them
 * (a qgemm row's value does not depend on the threads that compute it), else one call each over
 * all threads; their outputs summed after, in expert order. Two parallel regions a layer instead of
 * 2k (their thread start-ups and barriers) in a one-row decode. Returns -1 where it does not apply (biases). */
static int one_row_experts(const float *xn, const struct specdec_moe *e, const int32_t *ids, const float *w,
                           float *gu, float *acc, int threads) {
    const int64_t k = e->top_k, h = e->hidden;
    int64_t tiles = 0;
    const uint8_t *base = NULL;
    for (int64_t s = 0; s < k; s++) {
        const struct specdec_linear *g = &e->gate_up[ids[s]];
        if (g->bias || e->down[ids[s]].bias) return -1;
        tiles += g->out_features / SPECDEC_TILE;
        base = base == NULL || g->tiles < base ? g->tiles : base;
    }
    int64_t *offsets = malloc(sizeof(int64_t) * (size_t)tiles);
    uint8_t *bits = malloc((size_t)tiles);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)k), *cols = malloc(sizeof(int64_t) * (size_t)k);
    float *ys = malloc(sizeof(float) * (size_t)(k * h)); /* each expert's down output */
    if (!offsets || !bits || !order || !cols || !ys) {
        free(offsets), free(bits), free(order), free(cols), free(ys);
        return SPECDEC_ERR_NO_MEMORY;
    }
    for (int64_t s = 0; s < k; s++) order[s] = s; /* the slots by expert id: the sum's order */
    for (int64_t s = 1; s < k; s++)
        for (int64_t j = s; j > 0 && ids[order[j]] < ids[order[j - 1]]; j--) {
            const int64_t t = order[j];
            order[j] = order[j - 1], order[j - 1] = t;
        }
    int64_t at = 0;
    for (int64_t s = 0; s < k; s++) {
        const struct specdec_linear *g = &e->gate_up[ids[order[s]]];
        for (int64_t t = 0; t < g->out_features / SPECDEC_TILE; t++, at++) {
            offsets[at] = (int64_t)(g->tiles - base) + g->tile_offsets[t];
            bits[at] = g->tile_bits[t];
        }
    }
    int rc = qgemm(xn, 0, 1, h, 0, base, offsets, bits, tiles * SPECDEC_TILE, NULL, NULL, gu, 0, NULL, 0, 0.0f, threads);
    for (int64_t s = 0, col = 0; s < k; s++) {
        cols[s] = col;
        col += 2 * e->down[ids[order[s]]].in_features;
    }
    const int by_expert = threads > 1 && k % threads == 0; /* every thread the same number of downs */
    if (rc == SPECDEC_OK) {
#pragma omp parallel for num_threads(by_expert ? threads : 1) schedule(static)
        for (int64_t s = 0; s < k; s++) {
            const struct specdec_linear *dn = &e->down[ids[order[s]]];
            const int r = qgemm(gu + cols[s], 0, 1, dn->in_features, 1, dn->tiles, dn->tile_offsets, dn->tile_bits,
                                dn->out_features, NULL, NULL, ys + s * h, 0, NULL, 0, 0.0f, by_expert ? 1 : threads);
            if (r != SPECDEC_OK) {
#pragma omp critical
                rc = r;
            }
        }
    }
    for (int64_t s = 0; s < k && rc == SPECDEC_OK; s++) add_scaled(acc, ys + s * h, w[order[s]], h);
    free(offsets), free(bits), free(order), free(cols), free(ys);
    return rc;
}

static int check_block(const struct specdec_moe *e) {
    if (!e->router || !e->gate_up || !e->down || e->num_experts <= 0 || e->top_k <= 0 ||
        e->top_k > e->num_experts || e->hidden <= 0 || e->hidden % SPECDEC_GROUP)
        return 0;
    const int shared = e->shared_gate_up != NULL;
    if (shared != (e->shared_down != NULL) || (!shared && e->shared_gate != NULL)) return 0;
    for (int64_t i = 0; i < e->num_experts + shared; i++) {
        const struct specdec_linear *gu = i < e->num_experts ? &e->gate_up[i] : e->shared_gate_up;
        const struct specdec_linear *dn = i < e->num_experts ? &e->down[i] : e->shared_down;
        if (gu->in_features != e->hidden || dn->out_features != e->hidden || gu->out_features != 2 * dn->in_features)
            return 0;
    }
    return 1;
}

/* y[m, H] = residual + moe(rmsnorm(x)) (see the top of this file). x, residual and y are bf16 or
 * fp32 as x_bf16 says (residual NULL: none; y may be x or residual); norm_w [H] NULL: no norm.
 * expert_ids [m, top_k] receives each row's experts (NULL: not wanted). Returns SPECDEC_OK,
 * SPECDEC_ERR_INVALID_ARGUMENT (shapes that disagree, a missing buffer) or
 * SPECDEC_ERR_NO_MEMORY; any status a qgemm call returns. */
int moe_block(const void *x, int x_bf16, int64_t m, const struct specdec_moe *e, const void *norm_w, int norm_bf16,
              float eps, const void *residual, void *y, int32_t *expert_ids, int threads) {
    if (!x || !y || !e || m < 0 || !check_block(e)) return SPECDEC_ERR_INVALID_ARGUMENT;
    if (m == 0) return SPECDEC_OK;
    const int64_t h = e->hidden, n = e->num_experts, k = e->top_k;
    int64_t widest = e->shared_gate_up ? e->shared_gate_up->out_features : 0;
    for (int64_t i = 0; i < n; i++) widest = e->gate_up[i].out_features > widest ? e->gate_up[i].out_features : widest;
    float *xn = malloc(sizeof(float) * (size_t)(m * h)), *acc = calloc((size_t)(m * h), sizeof(float));
    float *logits = malloc(sizeof(float) * (size_t)(m * n)), *w = malloc(sizeof(float) * (size_t)(m * k));
    float *rows_x = malloc(sizeof(float) * (size_t)(m * h)), *rows_y = malloc(sizeof(float) * (size_t)(m * h));
    float *gu = malloc(sizeof(float) * (size_t)((m > k ? m : k) * widest));
    int32_t *ids = expert_ids ? expert_ids : malloc(sizeof(int32_t) * (size_t)(m * k));
    int64_t *count = calloc((size_t)n + 1, sizeof(int64_t)), *order = malloc(sizeof(int64_t) * (size_t)(m * k));
    int rc = SPECDEC_ERR_NO_MEMORY;
    if (!xn || !acc || !logits || !w || !rows_x || !rows_y || !gu || !ids || !count || !order) goto done;
    normalize_rows(x, x_bf16, m, h, norm_w, norm_bf16, eps, xn, threads);
    route(xn, m, e, logits, ids, w, threads);
    /* (row, slot) pairs grouped by expert, rows ascending within each: a counting sort */
    for (int64_t i = 0; i < m * k; i++) count[ids[i] + 1]++;
    for (int64_t j = 0; j < n; j++) count[j + 1] += count[j];
    for (int64_t i = 0; i < m * k; i++) order[count[ids[i]]++] = i;
    rc = m == 1 ? one_row_experts(xn, e, ids, w, gu, acc, threads) : -1;
    const int per_expert = rc == -1; /* one call pair per chosen expert over its rows */
    if (per_expert) rc = SPECDEC_OK;
    for (int64_t j = 0, start = 0; per_expert && rc == SPECDEC_OK && j < n; start = count[j++]) {
        const int64_t rows = count[j] - start; /* count[j] is now the end of expert j's pairs */
        if (rows == 0) continue;
        for (int64_t i = 0; i < rows; i++) memcpy(rows_x + i * h, xn + (order[start + i] / k) * h, sizeof(float) * (size_t)h);
        rc = run_expert(rows_x, rows, &e->gate_up[j], &e->down[j], gu, rows_y, threads);
        for (int64_t i = 0; i < rows && rc == SPECDEC_OK; i++)
            add_scaled(acc + (order[start + i] / k) * h, rows_y + i * h, w[order[start + i]], h);
    }
    if (rc == SPECDEC_OK && e->shared_gate_up) {
        rc = run_expert(xn, m, e->shared_gate_up, e->shared_down, gu, rows_y, threads);
        for (int64_t r = 0; r < m && rc == SPECDEC_OK; r++) {
            const float g = e->shared_gate ? 1.0f / (1.0f + expf(-dot(xn + r * h, e->shared_gate, (int)e->router_bf16, h)))
                                           : 1.0f; /* DeepSeek's shared experts: ungated */
            add_scaled(acc + r * h, rows_y + r * h, g, h);
        }
    }
    if (rc == SPECDEC_OK) { /* y = residual + out, rounded as qgemm's store_rows rounds */
        for (int64_t i = 0; i < m * h; i += 16) {
            vf v = vf_load(acc + i);
            if (x_bf16) {
                if (residual) v = vf_add(vf_round_bf16(v), vf_load_bf16((const uint16_t *)residual + i));
                vf_store_bf16((uint16_t *)y + i, v);
            } else {
                if (residual) v = vf_add(v, vf_load((const float *)residual + i));
                vf_store((float *)y + i, v);
            }
        }
    }
done:
    free(xn), free(acc), free(logits), free(w), free(rows_x), free(rows_y), free(gu), free(count), free(order);
    if (!expert_ids) free(ids);
    return rc;
}
