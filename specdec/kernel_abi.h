/* The C boundary of specdec's kernels: status codes, the descriptors that cross from Python, and
 * every exported prototype. Every kernel source includes this file, so the compiler checks each
 * definition against its prototype; `kernel_abi.c` (built into every library, plain C) reports
 * the descriptors' layout and these constants, and `specdec/kernel_abi.py` (the ctypes twin of
 * this file) compares them with its own at load. Change a struct or a code here, there, and
 * bump SPECDEC_ABI_VERSION. */
#ifndef SPECDEC_KERNEL_ABI_H
#define SPECDEC_KERNEL_ABI_H

#include <stdint.h>

#define SPECDEC_ABI_VERSION 12
#define SPECDEC_GROUP 32          /* qgemm: inputs per weight / activation group */
#define SPECDEC_TILE 16           /* qgemm: output channels per weight tile */
#define SPECDEC_SUPER 256         /* qgemm: inputs per k-quant super-block */
#define SPECDEC_TILE_Q4_K 12      /* qgemm tile_bits of a GGUF Q4_K tile (ggml's type id) */
#define SPECDEC_TILE_Q6_K 14      /* qgemm tile_bits of a GGUF Q6_K tile */
#define SPECDEC_TILE_Q5_0 6       /* qgemm tile_bits of a GGUF Q5_0 tile (ggml's type id) */
#define SPECDEC_TILE_Q8_0 24      /* qgemm tile_bits of a GGUF Q8_0 tile (ggml's 8 is the int8 tiles') */
#define SPECDEC_TILE_Q4_0 2       /* qgemm tile_bits of a GGUF Q4_0 tile (ggml's type id) */
#define SPECDEC_TILE_Q4_1 3       /* qgemm tile_bits of a GGUF Q4_1 tile */
#define SPECDEC_TILE_Q5_K 13      /* qgemm tile_bits of a GGUF Q5_K tile */
#define SPECDEC_TILE_IQ4_NL 20    /* qgemm tile_bits of a GGUF IQ4_NL tile */
#define SPECDEC_TILE_MXFP4 39     /* qgemm tile_bits of a GGUF MXFP4 tile */
#define SPECDEC_TILE_IQ4_XS 23    /* qgemm tile_bits of a GGUF IQ4_XS tile */
#define SPECDEC_TILE_Q3_K 11      /* qgemm tile_bits of a GGUF Q3_K tile */
#define SPECDEC_TILE_Q2_K 10      /* qgemm tile_bits of a GGUF Q2_K tile */
#define SPECDEC_TILE_F16 1        /* qgemm tile_bits of a GGUF F16 tile (ggml's type id) */
#define SPECDEC_TILE_BF16 30      /* qgemm tile_bits of a GGUF BF16 tile (ggml's type id) */
#define SPECDEC_MAX_HEAD_DIM 512  /* rope_write_attend: its per-thread query buffer */
#define SPECDEC_MAX_LATENT_DIM 1024 /* latent_attend: the widest latent (rank + rope) */
#define SPECDEC_SHM_HEADER 4096   /* group_allreduce: the region's header (progress, process ids) */

/* What every exported kernel returns. */
enum specdec_status {
    SPECDEC_OK = 0,
    SPECDEC_ERR_NO_MEMORY = 1,        /* a scratch buffer could not be allocated */
    SPECDEC_ERR_INVALID_ARGUMENT = 2, /* a size, a flag or a NULL the kernel does not take */
    SPECDEC_ERR_POSITION = 3,         /* a position outside the rotary table */
    SPECDEC_ERR_SLOT = 4,             /* a slot outside the KV cache */
    SPECDEC_ERR_BLOCK = 5,            /* a block table entry outside the KV cache */
    SPECDEC_ERR_LENGTHS = 6,          /* query rows, sequence lengths and block tables disagree */
    SPECDEC_ERR_PEER_GONE = 7,        /* group_allreduce: another rank's process ended */
    SPECDEC_ERR_TIMEOUT = 8,          /* group_allreduce: another rank did not arrive in time */
};

