/* The decoder layers of a Llama-family model for one step, in one call (built into one library with
 * qgemm.c and paged_attention.c, so both are plain calls the linker resolves and the compiler
 * checks against kernel_abi.h: no function pointer crosses from Python).
 *
 * Per layer, on the hidden states h [T, H] bf16, in place:
 *   qkv = qkv_proj(rmsnorm(h))                       qgemm, norm fused
 *   q, k = norm each head (Qwen3's q/k norms, where the layer has them)
 *   att = attend(rope(qkv))                          rope_write_attend
 *   h   = h + o_proj(att)                            qgemm, residual fused
 *   h   = h + down_proj(silu(gate) * up),            qgemm, SiLU-GLU and residual fused,
 *         gate | up = gate_up_proj(rmsnorm(h))       qgemm, norm fused
 *     or, in a mixture-of-experts layer,
 *   h   = h + moe(rmsnorm(h))                        moe_block (router, experts, shared expert)
 * A layer with multi-head latent attention (`mla`, DeepSeek-V2/V3) attends as the model's
 * absorbed path does (`latent_attention` below) in place of the three attention lines.
 * These are the calls the Python layer loop makes (`LlamaForCausalLM` with `QLinear` layers), with
 * the same arguments in the same order, so the result is bitwise the same; what goes away is the
 * Python between them (~2 ms a step, 13% of a draft forward).
 *
 * A rank of a tensor-parallel group (`group` set) holds its heads and its share of the MLP's
 * width. Split by partial sums (group->out_full 0): o_proj and down_proj take this rank's input
 * columns and write its part of their sums to `partial` [T, H] fp32 (their bias on rank 0
 * only), group_allreduce adds the ranks' parts, and the residual add rounds as qgemm's fused one
 * does: h = bf16(bf16(sum) + h) (not one process's bits: two partial sums added are not one
 * chain). Split exactly (out_full > 0, column_parallel): o_proj and down_proj keep this rank's
 * output rows over all inputs; their input's columns are gathered from every rank, and their
 * outputs into h: every value is computed by one rank exactly as one process computes it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernel_abi.h"
#include "simd.h"

/* Qwen3's q/k norms on qkv [T, (Hq + 2 Hkv) D] bf16, in place: each head of q and of k RMS-normalised
 * in fp32, rounded to bf16, then scaled by its weight [D] and rounded again (the model's RMSNorm:
 * normalise in fp32, cast, scale in the model dtype). */
static void head_norms(uint16_t *qkv, int64_t num_rows, int64_t hq, int64_t hkv, int64_t d, const void *q_w,
                       const void *k_w, int w_bf16, float eps, int threads) {
    const int64_t heads = hq + hkv, row = (hq + 2 * hkv) * d;
#pragma omp parallel for num_threads(threads) schedule(static) if (num_rows * heads > 64)
    for (int64_t idx = 0; idx < num_rows * heads; idx++) {
        const int64_t h = idx % heads;
        uint16_t *x = qkv + (idx / heads) * row + h * d;
        const void *w = h < hq ? q_w : k_w;
        float sum = 0.0f;
        for (int64_t i = 0; i < d; i++) sum += load_float(x, 1, i) * load_float(x, 1, i);
        const float inv = 1.0f / sqrtf(sum / (float)d + eps);
        for (int64_t i = 0; i < d; i++)
            x[i] = to_bf16(load_float(w, w_bf16, i) * rounded_bf16(load_float(x, 1, i) * inv));
    }
}

/* h = bf16(bf16(part) + h) over n elements: qgemm's residual epilogue (store_rows) on a sum of parts */
static void add_residual(uint16_t *h, const float *part, int64_t n) {
    for (int64_t i = 0; i < n; i++) h[i] = to_bf16(rounded_bf16(part[i]) + load_float(h, 1, i));
}

/* A row-parallel linear of a tensor-parallel rank: this rank's part of x @ w^T, summed over the
 * group, added to h. */
static int row_parallel(const uint16_t *x, int64_t num_rows, int glu, const struct specdec_linear *l,
                        const struct specdec_group *group, float *partial, uint16_t *h, int threads) {
    int rc = qgemm(x, 1, num_rows, l->in_features, glu, l->tiles, l->tile_offsets, l->tile_bits, l->out_features,
                   l->bias, NULL, partial, 0, NULL, 0, 0.0f, threads);
    if (rc != SPECDEC_OK) return rc;
    rc = group_allreduce(group, partial, num_rows * l->out_features);
    if (rc == SPECDEC_OK) add_residual(h, partial, num_rows * l->out_features);
    return rc;
}

