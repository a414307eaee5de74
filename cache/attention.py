"""KV writes and varlen paged attention: a vectorized torch reference, Triton on CUDA."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_cache import FP8_DTYPES
from .metadata import AttentionMetadata
from .triton_attention import paged_attention_triton, triton_available


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


def write_latent(
    latent: torch.Tensor,  # [T, 1, D]: a latent cache's one head (multi-head latent attention)
    cache: torch.Tensor,  # [N, S, 1, D]
    slot_mapping: torch.Tensor,  # [T] int64
    scale: float = 1.0,
) -> None:
    """Scatter this step's latents into their cache slots (stored = value / scale)."""
    _write_one(latent, cache, slot_mapping, scale)


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
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [T, Hq, D]
    """Varlen causal attention over the paged cache, by `meta.backend`: "triton" the Triton kernel
    (CUDA, or the CPU under TRITON_INTERPRET=1), "torch" and "c" the reference, "auto" the Triton
    kernel on CUDA and the reference elsewhere. (The C kernel, `cpu_attention`, is chosen by the
    model before this is called: it also rotates and writes the keys.)

    Query ``i`` of sequence ``b`` sits at position ``p = seq_len_b - query_len_b + i`` and attends
    to keys ``0..p`` (causal within the window, full over the cached prefix); with a sliding
    ``window`` only to keys in ``(p - window, p]``. ``softcap`` caps the scaled scores at
    ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2). ``sinks`` (gpt-oss) adds
    ``exp(sinks[h])`` to each softmax's denominator of head ``h``: a key of that score and no value.
    """
    triton = v_cache.shape[-1] == k_cache.shape[-1] and sinks is None and (
        meta.backend == "triton" or (meta.backend == "auto" and query.is_cuda and triton_available()))
    if triton:  # padded static steps too: the kernel reads the lengths on the device
        return paged_attention_triton(query, k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap)
    if meta.real is not None:  # a padded static step: the real rows under the real metadata, zeros past them
        n = meta.real.num_tokens
        out = paged_attention_ref(query[:n], k_cache, v_cache, meta.real, scale, k_scale, v_scale, window, softcap, sinks)
        return torch.cat([out, out.new_zeros(query.shape[0] - n, *out.shape[1:])])
    # a latent cache's values, sinks, no Triton: the reference
    return paged_attention_ref(query, k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap, sinks)