/* A QLinear's buffers (see qgemm). */
struct specdec_linear {
    const uint8_t *tiles;
    const int64_t *tile_offsets;
    const uint8_t *tile_bits;
    int64_t in_features, out_features;
    const float *bias; /* NULL: none */
};

/* A mixture-of-experts MLP block (see moe_block): the router and each expert's QLinears. */
struct specdec_moe {
    const void *router;                       /* [E, H], bf16 or fp32 (router_bf16) */
    const struct specdec_linear *gate_up;     /* [E]: expert e's gate | up, [2 I, H] */
    const struct specdec_linear *down;        /* [E]: expert e's down, [H, I] */
    const struct specdec_linear *shared_gate_up, *shared_down; /* NULL: no shared expert */
    const void *shared_gate;                  /* [H], router's dtype; NULL: an ungated shared expert */
    int64_t num_experts, top_k, hidden, router_bf16, norm_topk;
};

/* A layer's multi-head latent attention (DeepSeek-V2/V3; see decoder_layers): the layer's `qkv`
 * projects to [q or its low-rank first half | latent | key rope part]. The heads, the latent's
 * width (rank + rope_dim) and the cache are the step's specdec_attention's (hkv 1). */
struct specdec_mla {
    struct specdec_linear q_b;         /* the query's second half; in_features 0: `qkv` holds q whole */
    const void *q_a_norm, *kv_a_norm;  /* RMSNorm weights [q_b.in_features], [rank]: norm_bf16's dtype */
    const uint16_t *kv_b;              /* [hq, nope + v, rank] bf16: W_UK | W_UV of each head */
    int64_t nope_dim, rope_dim, v_dim, interleave;
    float eps;                         /* the two norms' */
};

/* One decoder layer's linears and RMSNorm weights [H] (dtype per decoder_layers' norm_bf16);
 * with `moe` set, the MLP is that block and gate_up / down are unused; with `mla` set, the
 * attention is multi-head latent attention (`qkv` its first projection). */
struct specdec_layer {
    struct specdec_linear qkv, o, gate_up, down;
    const void *input_norm, *post_attention_norm;
    const struct specdec_moe *moe; /* NULL: the dense MLP */
    const void *q_norm, *k_norm;   /* [D]: RMSNorm over each head of q and k before rope (Qwen3); NULL: none */
    const struct specdec_mla *mla; /* NULL: grouped-query attention */
};

/* One step's rotary tables and paged-cache geometry: everything rope_write_attend takes but a
 * layer's caches and buffers, the same for every layer of the step. */
struct specdec_attention {
    const int64_t *positions;       /* [T], or NULL: no rope */
    const float *cos, *signed_sin;  /* [num_positions, d] fp32 */
    int64_t num_positions;
    int64_t num_slots;              /* N * S: slots per layer's K (or V) cache */
    const int64_t *slots;           /* [T] */
    const int32_t *block_tables;    /* [num_seqs, max_blocks] */
    int64_t max_blocks, num_blocks;
    const int32_t *seq_lens;        /* [num_seqs] */
    const int32_t *query_start_loc; /* [num_seqs + 1] */
    int64_t num_seqs, block_size, hq, hkv, d;
    const int64_t *tree_masks;      /* [T]: the window rows each row sees (bit j: row j), or NULL: causal */
};

/* A tensor-parallel group on one machine (see group_allreduce): the shared region, this rank, and
 * this rank's count of all-reduce calls (advanced by each). With out_full > 0 the rank's layers
 * are split exactly (decoder.c column_parallel: o_proj and down_proj cut by output rows, their
 * inputs gathered): its columns of the attention output (att_start, att_width of att_full), of
 * gate and of up (ffn_*: up's at ffn_full + ffn_start) and of the hidden state (out_*). */
struct specdec_group {
    uint8_t *region;
    int64_t rank, world;
    int64_t slot_bytes;  /* each rank's slot: a multiple of 64 */
    int64_t *calls;
    int64_t timeout_ms;  /* SPECDEC_ERR_TIMEOUT after waiting this long for one rank */
    int64_t att_start, att_width, att_full;
    int64_t ffn_start, ffn_width, ffn_full;
    int64_t out_start, out_width, out_full;
};