/* dst [T, cols] bf16 = every rank's columns gathered: this rank's x [T, width] goes to columns
 * `start`.. (with halves 2: its first half to start.., its second to full + start..; cols =
 * halves * full), through fp32 `buf` [T, cols] whose other columns are -0.0 and group_allreduce:
 * x + -0.0 is x, sign of zero included, so dst holds the ranks' values exactly. */
static int gather_columns(const struct specdec_group *g, const uint16_t *x, int64_t rows, int64_t width,
                          int64_t start, int64_t full, int halves, float *buf, uint16_t *dst) {
    const int64_t cols = halves * full, part = width / halves;
    for (int64_t r = 0; r < rows; r++) {
        float *row = buf + r * cols;
        for (int64_t c = 0; c < cols; c++) row[c] = -0.0f;
        for (int h = 0; h < halves; h++)
            for (int64_t i = 0; i < part; i++) row[h * full + start + i] = load_float(x, 1, r * width + h * part + i);
    }
    const int rc = group_allreduce(g, buf, rows * cols);
    if (rc != SPECDEC_OK) return rc;
    for (int64_t i = 0; i < rows * cols; i++) dst[i] = to_bf16(buf[i]);
    return SPECDEC_OK;
}

/* An exactly split linear: x's columns gathered from every rank into x_full [T, halves * in_full],
 * this rank's output rows of x_full @ w^T (+ bias) computed over all of it with its columns of h
 * as the fused residual (into `res`, then `out` [T, out_width]), gathered back into h [T, H]. */
static int column_parallel(const uint16_t *x, int64_t num_rows, int glu, int64_t in_start, int64_t in_width,
                           int64_t in_full, const struct specdec_linear *l, const struct specdec_group *g, float *buf,
                           uint16_t *x_full, uint16_t *res, uint16_t *out, uint16_t *h, int threads) {
    const int halves = glu ? 2 : 1;
    const int64_t hidden = g->out_full, ow = g->out_width;
    if (l->out_features != ow || l->in_features != in_full) return SPECDEC_ERR_INVALID_ARGUMENT; /* (glu: x is 2 K wide) */
    int rc = gather_columns(g, x, num_rows, halves * in_width, in_start, in_full, halves, buf, x_full);
    if (rc != SPECDEC_OK) return rc;
    for (int64_t r = 0; r < num_rows; r++)
        for (int64_t i = 0; i < ow; i++) res[r * ow + i] = h[r * hidden + g->out_start + i];
    rc = qgemm(x_full, 1, num_rows, l->in_features, glu, l->tiles, l->tile_offsets, l->tile_bits, ow, l->bias, res,
               out, 1, NULL, 0, 0.0f, threads);
    if (rc != SPECDEC_OK) return rc;
    return gather_columns(g, out, num_rows, ow, g->out_start, hidden, 1, buf, h);
}

/* The split linear of a tensor-parallel rank (group set): exactly or by partial sums. `partial`
 * holds, split exactly, fp32 [T, max(att_full, 2 ffn_full, out_full)] then bf16 x_full [T,
 * max(att_full, 2 ffn_full)], res and out [T, out_width] each; by partial sums fp32 [T, H]. */
static int split_linear(const uint16_t *x, int64_t num_rows, int glu, const struct specdec_linear *l,
                        const struct specdec_group *g, float *partial, uint16_t *h, int threads) {
    if (!g->out_full) return row_parallel(x, num_rows, glu, l, g, partial, h, threads);
    const int64_t in_cols = g->att_full > 2 * g->ffn_full ? g->att_full : 2 * g->ffn_full;
    const int64_t cols = in_cols > g->out_full ? in_cols : g->out_full;
    uint16_t *x_full = (uint16_t *)(partial + num_rows * cols), *res = x_full + num_rows * in_cols;
    uint16_t *out = res + num_rows * g->out_width;
    return glu ? column_parallel(x, num_rows, 1, g->ffn_start, g->ffn_width, g->ffn_full, l, g, partial, x_full, res,
                                 out, h, threads)
               : column_parallel(x, num_rows, 0, g->att_start, g->att_width, g->att_full, l, g, partial, x_full, res,
                                 out, h, threads);
}

