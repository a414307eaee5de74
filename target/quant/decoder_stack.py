"""All decoder layers of a step in one C call (`decoder.c`), for bf16 models on `QLinear` layers.

The Python layer loop costs ~2 ms a step in interpreter and module-call overhead (13% of a draft
forward on the default pair, whose arithmetic takes ~11 ms). `NativeDecoderStack` snapshots the
layers' kernel buffers into a table once and runs every layer's kernel calls from C, the same
calls with the same arguments as the Python loop, so the hidden states come out bitwise the same.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specdec import kernel_abi, native
from specdec.cache import AttentionMetadata, PagedKVCache, cpu_attention
from specdec.kernel_abi import check_tensor
from specdec.target import mla as latent
from specdec.target.moe import SparseMoE
from specdec.target.quant import qgemm
from specdec.target.quant.moe_kernel import NativeMoE, linear_descriptor
from specdec.target.quant.qlinear import QLinear
from specdec.target.rope import Rotation

# qgemm, moe_block and rope_write_attend in one library, so decoder.c calls them directly (linked,
# checked against kernel_abi.h by the compiler) rather than through a pointer passed in from Python.
SOURCES = (qgemm.SOURCE.with_name("decoder.c"), qgemm.SOURCE, qgemm.SOURCE.with_name("moe.c"), cpu_attention.SOURCE,
           Path(kernel_abi.__file__).with_name("parallel") / "shm_allreduce.c")


def kernel(level: native.SimdLevel | str | None = None) -> native.NativeKernel:
    """The library for `level` (None: the one this machine runs; see `native.simd_kernel`)."""
    return native.simd_kernel(SOURCES, ("decoder_layers", "moe_block", "group_allreduce"), level, qgemm.HEADERS)


def attach_moe(model) -> int:
    """Give every MoE block of `model` whose experts fit its `NativeMoE` (the rest keep their
    torch forward); returns how many took one. Call after the last change to the weights."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    lib = kernel().load() if blocks and any(NativeMoE.fits(b) for b in blocks) else None
    for block in blocks:
        block.kernel = NativeMoE.build(block, lib)
    return sum(block.kernel is not None for block in blocks)


def _local(linear):
    """A tensor-parallel rank's part of a row-parallel linear (`parallel.shard.RowParallelLinear`),
    or the linear itself."""
    return getattr(linear, "local", linear)