/* One row of kernel_abi.c's layout table: a field's offset and size, or with an empty `field`
 * the struct's size; with `type` "constant", `field` names a constant and `offset` is its value. */
struct specdec_abi_entry {
    const char *type, *field;
    int64_t offset, size;
};

/* target/quant/qgemm.c */
int qgemm(const void *x, int x_bf16, int64_t m, int64_t k, int glu, const uint8_t *tiles,
          const int64_t *tile_offsets, const uint8_t *tile_bits, int64_t n, const float *bias,
          const void *residual, void *y, int y_bf16, const void *norm_w, int norm_w_bf16, float eps,
          int threads);

/* cache/paged_attention.c */
int rope_write_attend(const struct specdec_attention *a, uint16_t *qkv, int64_t row_stride,
                      uint16_t *k_cache, uint16_t *v_cache, float scale, uint16_t *out, int threads);
int latent_attend(const struct specdec_attention *a, const uint16_t *q, const uint16_t *cache, int64_t dv,
                  float scale, uint16_t *out, int threads);
int head_matmul(const void *x, int x_bf16, int64_t t, int64_t heads, int64_t k, int64_t n, const uint16_t *w,
                int64_t w_head_stride, int transposed, void *out, int out_bf16, int threads);
int latent_write(const struct specdec_attention *a, const uint16_t *kv_a, int64_t row_stride, int64_t rope_dim,
                 int interleave, const void *norm_w, int norm_bf16, float eps, uint16_t *cache, int threads);
int latent_query(const struct specdec_attention *a, const uint16_t *q, int64_t row_stride, int64_t nope,
                 int64_t rope_dim, int interleave, const uint16_t *w_uk, int64_t w_head_stride, uint16_t *query,
                 int threads);

/* target/quant/moe.c (built with qgemm.c) */
int moe_block(const void *x, int x_bf16, int64_t m, const struct specdec_moe *e, const void *norm_w, int norm_bf16,
              float eps, const void *residual, void *y, int32_t *expert_ids, int threads);

/* target/quant/decoder.c (built with qgemm.c, moe.c, paged_attention.c and shm_allreduce.c) */
int decoder_layers(uint16_t *h, int64_t num_rows, const struct specdec_layer *layers, int64_t num_layers,
                   int norm_bf16, float eps, const struct specdec_attention *a, uint16_t *kv, float scale,
                   uint16_t *qkv, uint16_t *att, uint16_t *gate_up, int32_t *expert_ids, int64_t top_k,
                   const struct specdec_group *group, float *partial, int threads);

/* specdec/parallel/shm_allreduce.c: x [n] fp32 summed over the group's ranks, in place (every
 * rank calls it with the same n; the sum in rank order, bitwise the same on every rank) */
int group_allreduce(const struct specdec_group *g, float *x, int64_t n);

/* target/quant/int4_quant.c */
int int4_quantize_rows(const float *w, int64_t n, int64_t k, int64_t group, int32_t *q, uint16_t *scales_and_zeros,
                       int64_t sz_rows, int with_error, double *err_sq, int threads);

/* target/quant/kquant_pack.c */
int kquant_pack(const uint8_t *raw, int64_t row_stride, int64_t n, int64_t k, int kind, uint8_t *out, int threads);
int gguf_rows(const uint8_t *raw, int64_t row_stride, int64_t rows, const int64_t *ids, int64_t n, int64_t k,
              int kind, void *out, int out_bf16);

/* specdec/kernel_abi.c (every library): the layout table and its length. */
int64_t specdec_abi_version(void);
const struct specdec_abi_entry *specdec_abi_layout(int64_t *count);

/* eval/roofline.c: the memory read bandwidth (bytes/s) and the int8 multiply-add peak (per s) */
int roofline_read_bandwidth(int64_t bytes, int threads, int repeats, double *out);
int roofline_int8_peak(int64_t rounds, int threads, double *out);

#endif