/* A multi-head latent attention layer on h [T, H] bf16, in place (the model's `LatentAttention`,
 * absorbed path, with the same kernel calls in the same order, so the same bits):
 *   qa     = qkv_proj(rmsnorm(h))                    [q or q_a | c | k_rope]; qgemm, norm fused
 *   q      = q_b(rmsnorm(q_a)) or q                  qgemm, norm fused
 *   cache[slot] = [rmsnorm(c) | rope(k_rope)]        latent_write
 *   query  = [q_nope . W_UK | rope(q_rope)]          latent_query
 *   lat    = attend(query, latents)                  latent_attend
 *   h      = h + o_proj(lat . W_UV)                  head_matmul, qgemm with the residual fused
 * Scratch `buf` [T, qkv.out + q_lora + hq (nope + rope) + hq d + hq rank] and att [T, hq v], bf16. */
static int latent_attention(uint16_t *h, int64_t num_rows, const struct specdec_layer *l, int norm_bf16, float eps,
                            const struct specdec_attention *a, uint16_t *cache, float scale, uint16_t *buf,
                            uint16_t *att, int threads) {
    const struct specdec_mla *m = l->mla;
    const struct specdec_linear *qa_l = &l->qkv, *qb = &m->q_b, *o = &l->o;
    const int64_t heads = a->hq, d = a->d, rank = d - m->rope_dim, qk = m->nope_dim + m->rope_dim;
    const int64_t qa_w = qa_l->out_features, q_lora = qb->in_features, q_w = q_lora ? q_lora : heads * qk;
    if (qa_w != q_w + d || a->hkv != 1 || m->v_dim % 16 || (q_lora && qb->out_features != heads * qk))
        return SPECDEC_ERR_INVALID_ARGUMENT;
    uint16_t *qa = buf, *q_low = qa + num_rows * qa_w, *q = q_low + num_rows * q_lora, *query = q + num_rows * heads * qk;
    uint16_t *lat = query + num_rows * heads * d;
    int rc = qgemm(h, 1, num_rows, qa_l->in_features, 0, qa_l->tiles, qa_l->tile_offsets, qa_l->tile_bits, qa_w,
                   qa_l->bias, NULL, qa, 1, l->input_norm, norm_bf16, eps, threads);
    if (rc != SPECDEC_OK) return rc;
    int64_t q_stride = qa_w;
    if (q_lora) {
        for (int64_t r = 0; r < num_rows; r++)
            for (int64_t i = 0; i < q_lora; i++) q_low[r * q_lora + i] = qa[r * qa_w + i];
        rc = qgemm(q_low, 1, num_rows, q_lora, 0, qb->tiles, qb->tile_offsets, qb->tile_bits, qb->out_features,
                   qb->bias, NULL, q, 1, m->q_a_norm, norm_bf16, m->eps, threads);
        if (rc != SPECDEC_OK) return rc;
        q_stride = heads * qk;
    } else {
        q = qa;
    }
    rc = latent_write(a, qa + q_w, qa_w, m->rope_dim, (int)m->interleave, m->kv_a_norm, norm_bf16, m->eps, cache, threads);
    if (rc != SPECDEC_OK) return rc;
    const int64_t w_head = (m->nope_dim + m->v_dim) * rank; /* kv_b's rows of one head */
    rc = latent_query(a, q, q_stride, m->nope_dim, m->rope_dim, (int)m->interleave, m->kv_b, w_head, query, threads);
    if (rc != SPECDEC_OK) return rc;
    rc = latent_attend(a, query, cache, rank, scale, lat, threads);
    if (rc != SPECDEC_OK) return rc;
    rc = head_matmul(lat, 1, num_rows, heads, rank, m->v_dim, m->kv_b + m->nope_dim * rank, w_head, 1, att, 1, threads);
    if (rc != SPECDEC_OK) return rc;
    return qgemm(att, 1, num_rows, o->in_features, 0, o->tiles, o->tile_offsets, o->tile_bits, o->out_features, o->bias,
                 h, h, 1, NULL, 0, 0.0f, threads);
}

