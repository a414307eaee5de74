"""Multi-head latent attention (DeepSeek-V2/V3), the attention block a config with `mla` gets in
place of `model.Attention` (GQA).

Per token the layer caches one latent: `c = norm(W_DKV x)` (`kv_lora_rank` wide) and the rotated
key part `k_rope` (`qk_rope_head_dim`, shared by every head), `latent_dim` values in all, in a
latent cache (`KVCacheSpec.latent_rank`). Head h's key is `[W_UK[h] c | k_rope]` and its value
`W_UV[h] c`, where `kv_b_proj` holds `W_UK[h] | W_UV[h]` for every head. Two ways to attend, equal
in exact arithmetic:

- naive (prefill chunks): decompress the latents of every block the step reads through
  `kv_b_proj` into per-head keys and values, attend as GQA does;
- absorbed (decode and verify windows): fold `W_UK` into the query, `q_lat[h] = q_nope[h] W_UK[h]`,
  attend with `[q_lat | q_rope]` over the latents themselves as keys (one head shared by all query
  heads, MQA) and their first `kv_lora_rank` values as values, then apply `W_UV` to each head's
  result. Nothing is decompressed; the cache is read once for all heads.

A step whose longest window has more than `NAIVE_MIN_QUERY_LEN` - 1 rows takes the naive path,
others the absorbed one: in C where it runs (`cpu_attention.latent_query`: `W_UK` and the query's
rope, `latent_attend`, `head_matmul` for `W_UV`: every row computed alone, in a fixed order),
else in torch (products in fp32). On bf16 CPU caches the latents are normalised, rotated and
written in C on both paths (`latent_write`), so a token's latent does not depend on its step.
The C layer loop (`decoder.c`) makes the same calls for a whole bf16 step of absorbed windows.
`kv_b_proj` stays dense (`keep_dense`): the absorbed path reads it as per-head matrices, not as
a linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.cache import AttentionMetadata, PagedKVCache, compact_blocks, cpu_attention, paged_attention
from specdec.cache import paged_attention_ref, write_latent
from specdec.target.config import ModelConfig
from specdec.target.layers import RMSNorm, normed, plus_linear
from specdec.target.rope import Rotation, apply_rope

# Windows of at least this many rows (prefill chunks) decompress the latents; shorter ones
# (decode, verify) attend over them absorbed. At DeepSeek-V2-Lite's shapes the absorbed path does
# fewer operations up to ~170 rows a sequence, but the naive path's SDPA runs blocked.
NAIVE_MIN_QUERY_LEN = 64
NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm and kv_a_layernorm (transformers' default, not the config's)


class DenseLinear(nn.Linear):
    """A linear the quantizers leave dense (`keep_dense`)."""

    keep_dense = True


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.mla, self.num_heads = mla, config.num_heads
        self.scale = config.query_scale if config.query_scale is not None else mla.qk_head_dim**-0.5
        hidden, heads, bias = config.hidden_size, config.num_heads, config.attention_bias
        if mla.q_lora_rank:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, heads * mla.qk_head_dim, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=bias)
        self.qkv_a_proj: nn.Module | None = None  # [q_proj or q_a_proj | kv_a_proj_with_mqa]: fuse_projections
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, NORM_EPS)
        self.kv_b_proj = DenseLinear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=bias)

    c_kernel_fits = True  # nothing here the C attention leaves to the reference

    def fuse_projections(self, fuse) -> None:
        """Replace the two projections of the layer's input (the query's, or its low-rank first
        half, and the latent's) by `fuse([q, kv_a])`, one module computing both, where it can."""
        first = self.q_proj if self.q_proj is not None else self.q_a_proj
        if self.qkv_a_proj is None and first is not None and (fused := fuse([first, self.kv_a_proj_with_mqa])) is not None:
            self.qkv_a_proj = fused
            self.q_proj = self.q_a_proj = self.kv_a_proj_with_mqa = None

    def _project(self, x: torch.Tensor, norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(q [T, H * qk_head_dim], kv_a [T, rank + R])` of `norm(x)`; the norms fused into the
        projections where they are `QLinear`s (`normed`)."""
        mla, low_rank = self.mla, self.q_b_proj is not None
        if self.qkv_a_proj is not None:
            q_width = mla.q_lora_rank if low_rank else self.num_heads * mla.qk_head_dim
            q, kv_a = normed(norm, self.qkv_a_proj, x).split([q_width, mla.latent_dim], dim=-1)
        else:
            x = x if norm is None else norm(x)
            q, kv_a = (self.q_a_proj if low_rank else self.q_proj)(x), self.kv_a_proj_with_mqa(x)
        return (normed(self.q_a_layernorm, self.q_b_proj, q.contiguous()) if low_rank else q), kv_a

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rotation: Rotation,
        kv_cache: PagedKVCache,
        layer_idx: int,
        meta: AttentionMetadata,
        norm: RMSNorm | None = None,  # applied to x first
        residual: torch.Tensor | None = None,  # [T, hidden]: returned plus the attention output
    ) -> torch.Tensor:  # [T, hidden]
        mla, t, heads = self.mla, x.shape[0], self.num_heads
        q, kv_a = self._project(x, norm)
        k_cache, v_cache = kv_cache.layer(layer_idx)  # latents [N, S, 1, rank + R] and their first rank dims
        if cpu_attention.writes_latent(meta, kv_a, k_cache, kv_cache.k_scale):  # norm, rope, write in C
            cpu_attention.latent_write(kv_a, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, mla.rope_interleave,
                                       rotation, k_cache, meta)
        else:
            c, k_rope = kv_a.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
            k_rope = _deinterleave(k_rope) if mla.rope_interleave else k_rope
            k_rope = apply_rope(k_rope.unsqueeze(1), *rotation.cos_sin).squeeze(1)
            latent = torch.cat([self.kv_a_layernorm(c), k_rope], dim=-1)
            write_latent(latent.unsqueeze(1), k_cache, meta.slot_mapping, kv_cache.k_scale)
        absorbed = meta.max_query_len < NAIVE_MIN_QUERY_LEN
        if absorbed and cpu_attention.supports_latent(meta, q, k_cache, kv_cache.k_scale):  # the whole path in C
            out = self.absorbed_in_c(q, rotation, k_cache, meta)
        else:
            q_nope, q_rope = q.reshape(t, heads, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
            if mla.rope_interleave:  # pairs (0, 1), (2, 3), ... -> halves, as the keys' were
                q_rope = _deinterleave(q_rope)
            q_rope = apply_rope(q_rope, *rotation.cos_sin)  # [T, H, R]
            out = (self.absorbed(q_nope, q_rope, k_cache, v_cache, kv_cache.k_scale, meta) if absorbed
                   else self.naive(q_nope, q_rope, k_cache, kv_cache.k_scale, meta))
        return plus_linear(residual, self.o_proj, out.reshape(t, heads * mla.v_head_dim))

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(W_UK [H, nope, rank], W_UV [H, v, rank])`: views of `kv_b_proj`'s weight."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :]

    def absorbed_in_c(
        self,
        q: torch.Tensor,  # [T, H * qk_head_dim]: q_nope | q_rope per head, not rotated
        rotation: Rotation,
        k_cache: torch.Tensor,  # [N, S, 1, rank + R], this step's latents written
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, v]
        """The absorbed path in C, row by row (`latent_query`, `latent_attend`, `head_matmul`):
        the calls `decoder.c` makes for the layer, so the C layer loop gives the same bits."""
        w_uk, w_uv = self._w_uk_uv()
        query = cpu_attention.latent_query(q, w_uk, self.mla.rope_interleave, rotation, k_cache, meta)
        out = cpu_attention.latent_attend(query, k_cache, self.mla.kv_lora_rank, meta, self.scale)  # [T, H, rank]
        return cpu_attention.head_matmul(out, w_uv, transposed=True, lib=meta.scratch.get("cpu_attention_lib"))

    def absorbed(
        self,
        q_nope: torch.Tensor,  # [T, H, nope]
        q_rope: torch.Tensor,  # [T, H, R], rotated
        k_cache: torch.Tensor,  # [N, S, 1, rank + R]
        v_cache: torch.Tensor,  # [N, S, 1, rank]: a view of k_cache
        kv_scale: float,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, v]
        """Attention over the latents as keys and values, `W_UK` folded into the queries and `W_UV`
        applied after, in torch (products in fp32)."""
        w_uk, w_uv = self._w_uk_uv()
        dtype = q_nope.dtype  # products in fp32 (a bf16 bmm is ~20x slower on CPUs without bf16 units)
        q_lat = torch.bmm(q_nope.float().transpose(0, 1), w_uk.float()).transpose(0, 1).to(dtype)  # [T, H, rank]
        query = torch.cat([q_lat, q_rope], dim=-1)  # [T, H, rank + R]
        out = paged_attention(query, k_cache, v_cache, meta, self.scale, kv_scale, kv_scale)  # [T, H, rank]
        return torch.bmm(out.float().transpose(0, 1), w_uv.float().transpose(1, 2)).transpose(0, 1).to(dtype)  # [T, H, v]

    def naive(
        self,
        q_nope: torch.Tensor,  # [T, H, nope]
        q_rope: torch.Tensor,  # [T, H, R], rotated
        k_cache: torch.Tensor,  # [N, S, 1, rank + R]
        kv_scale: float,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, v]
        """Per-head keys and values decompressed from the latents of every block the step reads
        (a cached prefix's too), then GQA-style attention over them."""
        mla, heads = self.mla, self.num_heads
        block_ids, compact = compact_blocks(meta)
        latents = k_cache.index_select(0, block_ids.to(k_cache.device)).to(q_nope.dtype)  # [n, S, 1, rank + R]
        if kv_scale != 1.0:
            latents = latents * kv_scale
        n, s = latents.shape[:2]
        c, k_rope = latents.view(n * s, mla.latent_dim).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        weight = self.kv_b_proj.weight  # decompressed in fp32 (as fast as bf16 is slow without bf16 units)
        kv = F.linear(c.float(), weight.float()).to(c.dtype).view(n * s, heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, values = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        keys = torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, heads, -1)], dim=-1)
        query = torch.cat([q_nope, q_rope], dim=-1)  # [T, H, nope + R]
        return paged_attention_ref(query, keys.view(n, s, heads, mla.qk_head_dim),
                                   values.reshape(n, s, heads, mla.v_head_dim), compact, self.scale)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """`[..., x0, x1, x2, x3, ...]` -> `[..., x0, x2, ..., x1, x3, ...]`: DeepSeek's interleaved
    rope pairs as the rotate-half layout `apply_rope` rotates (the pair (x0, x1) becomes the pair
    of lanes 0 and R/2). Applied to queries and keys alike, it leaves every q . k unchanged."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
