"""Launcher for the Triton paged-attention kernel; triton itself is imported only when called."""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from .metadata import AttentionMetadata

_MIN_DOT = 16  # tl.dot needs every tile dimension >= 16


def triton_available() -> bool:
    """True when triton can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["triton"] is None (blocked)
        return False


def paged_attention_triton(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Same contract as ``attention.paged_attention`` (sliding window and soft-capping included),
    computed by one Triton kernel launch.

    Grid ``(B, cdiv(max_query_len, BLOCK_M), Hkv)``; programs past a sequence's window exit at
    once. Runs on CUDA tensors, or on CPU tensors with ``TRITON_INTERPRET=1`` set before triton
    is first imported.
    """
    if not triton_available():
        raise RuntimeError("paged_attention_triton needs triton: pip install 'specdec[triton]'")
    from .triton_kernel import paged_attention_kernel

    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, cache_head_dim = k_cache.shape[2], k_cache.shape[3]
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )
    if head_dim != cache_head_dim:
        raise ValueError(f"query head dim {head_dim} != cache head dim {cache_head_dim}")
    tensors = (k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    if any(t.device != query.device for t in tensors):
        raise ValueError(f"query, KV cache and metadata must share one device; the query is on {query.device}")
    out = torch.empty_like(query)
    if num_tokens == 0 or meta.max_query_len == 0:
        return out
    query = query if query.stride(-1) == 1 else query.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV cache tensors must be contiguous in the head dimension")

    group = num_q_heads // num_kv_heads
    group_pad = _next_pow2(group)
    block_m = _block_m(meta.max_query_len, group_pad)
    grid = (meta.num_seqs, -(-meta.max_query_len // block_m), num_kv_heads)
    dequant = k_cache.dtype != query.dtype or k_scale != 1.0 or v_scale != 1.0
    upcast = query.device.type == "cpu"  # CPU means the interpreter
    # Triton launches on the current CUDA device, not the tensors': on cuda:1 it must be cuda:1.
    with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
        paged_attention_kernel[grid](
            query, k_cache, v_cache, out,
            meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.tree_masks if meta.tree_masks is not None else meta.seq_lens,  # (unread without a tree)
            float(scale), float(k_scale), float(v_scale), int(window or 0), float(softcap or 0.0),
            query.stride(0), query.stride(1),
            out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            meta.block_tables.stride(0),
            BLOCK_SIZE=k_cache.shape[1],
            GROUP=group,
            GROUP_PAD=group_pad,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=max(_next_pow2(head_dim), _MIN_DOT),
            BLOCK_M=block_m,
            BLOCK_N=64,
            DEQUANT=dequant,
            UPCAST_DOT=upcast,
            # fp32 dots in IEEE fp32, never TF32 (Triton's default on CUDA), or fp32 results
            # drift from the reference that equality tests compare them with
            DOT_PRECISION="ieee" if upcast or query.dtype == torch.float32 else "tf32",
            HAS_WINDOW=window is not None,
            HAS_SOFTCAP=softcap is not None,
            HAS_TREE=meta.tree_masks is not None,
        )  # fmt: skip
    return out


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _block_m(max_query_len: int, group_pad: int) -> int:
    """Query tokens per program: enough rows for tl.dot (>= 16), at most ~64 rows per tile."""
    lo = max(1, _MIN_DOT // group_pad)
    hi = max(lo, 64 // group_pad)
    return min(max(_next_pow2(max_query_len), lo), hi)
