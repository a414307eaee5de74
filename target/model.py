"""One decoder for the Llama family and its relatives (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3, SmolLM3, Granite, GLM-4,
the mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss, DeepSeek-V2/V3, and the hybrid Qwen3-Next) over flat,
varlen token batches. A layer's blocks are chosen by the config: attention GQA (`Attention`),
multi-head latent (`mla.LatentAttention`) or a hybrid's linear attention (`linear_attention.GatedDeltaNet`,
Qwen3-Next), MLP dense (`MLP`) or sparse (`moe.SparseMoE`), per layer.

The model sees only `input_ids [T]`, `positions [T]`, the paged KV cache and the attention metadata
of one step; it returns logits only for the rows asked for (`logits_indices`), so verification can
keep all `k+1` rows of each window while prefill keeps just the last one. Parameter names are
identical to transformers', so an HF safetensors state dict loads as it is (Phi-3's fused
`qkv_proj` / `gate_up_proj` included: the model keeps them fused). What a family adds to Llama's
layer is a `ModelConfig` feature; with none of them the arithmetic is Llama's, op for op.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from specdec.cache import AttentionMetadata, PagedKVCache, cpu_attention, paged_attention, write_kv
from specdec.target.config import ModelConfig
from specdec.target.layers import RMSNorm, gelu_tanh, make_norm, normed, plus_linear
from specdec.target.linear_attention import GatedDeltaNet
from specdec.target.mla import LatentAttention
from specdec.target.moe import SparseMoE
from specdec.target.rope import RotaryEmbedding, Rotation, apply_rope, pairs_to_halves

MAX_ROPE_POSITIONS = 32768
log = logging.getLogger("specdec")


class LayerStack(Protocol):
    """Another way to run every decoder layer of a step (`quant.decoder_stack.NativeDecoderStack`:
    one C call); the runner chooses it, the model only calls it."""

    def run(self, h: torch.Tensor, rotation: Rotation, kv_cache: PagedKVCache, meta: AttentionMetadata) -> bool:
        """Run every layer on `h [T, hidden]` in place; False (nothing done) where it cannot."""


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        d, hq, hkv = config.head_dim, config.num_heads, config.num_kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, d
        self.scale = d**-0.5 if config.query_scale is None else config.query_scale
        self.window = config.window(layer_idx)  # None: every earlier key
        self.softcap = config.attn_logit_softcap
        bias = config.attention_bias
        # Qwen3-Next: q_proj gives each head's query and a gate, the output scaled by sigmoid(gate)
        self.output_gate = config.attn_output_gate
        self.qkv_proj: nn.Module | None = None  # set by fuse_projections (or fused in the checkpoint)
        if config.fused_checkpoint:
            self.qkv_proj = nn.Linear(config.hidden_size, (hq + 2 * hkv) * d, bias=bias)
            self.q_proj = self.k_proj = self.v_proj = None
        else:
            self.q_proj = nn.Linear(config.hidden_size, hq * d * (2 if self.output_gate else 1), bias=bias)
            self.k_proj = nn.Linear(config.hidden_size, hkv * d, bias=bias)
            self.v_proj = nn.Linear(config.hidden_size, hkv * d, bias=bias)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=config.o_bias)
        # per head, before rope (Qwen3, Gemma 3); OLMoE: over all heads of q (of k) at once
        self.norm_full = config.qk_norm_full
        self.q_norm = make_norm(config, hq * d if self.norm_full else d) if config.qk_norm or self.norm_full else None
        self.k_norm = make_norm(config, hkv * d if self.norm_full else d) if config.qk_norm or self.norm_full else None
        self.clip = config.clip_qkv  # OLMoE: q, k, v clamped to [-clip, clip] after the norms
        self.partial_rotary = config.rotary_dim is not None  # the C attention turns whole heads
        self.rope_pairs = config.rope_pairs  # GLM-4: pairs (0, 1), (2, 3), ... turn, not the two halves
        # gpt-oss: per head, a logit with no value joins the softmax (attention may go nowhere)
        self.sinks = nn.Parameter(torch.zeros(hq)) if config.attention_sinks else None

    def fuse_projections(self, fuse) -> None:
        """Replace q/k/v by `fuse([q, k, v])`, one module computing all three (unless it is None;
        a gated q stays apart)."""
        if self.qkv_proj is None and not self.output_gate and (fused := fuse([self.q_proj, self.k_proj, self.v_proj])) is not None:
            self.qkv_proj = fused
            self.q_proj = self.k_proj = self.v_proj = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rotation: Rotation,
        kv_cache: PagedKVCache,
        layer_idx: int,
        meta: AttentionMetadata,
        norm: RMSNorm | None = None,  # applied to x first (fused into the projection where it can)
        residual: torch.Tensor | None = None,  # [T, hidden]: returned plus the attention output
    ) -> torch.Tensor:  # [T, hidden]
        hq, hkv = self.num_heads, self.num_kv_heads
        k_cache, v_cache = kv_cache.layer(layer_idx)
        if self.qkv_proj is not None:
            qkv = normed(norm, self.qkv_proj, x)  # [T, (Hq + 2 Hkv) * D]
        else:
            x = x if norm is None else norm(x)
            q, gate = self.q_proj(x), None
            if self.output_gate:  # [T, Hq, 2D]: each head's query, then its gate
                q, gate = q.view(x.shape[0], hq, 2 * self.head_dim).chunk(2, dim=-1)
                q, gate = q.reshape(x.shape[0], -1), gate.reshape(x.shape[0], -1)
            qkv = torch.cat([q, self.k_proj(x), self.v_proj(x)], dim=-1)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        scales = (kv_cache.k_scale, kv_cache.v_scale)
        if cpu_attention.supports(meta, qkv, k_cache, *scales) and self.c_kernel_fits:
            out = cpu_attention.rope_write_attend(
                qkv, hq, hkv, rotation.positions, rotation.cos_table, rotation.signed_sin_table,
                k_cache, v_cache, meta, self.scale,
            )  # [T, Hq * D]: rope, KV write and attention in one kernel call
        else:
            out = self._reference(qkv, *rotation.cos_sin, kv_cache, layer_idx, meta)
        if self.output_gate:
            out = out * torch.sigmoid(gate)
        return plus_linear(residual, self.o_proj, out)

    def _reference(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: PagedKVCache,
                   layer_idx: int, meta: AttentionMetadata) -> torch.Tensor:  # [T, Hq * D]
        """Rope, KV write and attention in torch ops (SDPA, or Triton by `meta.backend`)."""
        t, d, hq, hkv = qkv.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        k_cache, v_cache = kv_cache.layer(layer_idx)
        qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=-1)  # rotate q and k together
        qk = qk.view(t, hq + hkv, d)
        if self.rope_pairs:  # the same permutation of q's and k's dims leaves q . k as it was
            qk = pairs_to_halves(qk, cos.shape[-1])
        q, k = apply_rope(qk, cos, sin).split([hq, hkv], dim=1)
        write_kv(k, v.view(t, hkv, d), k_cache, v_cache, meta.slot_mapping, kv_cache.k_scale, kv_cache.v_scale)
        return paged_attention(
            q, k_cache, v_cache, meta, self.scale, kv_cache.k_scale, kv_cache.v_scale, self.window, self.softcap,
            self.sinks,
        ).reshape(t, hq * d)

    @property
    def c_kernel_fits(self) -> bool:
        """The C attention (`cpu_attention`) implements neither sliding windows, soft-capping,
        clipping, partial rotary nor sinks."""
        return (self.window is None and self.softcap is None and self.clip is None and not self.partial_rotary
                and not self.rope_pairs and self.sinks is None)

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:  # [T, (Hq + 2 Hkv) * D]
        """`qkv` with each head of q and k RMS-normalised (Qwen3, Gemma 3)."""
        t, d, hq, hkv = qkv.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        if self.norm_full:
            return torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        q = self.q_norm(q.reshape(t, hq, d)).reshape(t, hq * d)
        k = self.k_norm(k.reshape(t, hkv, d)).reshape(t, hkv * d)
        return torch.cat([q, k, v], dim=-1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None, expert: bool = False) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, intermediate_size or config.intermediate_size
        moe = config.moe if expert else None  # an expert of it: gpt-oss's have biases and a clamped SwiGLU
        bias = moe is not None and moe.expert_bias
        self.gate_up_proj: nn.Module | None = None  # set by fuse_projections (or fused in the checkpoint)
        if config.fused_checkpoint or config.fused_gate_up:
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
            self.gate_proj = self.up_proj = None
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=bias)
            self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = None if config.hidden_act == "silu" else gelu_tanh  # None: SiLU, fused where it can
        self.limit, self.alpha = (None, 1.0) if moe is None else (moe.swiglu_limit, moe.swiglu_alpha)

    def fuse_projections(self, fuse) -> None:
        """Replace gate/up by `fuse([gate, up])`, one module computing both (unless it is None)."""
        if self.gate_up_proj is None and (fused := fuse([self.gate_proj, self.up_proj])) is not None:
            self.gate_up_proj = fused
            self.gate_proj = self.up_proj = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        norm: RMSNorm | None = None,  # applied to x first (fused into the projection where it can)
        residual: torch.Tensor | None = None,  # [T, hidden]: returned plus the MLP output
    ) -> torch.Tensor:  # [T, hidden]
        if self.gate_up_proj is not None:
            gate_up = normed(norm, self.gate_up_proj, x)  # [T, 2 * intermediate]
        else:
            x = x if norm is None else norm(x)
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], -1)
        if self.act is None and self.limit is None:
            return plus_linear(residual, self.down_proj, gate_up, glu=True)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is not None:  # gpt-oss: transformers' `GptOssExperts._apply_gate`
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return plus_linear(residual, self.down_proj, (up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
        return plus_linear(residual, self.down_proj, self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        # the token mixer: Gated DeltaNet on a hybrid model's linear layers, else MLA or GQA
        linear = config.is_linear_layer(layer_idx)
        self.linear_attn = GatedDeltaNet(config, layer_idx) if linear else None
        self.self_attn = None if linear else (
            LatentAttention(config, layer_idx) if config.mla is not None else Attention(config, layer_idx))
        self.mlp = SparseMoE(config, MLP) if config.is_moe_layer(layer_idx) else MLP(config)
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        # Gemma: the attention's and the MLP's outputs are normalised before their residual adds,
        # and post_attention_layernorm is the first of those (the MLP's input norm is pre_feedforward)
        gemma = config.gemma_norms
        self.pre_feedforward_layernorm = make_norm(config, config.hidden_size) if gemma else None
        self.post_feedforward_layernorm = make_norm(config, config.hidden_size) if gemma else None
        # GLM-4: the same two output norms under its own names (post_attention_layernorm stays the MLP's input norm)
        self.post_self_attn_layernorm = make_norm(config, config.hidden_size) if config.glm_norms else None
        self.post_mlp_layernorm = make_norm(config, config.hidden_size) if config.glm_norms else None
        self.residual_scale = config.residual_scale  # Granite: each block's output scaled before its add

    @property
    def mixer(self) -> nn.Module:
        """The layer's token mixer (attention, or a hybrid's linear attention)."""
        return self.self_attn if self.linear_attn is None else self.linear_attn

    def forward(self, h, rotation, kv_cache, layer_idx, meta) -> torch.Tensor:
        if (scale := self.residual_scale) is not None:
            h = h + self.self_attn(h, rotation, kv_cache, layer_idx, meta, norm=self.input_layernorm) * scale
            return h + self.mlp(h, norm=self.post_attention_layernorm) * scale
        if self.post_self_attn_layernorm is not None:
            attn = self.self_attn(h, rotation, kv_cache, layer_idx, meta, norm=self.input_layernorm)
            h = h + self.post_self_attn_layernorm(attn)
            return h + self.post_mlp_layernorm(self.mlp(h, norm=self.post_attention_layernorm))
        if self.pre_feedforward_layernorm is not None:
            attn = self.self_attn(h, rotation, kv_cache, layer_idx, meta, norm=self.input_layernorm)
            h = h + self.post_attention_layernorm(attn)
            return h + self.post_feedforward_layernorm(self.mlp(h, norm=self.pre_feedforward_layernorm))
        h = self.mixer(h, rotation, kv_cache, layer_idx, meta, norm=self.input_layernorm, residual=h)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h)


def _embedding(num: int, dim: int) -> nn.Embedding:
    """`nn.Embedding`; on the meta device without its random init, which imports torch._dynamo
    there (~2 s of every load)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = make_norm(config, config.hidden_size)


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head; `forward` returns logits `[R, V]` (fp32) for `logits_indices` only."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        max_pos = min(config.max_position_embeddings, MAX_ROPE_POSITIONS)
        self.rotary = RotaryEmbedding(config.hf_config, config.rotary_dim or config.head_dim, max_pos)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._layer_stack: LayerStack | None = None  # see use_layer_stack
        self._told_c_attention = False  # the C attention's fallback is logged once
        # A pipeline stage keeps layers layer_offset.. of the model (`specdec.parallel.shard`)
        self.layer_offset = 0
        # a hybrid's paged KV holds its attention layers only: layer i's index among them
        self.kv_layers = [sum(not config.is_linear_layer(j) for j in range(i)) for i in range(config.num_layers)]

    def use_layer_stack(self, stack: LayerStack | None) -> None:
        """Run the decoder layers through `stack` from now on where it can (None: the Python loop).
        A stack snapshots the layers' buffers: set it after the last change to the weights (the
        runner does); `.to()` and friends drop it. A stack runs Llama's layer only: a model whose
        layers differ keeps the Python loop (logged)."""
        if stack is not None and (differences := self.config.c_loop_differences()):
            log.info("layers run in Python: the C layer loop implements Llama's layer, not %s", ", ".join(differences))
            stack = None
        self._layer_stack = stack

    def _apply(self, fn, *args, **kwargs):
        self._layer_stack = None  # .to(), .float(), ...: the snapshot would point at old buffers
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):  # copies and pickles leave the snapshot behind (it points at our buffers)
        return {**super().__getstate__(), "_layer_stack": None}

    @property
    def max_positions(self) -> int:
        return self.rotary.cos.shape[0]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [R]
    ) -> torch.Tensor:
        h = self.run_layers(self.embed(input_ids), positions, kv_cache, meta)
        if logits_indices.numel() == 0:  # a pure cache fill (prefill chunks)
            return h.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        return self.head(h[logits_indices])

    # forward's three parts, which a pipeline stage runs apart (`specdec.parallel`)
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        h = self.model.embed_tokens(input_ids)
        if self.config.embedding_scale is not None:  # rounded to the model dtype, as transformers does
            h = h * torch.tensor(self.config.embedding_scale).to(h.dtype)
        return h

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                   meta: AttentionMetadata) -> torch.Tensor:  # [T, hidden], every layer this model holds
        rotation = self.rotary(positions, h.dtype)
        local = self.rotary.local_rotation(positions, h.dtype)  # Gemma 3's sliding layers; else None
        nope = self.config.nope_layers
        # SmolLM3's layers without rope: the rotation of position 0 is the identity
        still = self.rotary(torch.zeros_like(positions), h.dtype) if any(nope) else None
        stack = self._layer_stack
        if stack is None or not stack.run(h, rotation, kv_cache, meta):  # run: h in place
            for i, layer in enumerate(self.model.layers):
                at = self.layer_offset + i
                local_rope = local is not None and self.config.local_rope_layers[at]
                h = layer(h, still if still is not None and nope[at] else local if local_rope else rotation,
                          kv_cache, i if self.config.linear is None else self.kv_layers[i], meta)
            self._tell_c_attention(meta)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> logits [R, V] fp32
        logits = normed(self.model.norm, self.lm_head, h).float()
        if (divisor := self.config.logit_divisor) is not None:  # Granite
            logits = logits / divisor
        if (softcap := self.config.final_logit_softcap) is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def _tell_c_attention(self, meta: AttentionMetadata) -> None:
        """Log once when the C attention ran this step but some layers could not use it."""
        if self._told_c_attention or not meta.scratch.get("cpu_attention"):
            return
        self._told_c_attention = True
        if not all(layer.mixer.c_kernel_fits for layer in self.model.layers):
            log.info("sliding-window and soft-capped attention layers use the torch reference attention: the C "
                     "kernel implements neither")
