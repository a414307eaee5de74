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
 * These are the calls the Python layer loop makes (`LlamaForCausalLM` with `QLinear` layers), with
 * the same arguments in the same order, so the result is bitwise the same; what goes away is the
 * Python between them (~2 ms a step, 13% of a draft forward).
 *
 * A rank of a tensor-parallel group (`group` set) holds its heads and its share of the MLP's
 * width: o_proj and down_proj write this rank's part of their sums to `partial` [T, H] fp32
 * (their bias on rank 0 only), group_allreduce adds the ranks' parts, and the residual add
 * rounds as qgemm's fused one does: h = bf16(bf16(sum) + h).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernel_abi.h"
#include "simd.h"

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch casts */
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float rounded_bf16(float f) { /* f rounded to bf16, as fp32 */
    const uint16_t b = to_bf16(f);
    return load_float(&b, 1, 0);
}

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

/* h [T, H] bf16 through `num_layers` layers, in place. kv: the cache [L, 2, N, S, Hkv, D] bf16
 * (a->num_slots = N * S). Scratch: qkv [T, (Hq + 2 Hkv) D], att [T, Hq D], gate_up [T, 2 I], all
 * bf16. A layer with `moe` runs its MLP as moe_block, which writes the rows' experts into
 * expert_ids [L, T, top_k] (NULL: not kept). With `group` (a tensor-parallel rank; NULL: none)
 * the row-parallel linears go through `partial` [T, H] fp32 and group_allreduce; MoE layers are
 * not split. Returns SPECDEC_OK or the first failing call's status. */
int decoder_layers(uint16_t *h, int64_t num_rows, const struct specdec_layer *layers, int64_t num_layers,
                   int norm_bf16, float eps, const struct specdec_attention *a, uint16_t *kv, float scale,
                   uint16_t *qkv, uint16_t *att, uint16_t *gate_up, int32_t *expert_ids, int64_t top_k,
                   const struct specdec_group *group, float *partial, int threads) {
    if (!h || !layers || !a || !kv || !qkv || !att || !gate_up || num_rows < 0 || num_layers < 0 || top_k < 0 ||
        (group && !partial))
        return SPECDEC_ERR_INVALID_ARGUMENT;
    const int64_t layer_elems = a->num_slots * a->hkv * a->d; /* one of K or V of one layer */
    for (int64_t i = 0; i < num_layers; i++) {
        const struct specdec_layer *l = &layers[i];
        const struct specdec_linear *q = &l->qkv, *o = &l->o, *gu = &l->gate_up, *dn = &l->down;
        int rc = qgemm(h, 1, num_rows, q->in_features, 0, q->tiles, q->tile_offsets, q->tile_bits,
                       q->out_features, q->bias, NULL, qkv, 1, l->input_norm, norm_bf16, eps, threads);
        if (rc != SPECDEC_OK) return rc;
        if (l->q_norm && l->k_norm) head_norms(qkv, num_rows, a->hq, a->hkv, a->d, l->q_norm, l->k_norm, norm_bf16, eps, threads);
        uint16_t *k_cache = kv + 2 * i * layer_elems, *v_cache = k_cache + layer_elems;
        rc = rope_write_attend(a, qkv, q->out_features, k_cache, v_cache, scale, att, threads);
        if (rc != SPECDEC_OK) return rc;
        rc = group ? row_parallel(att, num_rows, 0, o, group, partial, h, threads)
                   : qgemm(att, 1, num_rows, o->in_features, 0, o->tiles, o->tile_offsets, o->tile_bits,
                           o->out_features, o->bias, h, h, 1, NULL, 0, 0.0f, threads);
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
        rc = group ? row_parallel(gate_up, num_rows, 1, dn, group, partial, h, threads)
                   : qgemm(gate_up, 1, num_rows, dn->in_features, 1, dn->tiles, dn->tile_offsets, dn->tile_bits,
                           dn->out_features, dn->bias, h, h, 1, NULL, 0, 0.0f, threads);
        if (rc != SPECDEC_OK) return rc;
    }
    return SPECDEC_OK;
}
