"""KV writes and varlen paged attention: a vectorized torch reference, Triton on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_cache import FP8_DTYPES
from .metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter this step's keys and values into their cache slots (stored = value / scale)."""
    _write_one(key, k_cache, slot_mapping, k_scale)
    _write_one(value, v_cache, slot_mapping, v_scale)


def _write_one(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale: float) -> None:
    num_blocks, block_size, num_heads, head_dim = cache.shape
    flat = cache.view(num_blocks * block_size, num_heads, head_dim)  # [N*S, Hkv, D]
    if scale != 1.0:
        x = x / scale
    if cache.dtype in FP8_DTYPES:
        # Saturate rather than rely on the cast's overflow behaviour (e4m3fn has no inf).
        limit = torch.finfo(cache.dtype).max
        x = x.clamp(-limit, limit)
    x = x.to(cache.dtype)
    if cache.element_size() == 1:  # index_copy_ has no fp8 kernel; copy the raw bytes
        flat, x = flat.view(torch.uint8), x.view(torch.uint8)
    flat.index_copy_(0, slots, x)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, Hq, D]
    """Varlen causal attention over the paged cache: the Triton kernel on CUDA, else the reference.

    Query ``i`` of sequence ``b`` sits at position ``seq_len_b - query_len_b + i`` and attends to
    keys ``0..`` that position (causal within the window, full over the cached prefix).
    """
    if query.is_cuda:
        from .triton_attention import triton_available

        if triton_available():
            from .triton_attention import paged_attention_triton

            return paged_attention_triton(query, k_cache, v_cache, meta, scale, k_scale, v_scale)
    return paged_attention_ref(query, k_cache, v_cache, meta, scale, k_scale, v_scale)


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, Hq, D]
    """Torch reference of ``paged_attention``: one padded, batched SDPA call.

    Gathers each sequence's blocks into ``[B, max_kv, Hkv, D]``, pads the queries to
    ``[B, max_q, Hq, D]`` and masks key ``j`` for query ``i`` unless
    ``j <= seq_len - query_len + i``. GQA folds the ``G = Hq // Hkv`` query heads that share a
    KV head into the query axis, so keys and values are never repeated. Uses only the host copies
    of the lengths: no device sync. Computes in the query dtype.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    _check_heads(num_q_heads, num_kv_heads)
    group = num_q_heads // num_kv_heads
    seq_lens, query_lens = meta.seq_lens_cpu, meta.query_lens_cpu
    batch, max_q, max_kv = len(seq_lens), meta.max_query_len, meta.max_seq_len
    if num_tokens == 0:
        return query.new_empty(0, num_q_heads, head_dim)
    keys = _gather_kv(k_cache, meta.block_tables, max_kv, k_scale, query.dtype)  # [B, Hkv, max_kv, D]
    values = _gather_kv(v_cache, meta.block_tables, max_kv, v_scale, query.dtype)

    uniform = all(q == max_q for q in query_lens)
    if uniform:
        padded = query.view(batch, max_q, num_q_heads, head_dim)
    else:
        rows = _padded_rows(query_lens, max_q, query.device)  # [T]
        padded = query.new_zeros(batch * max_q, num_q_heads, head_dim)
        padded.index_copy_(0, rows, query)
        padded = padded.view(batch, max_q, num_q_heads, head_dim)
    # [B, max_q, Hkv, G, D] -> [B, Hkv, G * max_q, D]: row r is query r % max_q of head r // max_q
    q = padded.view(batch, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv_heads, group * max_q, head_dim)

    mask = _causal_window_mask(seq_lens, query_lens, max_q, max_kv, query.device)  # [B, 1, max_q, max_kv]
    mask = mask.repeat(1, 1, group, 1)  # [B, 1, G * max_q, max_kv]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    # [B, Hkv, G * max_q, D] -> [B, max_q, Hq, D]
    out = out.view(batch, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(batch * max_q, num_q_heads, head_dim)
    if uniform:
        return out
    return out.index_select(0, rows)  # [T, Hq, D]


def _check_heads(num_q_heads: int, num_kv_heads: int) -> None:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")


def _gather_kv(
    cache: torch.Tensor,  # [N, S, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    max_kv: int,
    kv_scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:  # [B, Hkv, max_kv, D]
    """Each sequence's blocks laid out contiguously, dequantized to ``dtype``."""
    _, block_size, num_heads, head_dim = cache.shape
    num_blocks = -(-max_kv // block_size)
    table = block_tables[:, :num_blocks].long()  # [B, nb]
    batch = table.shape[0]
    kv = cache[table].view(batch, num_blocks * block_size, num_heads, head_dim)[:, :max_kv]
    if kv.dtype != dtype:
        kv = kv.to(dtype)
    if kv_scale != 1.0:
        kv = kv * kv_scale
    return kv.transpose(1, 2)


def _padded_rows(query_lens: list[int], max_q: int, device: torch.device) -> torch.Tensor:
    """Row of each flat query token in the ``[B * max_q]`` padded layout."""
    rows = [b * max_q + i for b, q_len in enumerate(query_lens) for i in range(q_len)]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _causal_window_mask(
    seq_lens: list[int], query_lens: list[int], max_q: int, max_kv: int, device: torch.device
) -> torch.Tensor:  # [B, 1, max_q, max_kv] bool
    """Key ``j`` visible to query ``i`` iff ``j <= seq_len - query_len + i``.

    Padded query rows (``i >= query_len``) still see key 0, so no row is fully masked.
    """
    offsets = torch.tensor([s - q for s, q in zip(seq_lens, query_lens)], device=device)  # [B]
    last_visible = offsets[:, None] + torch.arange(max_q, device=device)  # [B, max_q]
    keys = torch.arange(max_kv, device=device)  # [max_kv]
    return (keys[None, None, :] <= last_visible[:, :, None]).unsqueeze(1)