/* h [T, H] bf16 through `num_layers` layers, in place. kv: the cache [L, 2, N, S, Hkv, D] bf16
 * (a->num_slots = N * S). Scratch: qkv [T, (Hq + 2 Hkv) D], att [T, Hq D], gate_up [T, 2 I], all
 * bf16 (a model of latent attention layers: the cache [L, N, S, 1, d], a->d = rank + rope, and
 * qkv as latent_attention's `buf`, att [T, hq v]). A layer with `moe` runs its MLP as moe_block,
 * which writes the rows' experts into
 * expert_ids [L, T, top_k] (NULL: not kept). With `group` (a tensor-parallel rank; NULL: none)
 * o_proj and down_proj go through `partial` (split_linear) and group_allreduce; MoE layers are
 * not split. Returns SPECDEC_OK or the first failing call's status. */
int decoder_layers(uint16_t *h, int64_t num_rows, const struct specdec_layer *layers, int64_t num_layers,
                   int norm_bf16, float eps, const struct specdec_attention *a, uint16_t *kv, float scale,
                   uint16_t *qkv, uint16_t *att, uint16_t *gate_up, int32_t *expert_ids, int64_t top_k,
                   const struct specdec_group *group, float *partial, int threads) {
    if (!h || !layers || !a || !kv || !qkv || !att || !gate_up || num_rows < 0 || num_layers < 0 || top_k < 0 ||
        (group && !partial))
        return SPECDEC_ERR_INVALID_ARGUMENT;
    const int64_t layer_elems = a->num_slots * a->hkv * a->d; /* one of K or V (or the latents) of one layer */
    const int64_t planes = num_layers && layers[0].mla ? 1 : 2;
    for (int64_t i = 0; i < num_layers; i++) {
        const struct specdec_layer *l = &layers[i];
        const struct specdec_linear *q = &l->qkv, *o = &l->o, *gu = &l->gate_up, *dn = &l->down;
        uint16_t *k_cache = kv + planes * i * layer_elems, *v_cache = k_cache + layer_elems;
        int rc;
        if (l->mla || planes == 1) {
            if (!l->mla || group) return SPECDEC_ERR_INVALID_ARGUMENT; /* all latent or none; not split */
            rc = latent_attention(h, num_rows, l, norm_bf16, eps, a, k_cache, scale, qkv, att, threads);
        } else {
            rc = qgemm(h, 1, num_rows, q->in_features, 0, q->tiles, q->tile_offsets, q->tile_bits, q->out_features,
                       q->bias, NULL, qkv, 1, l->input_norm, norm_bf16, eps, threads);
            if (rc != SPECDEC_OK) return rc;
            if (l->q_norm && l->k_norm) head_norms(qkv, num_rows, a->hq, a->hkv, a->d, l->q_norm, l->k_norm, norm_bf16, eps, threads);
            rc = rope_write_attend(a, qkv, q->out_features, k_cache, v_cache, scale, att, threads);
            if (rc != SPECDEC_OK) return rc;
            rc = group ? split_linear(att, num_rows, 0, o, group, partial, h, threads)
                       : qgemm(att, 1, num_rows, o->in_features, 0, o->tiles, o->tile_offsets, o->tile_bits,
                               o->out_features, o->bias, h, h, 1, NULL, 0, 0.0f, threads);
        }
        if (rc != SPECDEC_OK) return rc;
        if (l->moe) {
            if (group) return SPECDEC_ERR_INVALID_ARGUMENT;
            if (l->moe->top_k != top_k) return SPECDEC_ERR_INVALID_ARGUMENT;
            rc = moe_block(h, 1, num_rows, l->moe, l->post_attention_norm, norm_bf16, eps, h, h,
                           expert_ids ? expert_ids + i * num_rows * top_k : NULL, threads);
            if (rc != SPECDEC_OK) return rc;
            continue;
        }
        rc = qgemm(h, 1, num_rows, gu->in_features, 0, gu->tiles, gu->tile_offsets, gu->tile_bits,
                   gu->out_features, gu->bias, NULL, gate_up, 1, l->post_attention_norm, norm_bf16, eps, threads);
        if (rc != SPECDEC_OK) return rc;
        rc = group ? split_linear(gate_up, num_rows, 1, dn, group, partial, h, threads)
                   : qgemm(gate_up, 1, num_rows, dn->in_features, 1, dn->tiles, dn->tile_offsets, dn->tile_bits,
                           dn->out_features, dn->bias, h, h, 1, NULL, 0, 0.0f, threads);
        if (rc != SPECDEC_OK) return rc;
    }
    return SPECDEC_OK;
}
