/* The layout of kernel_abi.h as this compiler laid it out, for `specdec/kernel_abi.py` to compare
 * with its ctypes twins at load. Built into every kernel library with the kernels' flags, but
 * compiled without AVX-512 (the pragma below), so it runs on any x86-64 CPU: a library can be built
 * and checked where its kernels cannot run. */
#pragma GCC target("no-avx512f")

#include <stddef.h>

#include "kernel_abi.h"

#define SIZE(s) {#s, "", (int64_t)sizeof(struct s), (int64_t)sizeof(struct s)}
#define FIELD(s, f) {#s, #f, (int64_t)offsetof(struct s, f), (int64_t)sizeof(((struct s *)0)->f)}
#define CONSTANT(c) {"constant", #c, (int64_t)(c), 0}

static const struct specdec_abi_entry LAYOUT[] = {
    SIZE(specdec_linear),
    FIELD(specdec_linear, tiles),
    FIELD(specdec_linear, tile_offsets),
    FIELD(specdec_linear, tile_bits),
    FIELD(specdec_linear, in_features),
    FIELD(specdec_linear, out_features),
    FIELD(specdec_linear, bias),
    SIZE(specdec_layer),
    FIELD(specdec_layer, qkv),
    FIELD(specdec_layer, o),
    FIELD(specdec_layer, gate_up),
    FIELD(specdec_layer, down),
    FIELD(specdec_layer, input_norm),
    FIELD(specdec_layer, post_attention_norm),
    FIELD(specdec_layer, moe),
    FIELD(specdec_layer, q_norm),
    FIELD(specdec_layer, k_norm),
    SIZE(specdec_moe),
    FIELD(specdec_moe, router),
    FIELD(specdec_moe, gate_up),
    FIELD(specdec_moe, down),
    FIELD(specdec_moe, shared_gate_up),
    FIELD(specdec_moe, shared_down),
    FIELD(specdec_moe, shared_gate),
    FIELD(specdec_moe, num_experts),
    FIELD(specdec_moe, top_k),
    FIELD(specdec_moe, hidden),
    FIELD(specdec_moe, router_bf16),
    FIELD(specdec_moe, norm_topk),
    SIZE(specdec_attention),
    FIELD(specdec_attention, positions),
    FIELD(specdec_attention, cos),
    FIELD(specdec_attention, signed_sin),
    FIELD(specdec_attention, num_positions),
    FIELD(specdec_attention, num_slots),
    FIELD(specdec_attention, slots),
    FIELD(specdec_attention, block_tables),
    FIELD(specdec_attention, max_blocks),
    FIELD(specdec_attention, num_blocks),
    FIELD(specdec_attention, seq_lens),
    FIELD(specdec_attention, query_start_loc),
    FIELD(specdec_attention, num_seqs),
    FIELD(specdec_attention, block_size),
    FIELD(specdec_attention, hq),
    FIELD(specdec_attention, hkv),
    FIELD(specdec_attention, d),
    SIZE(specdec_group),
    FIELD(specdec_group, region),
    FIELD(specdec_group, rank),
    FIELD(specdec_group, world),
    FIELD(specdec_group, slot_bytes),
    FIELD(specdec_group, calls),
    FIELD(specdec_group, timeout_ms),
    FIELD(specdec_group, att_start),
    FIELD(specdec_group, att_width),
    FIELD(specdec_group, att_full),
    FIELD(specdec_group, ffn_start),
    FIELD(specdec_group, ffn_width),
    FIELD(specdec_group, ffn_full),
    FIELD(specdec_group, out_start),
    FIELD(specdec_group, out_width),
    FIELD(specdec_group, out_full),
    SIZE(specdec_abi_entry),
    FIELD(specdec_abi_entry, type),
    FIELD(specdec_abi_entry, field),
    FIELD(specdec_abi_entry, offset),
    FIELD(specdec_abi_entry, size),
    CONSTANT(SPECDEC_GROUP),
    CONSTANT(SPECDEC_TILE),
    CONSTANT(SPECDEC_SUPER),
    CONSTANT(SPECDEC_TILE_Q4_K),
    CONSTANT(SPECDEC_TILE_Q6_K),
    CONSTANT(SPECDEC_TILE_Q5_0),
    CONSTANT(SPECDEC_TILE_Q8_0),
    CONSTANT(SPECDEC_MAX_HEAD_DIM),
    CONSTANT(SPECDEC_MAX_LATENT_DIM),
    CONSTANT(SPECDEC_SHM_HEADER),
    CONSTANT(SPECDEC_OK),
    CONSTANT(SPECDEC_ERR_NO_MEMORY),
    CONSTANT(SPECDEC_ERR_INVALID_ARGUMENT),
    CONSTANT(SPECDEC_ERR_POSITION),
    CONSTANT(SPECDEC_ERR_SLOT),
    CONSTANT(SPECDEC_ERR_BLOCK),
    CONSTANT(SPECDEC_ERR_LENGTHS),
    CONSTANT(SPECDEC_ERR_PEER_GONE),
    CONSTANT(SPECDEC_ERR_TIMEOUT),
};

int64_t specdec_abi_version(void) { return SPECDEC_ABI_VERSION; }

const struct specdec_abi_entry *specdec_abi_layout(int64_t *count) {
    *count = (int64_t)(sizeof(LAYOUT) / sizeof(LAYOUT[0]));
    return LAYOUT;
}