# Gathered K (or V) per chunk of sequences stays below glibc's largest mmap threshold (32 MiB):
# bigger buffers are fresh mmaps that page-fault on every call (measured 6x slower gathers).
_GATHER_BYTES = 16 << 20
# Up to this many query tokens per sequence, the G query heads sharing a KV head are folded into
# the query axis (2x faster than enable_gqa for decode/verify on CPU); longer windows use GQA.
_FOLD_MAX_QUERY_LEN = 32


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, Dv] (Dv: D, or less for a latent cache's values)
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [T, Hq, Dv]
    """Torch reference of ``paged_attention``: padded, batched SDPA over gathered blocks.

    Each sequence's blocks are gathered into ``[B, max_kv, Hkv, D]``, the queries padded to
    ``[B, max_q, Hq, D]``, and key ``j`` is masked for query ``i`` unless
    ``j <= seq_len - query_len + i``. One SDPA call per chunk of sequences (a single chunk unless
    the gathered KV would pass ``_GATHER_BYTES``; one sequence a chunk in a step with a window
    longer than ``_FOLD_MAX_QUERY_LEN``, so that a prompt's rows are bitwise those it gets
    alone). Reads only the host copies of the lengths, so
    it never syncs with the device. Computes in the query dtype. The chunking, gather indices and
    masks depend only on the metadata, so the first layer of a forward builds them
    (``_plan_chunks``) and the other layers reuse them.

    Example: seq_len 7, query_len 3 -> queries sit at positions 4, 5, 6 and see keys 0..4,
    0..5 and 0..6; with window 2, keys 3..4, 4..5 and 5..6. A window adds a lower bound to the
    mask; soft-capping and sinks compute the scores themselves (SDPA has no hook for either), in
    the folded layout.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    _check_heads(num_q_heads, num_kv_heads)
    capped = softcap is not None or sinks is not None  # scores computed here, not by SDPA
    key = ("ref", query.element_size(), num_q_heads, num_kv_heads, head_dim, k_cache.shape[1], window, capped)
    chunks = meta.scratch.get(key)
    if chunks is None:
        chunks = meta.scratch[key] = _plan_chunks(
            meta, query, num_q_heads, num_kv_heads, k_cache.shape[1], window, capped
        )
    assert sum(c.num_rows for c in chunks) == num_tokens, "query rows do not match the metadata"
    if not chunks:
        return query.new_empty(0, num_q_heads, v_cache.shape[-1])
    outs, row = [], 0
    for c in chunks:
        keys = _gather_kv(k_cache, c, k_scale, query.dtype)  # [b, Hkv, max_kv, D]
        values = _gather_kv(v_cache, c, v_scale, query.dtype)
        outs.append(_attend(query[row : row + c.num_rows], keys, values, c, scale, softcap, sinks))
        row += c.num_rows
    return outs[0] if len(outs) == 1 else torch.cat(outs)


@dataclass
class _Chunk:
    """One SDPA call's worth of sequences, with everything derived from their lengths."""

    num_rows: int  # query tokens of these sequences
    batch: int
    max_q: int
    max_kv: int
    block_ids: torch.Tensor  # [b * nb] the blocks to gather, each sequence's padded to nb
    rows: torch.Tensor | None  # [t] row of each query in the [b * max_q] padded layout; None: uniform
    mask: torch.Tensor | None  # [b, 1, rows, max_kv] bool, None: every key visible (or plain causal)
    causal: bool  # every window is a whole prompt: SDPA's own causal mask
    folded: bool  # G query heads folded into the query axis (short windows)


def _plan_chunks(
    meta: AttentionMetadata,
    query: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    window: int | None = None,
    capped: bool = False,  # soft-capped scores: always folded, never SDPA's causal flag
) -> list[_Chunk]:
    head_dim, device = query.shape[2], query.device
    group = num_q_heads // num_kv_heads
    bytes_per_seq = max(1, meta.max_seq_len * num_kv_heads * head_dim * query.element_size())
    seqs_per_chunk = max(1, _GATHER_BYTES // bytes_per_seq)
    if max(meta.query_lens_cpu, default=0) > _FOLD_MAX_QUERY_LEN:
        # A prompt chunk: each sequence in an SDPA call of its own, the call it gets alone. Padded
        # into one call with others, its rows went through a masked kernel instead of the causal
        # one and came out different in the last bits: a prompt prefilled beside another one
        # (two requests arriving together) then answered differently from the same prompt alone
        # (measured: a HumanEval stream parted at its 169th greedy token, a 0.12-nat margin).
        seqs_per_chunk = 1
    chunks, first_row = [], 0
    for b0 in range(0, meta.num_seqs, seqs_per_chunk):
        seq_lens = meta.seq_lens_cpu[b0 : b0 + seqs_per_chunk]
        query_lens = meta.query_lens_cpu[b0 : b0 + seqs_per_chunk]
        num_rows = sum(query_lens)
        first_row, rows_from = first_row + num_rows, first_row
        if num_rows == 0:
            continue
        batch, max_q, max_kv = len(seq_lens), max(query_lens), max(seq_lens)
        num_blocks = -(-max_kv // block_size)
        block_ids = meta.block_tables[b0 : b0 + seqs_per_chunk, :num_blocks].reshape(-1)
        uniform = all(q == max_q for q in query_lens)
        rows = None if uniform else _padded_rows(query_lens, max_q, device)
        folded = max_q <= _FOLD_MAX_QUERY_LEN or capped
        chunk_window = window if window is not None and max_kv > window else None  # None: it hides nothing
        tree = None if meta.tree_masks_cpu is None else meta.tree_masks_cpu[rows_from : rows_from + num_rows]
        causal = not folded and uniform and max_q == max_kv and chunk_window is None and tree is None
        if max_q == 1 and all(s == max_kv for s in seq_lens) and chunk_window is None:
            mask = None  # one query per sequence at the end of equal-length keys: sees them all
        elif causal:
            mask = None
        else:
            mask = _causal_window_mask(
                seq_lens, query_lens, max_q, max_kv, device, group if folded else 1, chunk_window
            )
            if tree is not None:
                mask = _tree_mask(mask, tree, seq_lens, query_lens, max_q)
        chunks.append(_Chunk(num_rows, batch, max_q, max_kv, block_ids, rows, mask, causal, folded))
    return chunks


def _attend(
    query: torch.Tensor,  # [t, Hq, D]
    keys: torch.Tensor,  # [b, Hkv, max_kv, D]
    values: torch.Tensor,  # [b, Hkv, max_kv, D]
    chunk: _Chunk,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [t, Hq, D]
    """One padded SDPA call for a chunk of sequences whose KV is already gathered."""
    _, num_q_heads, head_dim = query.shape
    batch, max_q = chunk.batch, chunk.max_q
    if chunk.rows is None:
        padded = query.view(batch, max_q, num_q_heads, head_dim)
    else:
        padded = query.new_zeros(batch * max_q, num_q_heads, head_dim).index_copy_(0, chunk.rows, query)
        padded = padded.view(batch, max_q, num_q_heads, head_dim)  # [b, max_q, Hq, D]

    if chunk.folded:
        out = _sdpa_folded(padded, keys, values, chunk.mask, scale, softcap, sinks)
    else:
        q = padded.transpose(1, 2)  # [b, Hq, max_q, D]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=chunk.mask, is_causal=chunk.causal, scale=scale, enable_gqa=True
        ).transpose(1, 2)  # [b, max_q, Hq, D]
    out = out.reshape(batch * max_q, num_q_heads, values.shape[-1])
    return out if chunk.rows is None else out.index_select(0, chunk.rows)


def _sdpa_folded(
    padded: torch.Tensor,  # [b, max_q, Hq, D]
    keys: torch.Tensor,  # [b, Hkv, max_kv, D]
    values: torch.Tensor,  # [b, Hkv, max_kv, D]
    mask: torch.Tensor | None,  # [b, 1, G * max_q, max_kv] bool
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:  # [b, max_q, Hq, D]
    """SDPA with the G query heads of each KV head folded into the query axis (no KV repeat)."""
    batch, max_q, num_q_heads, head_dim = padded.shape
    num_kv_heads = keys.shape[1]
    group = num_q_heads // num_kv_heads
    # row g * max_q + i of KV head h is query i of head h * G + g
    q = padded.view(batch, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv_heads, group * max_q, head_dim)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    else:  # row g * max_q + i of KV head h: head h * G + g's sink
        row_sinks = None if sinks is None else sinks.view(num_kv_heads, group, 1).expand(-1, -1, max_q).reshape(
            1, num_kv_heads, group * max_q, 1)
        out = _explicit_attention(q, keys, values, mask, scale, softcap, row_sinks)
    out = out.view(batch, num_kv_heads, group, max_q, values.shape[-1]).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, max_q, num_q_heads, values.shape[-1])


def _explicit_attention(
    q: torch.Tensor,  # [b, Hkv, R, D]
    keys: torch.Tensor,  # [b, Hkv, max_kv, D]
    values: torch.Tensor,  # [b, Hkv, max_kv, D]
    mask: torch.Tensor | None,  # [b, 1, R, max_kv] bool
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [1, Hkv, R, 1]: each row's sink logit
) -> torch.Tensor:  # [b, Hkv, R, D]
    """Attention with scores capped at `softcap * tanh(score / softcap)` and / or a sink column
    joining the softmax and dropped after it, in transformers' order (scale, cap, mask, sink,
    softmax in fp32)."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [b, Hkv, R, max_kv]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
    else:
        scores = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
        probs = scores.softmax(-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    return torch.matmul(probs, values)


def _check_heads(num_q_heads: int, num_kv_heads: int) -> None:
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})"
        )


def _gather_kv(
    cache: torch.Tensor,  # [N, S, Hkv, D]
    chunk: _Chunk,
    kv_scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:  # [b, Hkv, max_kv, D]
    """The chunk's sequences' blocks laid out contiguously, dequantized to ``dtype``."""
    _, block_size, num_heads, head_dim = cache.shape
    kv = cache.index_select(0, chunk.block_ids)  # [b * nb, S, Hkv, D], a fresh copy
    kv = kv.view(chunk.batch, -1, num_heads, head_dim)[:, : chunk.max_kv]
    if kv.dtype != dtype:
        kv = kv.to(dtype)
    if kv_scale != 1.0:
        kv.mul_(kv_scale)
    return kv.transpose(1, 2)


def _padded_rows(query_lens: list[int], max_q: int, device: torch.device) -> torch.Tensor:
    """Row of each flat query token in the ``[B * max_q]`` padded layout."""
    rows = [b * max_q + i for b, q_len in enumerate(query_lens) for i in range(q_len)]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _causal_window_mask(
    seq_lens: list[int],
    query_lens: list[int],
    max_q: int,
    max_kv: int,
    device: torch.device,
    group: int = 1,
    window: int | None = None,
) -> torch.Tensor:  # [B, 1, group * max_q, max_kv] bool
    """Key ``j`` visible to query ``i`` iff ``j <= seq_len - query_len + i`` (and, with a
    ``window``, ``j > seq_len - query_len + i - window``).

    Row ``r`` is query ``r % max_q`` (rows repeat ``group`` times for folded GQA heads). Padded
    query rows (``i >= query_len``) still see key 0, so no row is fully masked.
    """
    offsets = torch.tensor([s - q for s, q in zip(seq_lens, query_lens)], device=device)  # [B]
    query_idx = torch.arange(group * max_q, device=device) % max_q  # [G * max_q]
    last_visible = offsets[:, None] + query_idx  # [B, G * max_q]
    keys = torch.arange(max_kv, device=device)  # [max_kv]
    visible = keys[None, None, :] <= last_visible[:, :, None]  # [B, G * max_q, max_kv]
    if window is not None:
        visible &= keys[None, None, :] > last_visible[:, :, None] - window
        padded = query_idx[None, :] >= torch.tensor(query_lens, device=device)[:, None]  # [B, G * max_q]
        visible[:, :, 0] |= padded
    return visible.unsqueeze(1)


def _tree_mask(
    mask: torch.Tensor,  # [B, 1, G * max_q, max_kv] bool: causal (and windowed)
    tree: list[int],  # each flat row's window bits (`AttentionMetadata.tree_masks_cpu`)
    seq_lens: list[int],
    query_lens: list[int],
    max_q: int,
) -> torch.Tensor:  # [B, 1, G * max_q, max_kv] bool
    """`mask` with each window's keys narrowed to the rows' tree bits: window row ``j`` of sequence
    ``b`` (key ``seq_len - query_len + j``) visible to its row ``i`` iff bit ``j`` of ``i``'s mask."""
    mask = mask.clone()
    group = mask.shape[2] // max_q
    bits = torch.arange(max_q, device=mask.device)  # [max_q]
    row = 0
    for b, (s, q) in enumerate(zip(seq_lens, query_lens)):
        if q:
            rows = torch.tensor(tree[row : row + q], dtype=torch.int64, device=mask.device)  # [q]
            sees = ((rows[:, None] >> bits[None, :q]) & 1).bool()  # [q, q]: row i sees window row j
            window = mask[b, 0].view(group, max_q, -1)[:, :q, s - q : s]  # [G, q, q] (a view)
            window &= sees
        row += q
    return mask


def check_backend(backend: str, device: torch.device | str) -> None:
    """`ValueError` saying why `backend` cannot run on `device`: "triton" needs triton installed
    and, on the CPU, its interpreter (TRITON_INTERPRET=1 in the environment before the first
    kernel is compiled); "c" needs the CPU."""
    device_type = torch.device(device).type
    if backend == "triton":
        if not triton_available():
            raise ValueError("attention backend 'triton' needs triton: pip install 'specdec[triton]'")
        if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention backend 'triton' runs on the CPU only through Triton's interpreter: "
                             "set TRITON_INTERPRET=1 before starting (slow; meant for tests)")
    elif backend == "c" and device_type != "cpu":
        raise ValueError(f"attention backend 'c' is the CPU kernel; the models are on {device_type}")
