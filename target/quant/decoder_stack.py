"""All decoder layers of a step in one C call (`decoder.c`), for bf16 models on `QLinear` layers.

The Python layer loop costs ~2 ms a step in interpreter and module-call overhead (13% of a draft
forward on the default pair, whose arithmetic takes ~11 ms). `NativeDecoderStack` snapshots the
layers' kernel buffers into a table once and runs every layer's kernel calls from C, the same
calls with the same arguments as the Python loop, so the hidden states come out bitwise the same.
"""

from __future__ import annotations

import ctypes

import torch

from specdec.cache import AttentionMetadata, PagedKVCache, cpu_attention
from specdec.target.quant.qgemm import load_qgemm
from specdec.target.quant.qlinear import QLinear
from specdec.target.rope import Rotation


class NativeDecoderStack:
    """The layer table of one model: `build` it after the last change to the weights (the
    runner does), `run` it per step. Holds references to every buffer in the table."""

    def __init__(self, model, lib: ctypes.CDLL) -> None:
        self.lib = lib
        layers = model.model.layers
        first = layers[0].self_attn
        self.num_layers = len(layers)
        self.num_q_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.scale = first.scale
        self.intermediate = layers[0].mlp.down_proj.in_features
        norm = layers[0].input_layernorm
        self.eps, self.norm_bf16 = norm.eps, norm.weight.dtype == torch.bfloat16
        self._refs: list[torch.Tensor] = []  # keeps every buffer the table points to alive
        rows = []
        for layer in layers:
            row = []
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                row += [self._ptr(linear.tiles), self._ptr(linear.tile_offsets), self._ptr(linear.tile_bits),
                        linear.in_features, linear.out_features,
                        0 if linear.bias is None else self._ptr(linear.bias)]
            row += [self._ptr(layer.input_layernorm.weight), self._ptr(layer.post_attention_layernorm.weight)]
            rows.append(row)
        self.table = torch.tensor(rows, dtype=torch.int64)  # [L, 26]: decoder.c's struct layer

    def _ptr(self, t: torch.Tensor) -> int:
        assert t.is_contiguous()
        self._refs.append(t)
        return t.data_ptr()

    @classmethod
    def build(cls, model) -> "NativeDecoderStack | None":
        """The stack of a model whose every layer fits `decoder.c`, else None (the Python loop
        runs): q/k/v and gate/up fused, all four linears `QLinear`, RMSNorm weights of one dtype
        (bf16 or fp32) and eps, head_dim a multiple of 32, and the kernels built."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not layers:
            return None
        norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        fits = (
            all(
                isinstance(m, QLinear)
                for layer in layers
                for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            )
            and len({(n.weight.dtype, n.eps) for n in norms}) == 1
            and norms[0].weight.dtype in (torch.bfloat16, torch.float32)
            and layers[0].self_attn.head_dim % 32 == 0
        )
        if not fits or (lib := load_qgemm()) is None or cpu_attention.load_attention() is None:
            return None
        return cls(model, lib)

    def run(self, h: torch.Tensor, rotation: Rotation, kv_cache: PagedKVCache, meta: AttentionMetadata) -> bool:
        """Run every layer on `h [T, hidden]` in place; False (nothing done) where this step
        cannot: not bf16 on the CPU, or a cache the C attention does not read (fp8, scaled)."""
        k_cache = kv_cache.layer(0)[0]
        if not (
            h.dtype == torch.bfloat16
            and h.is_contiguous()
            and kv_cache.kv.is_contiguous()
            and cpu_attention.supports(meta, h, k_cache, kv_cache.k_scale, kv_cache.v_scale)
        ):
            return False
        t = h.shape[0]
        num_blocks, block_size = k_cache.shape[:2]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        attention = torch.tensor(
            [rotation.positions.data_ptr(), rotation.cos_table.data_ptr(), rotation.signed_sin_table.data_ptr(),
             rotation.cos_table.shape[0], kv_cache.kv.data_ptr(), num_blocks * block_size,
             meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr(), meta.block_tables.shape[1],
             num_blocks, meta.seq_lens.data_ptr(), meta.query_start_loc.data_ptr(), meta.num_seqs,
             block_size, hq, hkv, d],
            dtype=torch.int64,
        )  # decoder.c's struct attention
        qkv = h.new_empty(t, (hq + 2 * hkv) * d)
        att = h.new_empty(t, hq * d)
        gate_up = h.new_empty(t, 2 * self.intermediate)
        attend = meta.scratch.get("cpu_attention_lib") or cpu_attention.load_attention()
        rc = self.lib.decoder_layers(
            h.data_ptr(), t, self.table.data_ptr(), self.num_layers, self.norm_bf16, self.eps,
            attention.data_ptr(), ctypes.cast(attend.rope_write_attend, ctypes.c_void_p).value, self.scale,
            qkv.data_ptr(), att.data_ptr(), gate_up.data_ptr(), torch.get_num_threads(),
        )
        if rc == -100:
            raise MemoryError("qgemm could not allocate its activation buffers")
        if rc != 0:
            raise ValueError(cpu_attention.ERRORS.get(rc, f"rope_write_attend failed ({rc})"))
        return True
