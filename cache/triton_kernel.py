"""Triton kernel for varlen paged attention (imported lazily: needs triton).

``TRITON_INTERPRET=1`` must be set before this module is first imported for the kernel to run
on CPU tensors through the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [N, S, Hkv, D]
    v_cache_ptr,  # [N, S, Hkv, D]
    out_ptr,  # [T, Hq, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B+1] int32
    tree_ptr,  # [T] int64 (read when HAS_TREE): each row's visible window rows, bit j for row j
    scale,
    k_scale,
    v_scale,
    window,  # sliding window (read when HAS_WINDOW): a query at p sees keys in (p - window, p]
    softcap,  # score cap (read when HAS_SOFTCAP): s -> softcap * tanh(s / softcap)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kn,
    stride_ks,
    stride_kh,
    stride_vn,
    stride_vs,
    stride_vh,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,  # S
    GROUP: tl.constexpr,  # Hq // Hkv
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # key positions per inner step
    DEQUANT: tl.constexpr,  # cache dtype differs from the query's or scales != 1
    UPCAST_DOT: tl.constexpr,  # fp32 dots: the interpreter multiplies bf16 as raw uint16
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 dots ("tf32" applies to fp32 inputs only)
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TREE: tl.constexpr,
):
    """One program: BLOCK_M query tokens x the GROUP query heads sharing one KV head.

    Rows of the query tile are ``(token, head-in-group)`` pairs, so every loaded KV tile serves
    the whole group. Key positions map to cache slots through the block table one position at
    a time, which works for any block size. Online softmax in fp32.
    """
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len  # positions cached before this window

        rows = tl.arange(0, BLOCK_M * GROUP_PAD)  # [R]
        q_idx = q_block * BLOCK_M + rows // GROUP_PAD  # [R] token within the window
        head = kv_head * GROUP + rows % GROUP_PAD  # [R] query head
        row_valid = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
        dims = tl.arange(0, HEAD_DIM_PAD)  # [Dp]
        dim_valid = dims < HEAD_DIM
        q_rows = (q_start + q_idx).to(tl.int64)
        q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        io_mask = row_valid[:, None] & dim_valid[None, :]
        q = tl.load(q_ptrs, mask=io_mask, other=0.0)  # [R, Dp]
        if UPCAST_DOT:
            q = q.to(tl.float32)
        q_pos = context + q_idx  # [R] absolute position of each query
        if HAS_TREE:
            tree = tl.load(tree_ptr + q_rows, mask=row_valid, other=-1)  # [R] int64 window bits

        # Finite start so fully masked (padding) rows never produce inf - inf.
        m_i = tl.full([BLOCK_M * GROUP_PAD], -1.0e30, tl.float32)  # [R]
        l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)  # [R]
        acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM_PAD], tl.float32)  # [R, Dp]
        kv_end = tl.minimum(seq_len, context + (q_block + 1) * BLOCK_M)  # causal bound of the tile
        kv_start = 0
        if HAS_WINDOW:  # skip the tiles before the window of the tile's first query
            kv_start = tl.maximum(context + q_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        for start in range(kv_start, kv_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)  # [Nt]
            pos_valid = pos < kv_end
            block = tl.load(
                block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_valid, other=0
            ).to(tl.int64)  # [Nt]
            offset = pos % BLOCK_SIZE
            kv_mask = pos_valid[:, None] & dim_valid[None, :]
            k_ptrs = (
                k_cache_ptr
                + block[:, None] * stride_kn
                + offset[:, None] * stride_ks
                + kv_head * stride_kh
                + dims[None, :]
            )
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [Nt, Dp]
            if DEQUANT:
                k = k.to(tl.float32) * k_scale
            k = k.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [R, Nt]
            if HAS_SOFTCAP:  # tanh from exp (no tanh in tl), odd so computed on |x|: no overflow
                x = s / softcap
                e = tl.exp(-2.0 * tl.abs(x))
                t = (1.0 - e) / (1.0 + e)
                s = tl.where(x < 0, -t, t) * softcap
            visible = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :]
            if HAS_WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            if HAS_TREE:  # a window key sits at window row pos - context: visible if its bit is set
                w = tl.minimum(tl.maximum(pos - context, 0), 63).to(tl.int64)  # [Nt]
                bit = (tree[:, None] >> w[None, :]) & 1
                visible = visible & ((pos[None, :] < context) | (bit == 1))
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])  # [R, Nt]
            l_i = l_i * alpha + tl.sum(p, 1)

            v_ptrs = (
                v_cache_ptr
                + block[:, None] * stride_vn
                + offset[:, None] * stride_vs
                + kv_head * stride_vh
                + dims[None, :]
            )
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [Nt, Dp]
            if DEQUANT:
                v = v.to(tl.float32) * v_scale
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
