/* The decoder layers of a Llama-family model for one step, in one call (built with qgemm.c).
 *
 * Per layer, on the hidden states h [T, H] bf16, in place:
 *   qkv = qkv_proj(rmsnorm(h))                       qgemm, norm fused
 *   att = attend(rope(qkv))                          the cache's rope_write_attend (a callback)
 *   h   = h + o_proj(att)                            qgemm, residual fused
 *   h   = h + down_proj(silu(gate) * up),            qgemm, SiLU-GLU and residual fused,
 *         gate | up = gate_up_proj(rmsnorm(h))       qgemm, norm fused
 * These are the calls the Python layer loop makes (`LlamaForCausalLM` with `QLinear` layers), with
 * the same arguments in the same order, so the result is bitwise the same; what goes away is the
 * Python between them (~2 ms a step, 13% of a draft forward).
 */
#include <stdint.h>
#include <stdlib.h>

int qgemm(const void *x, int x_bf16, int64_t m, int64_t k, int glu, const uint8_t *tiles,
          const int64_t *tile_offsets, const uint8_t *tile_bits, int64_t n, const float *bias,
          const void *residual, void *y, int y_bf16, const void *norm_w, int norm_w_bf16, float eps,
          int threads);

typedef int (*attend_fn)(uint16_t *qkv, int64_t row_stride, const int64_t *positions, const float *cos,
                         const float *signed_sin, int64_t num_positions, uint16_t *k_cache,
                         uint16_t *v_cache, int64_t num_slots, const int64_t *slots,
                         const int32_t *block_tables, int64_t max_blocks, int64_t num_blocks,
                         const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,
                         int64_t block_size, int64_t hq, int64_t hkv, int64_t d, float scale,
                         uint16_t *out, int threads);

struct linear { /* a QLinear's buffers: every field 8 bytes, so Python passes an int64 table */
    const uint8_t *tiles;
    const int64_t *tile_offsets;
    const uint8_t *tile_bits;
    int64_t in_features, out_features;
    const float *bias; /* NULL: none */
};

struct layer {
    struct linear qkv, o, gate_up, down;
    const void *input_norm, *post_attention_norm; /* RMSNorm weights [H], dtype per norm_bf16 */
};

struct attention { /* everything rope_write_attend takes but the layer's caches and buffers */
    const int64_t *positions;
    const float *cos, *signed_sin;
    int64_t num_positions;
    uint16_t *kv;                     /* the cache [L, 2, N, S, Hkv, D] bf16 */
    int64_t num_slots;                /* N * S */
    const int64_t *slots;
    const int32_t *block_tables;
    int64_t max_blocks, num_blocks;
    const int32_t *seq_lens, *query_start_loc;
    int64_t num_seqs, block_size, hq, hkv, d;
};

/* h [T, H] bf16 through `num_layers` layers, in place. Scratch: qkv [T, (Hq + 2 Hkv) D],
 * att [T, Hq D], gate_up [T, 2 I], all bf16. Returns 0, a negative rope_write_attend code, or -100
 * when qgemm ran out of memory. */
int decoder_layers(uint16_t *h, int64_t num_rows, const struct layer *layers, int64_t num_layers,
                   int norm_bf16, float eps, const struct attention *a, attend_fn attend, float scale,
                   uint16_t *qkv, uint16_t *att, uint16_t *gate_up, int threads) {
    const int64_t layer_elems = a->num_slots * a->hkv * a->d; /* one of K or V of one layer */
    for (int64_t i = 0; i < num_layers; i++) {
        const struct layer *l = &layers[i];
        const struct linear *q = &l->qkv, *o = &l->o, *gu = &l->gate_up, *dn = &l->down;
        if (qgemm(h, 1, num_rows, q->in_features, 0, q->tiles, q->tile_offsets, q->tile_bits,
                  q->out_features, q->bias, NULL, qkv, 1, l->input_norm, norm_bf16, eps, threads))
            return -100;
        uint16_t *k_cache = a->kv + 2 * i * layer_elems, *v_cache = k_cache + layer_elems;
        const int rc = attend(qkv, q->out_features, a->positions, a->cos, a->signed_sin, a->num_positions,
                              k_cache, v_cache, a->num_slots, a->slots, a->block_tables, a->max_blocks,
                              a->num_blocks, a->seq_lens, a->query_start_loc, a->num_seqs,
                              a->block_size, a->hq, a->hkv, a->d, scale, att, threads);
        if (rc) return rc;
        if (qgemm(att, 1, num_rows, o->in_features, 0, o->tiles, o->tile_offsets, o->tile_bits,
                  o->out_features, o->bias, h, h, 1, NULL, 0, 0.0f, threads))
            return -100;
        if (qgemm(h, 1, num_rows, gu->in_features, 0, gu->tiles, gu->tile_offsets, gu->tile_bits,
                  gu->out_features, gu->bias, NULL, gate_up, 1, l->post_attention_norm, norm_bf16, eps,
                  threads))
            return -100;
        if (qgemm(gate_up, 1, num_rows, dn->in_features, 1, dn->tiles, dn->tile_offsets, dn->tile_bits,
                  dn->out_features, dn->bias, h, h, 1, NULL, 0, 0.0f, threads))
            return -100;
    }
    return 0;
}