class NativeDecoderStack:
    """The layer table of one model: `build` it after the last change to the weights (the
    runner does), `run` it per step. Holds references to every buffer in the table."""

    def __init__(self, model, lib: ctypes.CDLL) -> None:
        self.lib = lib
        layers = model.model.layers
        first = layers[0].self_attn
        self.num_layers = len(layers)
        self.mla = model.config.mla  # latent attention layers: one latent "head" of latent_dim a token
        if self.mla is None:
            self.num_q_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        else:
            self.num_q_heads, self.num_kv_heads, self.head_dim = first.num_heads, 1, self.mla.latent_dim
        self.scale = first.scale
        self.hidden = layers[0].input_layernorm.weight.shape[0]
        dense = [layer.mlp for layer in layers if not isinstance(layer.mlp, SparseMoE)]
        self.intermediate = max((mlp.gate_up_proj.out_features // 2 for mlp in dense), default=kernel_abi.TILE)
        self.moe_blocks = [(i, layer.mlp) for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoE)]
        self.top_k = self.moe_blocks[0][1].top_k if self.moe_blocks else 0
        norm = layers[0].input_layernorm
        self.eps, self.norm_bf16 = norm.eps, norm.weight.dtype == torch.bfloat16
        # a tensor-parallel rank: o_proj and down_proj are its parts of sums over the group
        self.comm = getattr(first.o_proj, "group", None)
        self._refs: list[torch.Tensor] = []  # keeps every buffer the table points to alive
        self.table = (kernel_abi.Layer * self.num_layers)()  # decoder.c's layers
        for row, layer in zip(self.table, layers):
            attn, mlp = layer.self_attn, layer.mlp
            if self.mla is not None:
                row.mla = ctypes.pointer(self._latent(attn))
            for field, linear in (("qkv", attn.qkv_a_proj if self.mla else attn.qkv_proj), ("o", _local(attn.o_proj))):
                setattr(row, field, self._linear(linear))
            if isinstance(mlp, SparseMoE):  # its NativeMoE holds what its table points to
                self._refs.append(mlp.kernel)
                row.moe = ctypes.pointer(mlp.kernel.table)
            else:
                row.gate_up, row.down = self._linear(mlp.gate_up_proj), self._linear(_local(mlp.down_proj))
            if getattr(attn, "q_norm", None) is not None and not attn.norm_full:  # Qwen3: per head, the width of a head
                # (OLMoE's whole-width norms are not the C loop's: `use_layer_stack` drops the stack)
                row.q_norm = self._ptr("self_attn.q_norm.weight", attn.q_norm.weight, self.head_dim)
                row.k_norm = self._ptr("self_attn.k_norm.weight", attn.k_norm.weight, self.head_dim)
            row.input_norm = self._ptr("input_layernorm.weight", layer.input_layernorm.weight)
            row.post_attention_norm = self._ptr("post_attention_layernorm.weight", layer.post_attention_layernorm.weight)

    def _gathered(self) -> tuple[int, ...]:
        """The widths a layer's all-reduces carry a row: split exactly, the attention output, the
        hidden state, gate | up and the hidden state again; else the hidden state twice."""
        g = self.comm.descriptor
        return (g.att_full, g.out_full, 2 * g.ffn_full, g.out_full) if self.comm.exact else (self.hidden,) * 2

    def _partial_floats(self, t: int) -> int:
        """The fp32 scratch `decoder.c` split_linear takes for `t` rows (its layout there)."""
        g = self.comm.descriptor
        if not self.comm.exact:
            return t * self.hidden
        inputs = max(g.att_full, 2 * g.ffn_full)
        return t * max(inputs, g.out_full) + -(-t * (inputs + 2 * g.out_width) // 2)  # + the bf16 buffers

    def _linear(self, linear: QLinear) -> kernel_abi.Linear:
        return linear_descriptor(linear, self._refs)

    def _latent(self, attn: "latent.LatentAttention") -> kernel_abi.Mla:
        """A latent attention layer's `kernel_abi.Mla` (kept alive with the table)."""
        mla = self.mla
        w = attn.kv_b_proj.weight
        check_tensor("self_attn.kv_b_proj.weight", w, (torch.bfloat16,),
                     (self.num_q_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank))
        self._refs.append(w)
        low_rank = attn.q_b_proj is not None
        entry = kernel_abi.Mla(
            q_b=self._linear(attn.q_b_proj) if low_rank else kernel_abi.Linear(),
            q_a_norm=self._ptr("self_attn.q_a_layernorm.weight", attn.q_a_layernorm.weight, mla.q_lora_rank)
            if low_rank else None,
            kv_a_norm=self._ptr("self_attn.kv_a_layernorm.weight", attn.kv_a_layernorm.weight, mla.kv_lora_rank),
            kv_b=w.data_ptr(), nope_dim=mla.qk_nope_head_dim, rope_dim=mla.qk_rope_head_dim, v_dim=mla.v_head_dim,
            interleave=int(mla.rope_interleave), eps=attn.kv_a_layernorm.eps,
        )
        self._refs.append(entry)
        return entry

    @staticmethod
    def _latent_fits(model) -> bool:
        """Whether a model's latent attention layers fit `decoder.c`: the first projection fused
        and every projection a `QLinear`, `kv_b_proj` dense bf16, both norms of one eps, widths
        the kernels take (`latent_query`, `latent_attend`, `head_matmul`)."""
        mla = model.config.mla
        attns = [layer.self_attn for layer in model.model.layers]
        return (
            all(isinstance(a.qkv_a_proj, QLinear) and isinstance(a.o_proj, QLinear)
                and (a.q_b_proj is None or isinstance(a.q_b_proj, QLinear))
                and a.kv_b_proj.weight.dtype == torch.bfloat16 for a in attns)
            and len({n.eps for a in attns for n in (a.q_a_layernorm, a.kv_a_layernorm) if n is not None}) == 1
            and mla.kv_lora_rank % 16 == 0 and mla.kv_lora_rank <= kernel_abi.MAX_HEAD_DIM
            and mla.qk_nope_head_dim % 16 == 0 and mla.v_head_dim % 16 == 0
            and mla.qk_rope_head_dim % 2 == 0 and mla.qk_rope_head_dim <= kernel_abi.MAX_HEAD_DIM
            and mla.latent_dim % 16 == 0 and mla.latent_dim <= kernel_abi.MAX_LATENT_DIM
        )

    def _latent_scratch(self, t: int) -> tuple[int, int]:
        """Elements of `decoder.c` latent_attention's `buf` and `att` for `t` rows."""
        mla, heads = self.mla, self.num_q_heads
        first = self.table[0]
        return (t * (first.qkv.out_features + first.mla.contents.q_b.in_features + heads * mla.qk_head_dim
                     + heads * mla.latent_dim + heads * mla.kv_lora_rank), t * heads * mla.v_head_dim)

    def _ptr(self, name: str, t: torch.Tensor, size: int | None = None) -> int:
        check_tensor(name, t, (torch.bfloat16 if self.norm_bf16 else torch.float32,), (size or self.hidden,))
        self._refs.append(t)
        return t.data_ptr()

    @classmethod
    def build(cls, model) -> "NativeDecoderStack | None":
        """The stack of a model whose every layer fits `decoder.c`, else None (the Python loop
        runs): q/k/v and gate/up fused, all four linears `QLinear` (an MoE layer: its block has a
        `NativeMoE`, all of one top k), RMSNorm weights of one dtype (bf16 or fp32) and eps,
        head_dim a multiple of 32 (at most `MAX_HEAD_DIM`), and the kernels built. Latent attention
        layers (MLA) instead: as `_latent_fits` says, on one process (no tensor-parallel split)."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not layers or getattr(model.config, "linear", None) is not None:  # linear attention: Python
            return None
        mla = getattr(model.config, "mla", None) is not None
        attns = [layer.self_attn for layer in layers]
        norms = [n for layer, a in zip(layers, attns)
                 for n in (layer.input_layernorm, layer.post_attention_layernorm, getattr(a, "q_norm", None),
                           getattr(a, "k_norm", None)) if n is not None]
        latent_norms = [n for a in attns for n in (getattr(a, "q_a_layernorm", None), getattr(a, "kv_a_layernorm", None))
                        if n is not None]
        blocks = [layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoE)]
        comm = getattr(layers[0].self_attn.o_proj, "group", None)
        fits = (
            (comm is None or (comm.group is not None and not blocks and not mla))  # its all-reduce in C; no MoE split
            and (cls._latent_fits(model) if mla else all(
                isinstance(_local(m), QLinear) for a in attns for m in (a.qkv_proj, a.o_proj)))
            and all(isinstance(_local(m), QLinear) for layer in layers if not isinstance(layer.mlp, SparseMoE)
                    for m in (layer.mlp.gate_up_proj, layer.mlp.down_proj))
            and all(isinstance(b.kernel, NativeMoE) for b in blocks)
            and len({b.top_k for b in blocks}) <= 1
            and len({(n.weight.dtype, n.eps) for n in norms}) == 1
            and len({n.weight.dtype for n in norms + latent_norms}) == 1
            and norms[0].weight.dtype in (torch.bfloat16, torch.float32)
            and (mla or (attns[0].head_dim % 32 == 0 and attns[0].head_dim <= kernel_abi.MAX_HEAD_DIM))
        )
        if not fits or (lib := kernel().load()) is None:
            return None
        return cls(model, lib)

    def run(self, h: torch.Tensor, rotation: Rotation, kv_cache: PagedKVCache, meta: AttentionMetadata) -> bool:
        """Run every layer on `h [T, hidden]` in place; False (nothing done) where this step
        cannot: not bf16 on the CPU, or a cache the C attention does not read (fp8, scaled).
        `ValueError` where a tensor it reads is malformed."""
        k_cache = kv_cache.layer(0)[0]
        if self.mla is None:
            fits = cpu_attention.supports(meta, h, k_cache, kv_cache.k_scale, kv_cache.v_scale)
        else:  # absorbed windows only (prefill chunks decompress the latents: the Python loop); what
            # supports_latent asks includes what latent_write needs
            fits = (meta.max_query_len < latent.NAIVE_MIN_QUERY_LEN
                    and cpu_attention.supports_latent(meta, h, k_cache, kv_cache.k_scale))
        if not (h.dtype == torch.bfloat16 and h.device.type == "cpu" and h.is_contiguous()
                and kv_cache.kv.is_contiguous() and fits):
            return False
        t = h.shape[0]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        check_tensor("h", h, (torch.bfloat16,), (t, self.hidden))
        num_blocks, block_size = k_cache.shape[:2]
        planes = 1 if self.mla else 2
        check_tensor("kv_cache.kv", kv_cache.kv, (torch.bfloat16,), (self.num_layers, planes, num_blocks, block_size, hkv, d))
        attention = cpu_attention.attention_descriptor(
            meta, rotation.positions, rotation.cos_table, rotation.signed_sin_table, k_cache, hq, hkv,
            latent=self.mla is not None,
        )
        if self.mla is None:
            qkv, att = h.new_empty(t, (hq + 2 * hkv) * d), h.new_empty(t, hq * d)
        else:
            buf, att_elems = self._latent_scratch(t)
            qkv, att = h.new_empty(buf), h.new_empty(att_elems)
        gate_up = h.new_empty(t, 2 * self.intermediate)
        expert_ids = torch.empty(self.num_layers, t, self.top_k, dtype=torch.int32) if self.top_k else None
        partial = None if self.comm is None else torch.empty(self._partial_floats(t), dtype=torch.float32)
        rc = self.lib.decoder_layers(
            h.data_ptr(), t, self.table, self.num_layers, self.norm_bf16, self.eps, ctypes.byref(attention),
            kv_cache.kv.data_ptr(), self.scale, qkv.data_ptr(), att.data_ptr(), gate_up.data_ptr(),
            None if expert_ids is None else expert_ids.data_ptr(), self.top_k,
            None if partial is None else ctypes.byref(self.comm.group), None if partial is None else partial.data_ptr(),
            torch.get_num_threads(),
        )
        if self.comm is not None:
            for _ in range(self.num_layers):
                for width in self._gathered():
                    self.comm.count(t * width)
            self.comm.raise_for_status(rc)
        kernel_abi.raise_for_status(rc, "decoder_layers")
        for i, block in self.moe_blocks:
            block.last_expert_ids = expert_ids[i]
        return True
