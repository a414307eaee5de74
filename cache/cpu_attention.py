"""Paged attention on the CPU in one C call per layer (`paged_attention.c`): rope, KV write, attend.

Replaces the ~30 torch ops a layer's attention takes on the reference path (rope, two scatters,
the gathers, the masks, SDPA) for bf16 models on a bf16 cache: the per-op overhead of those, not
the arithmetic, is what decoding a few rows pays on the CPU. Reads keys and values in place through
the block tables. Where the kernel cannot run (`SPECDEC_NO_KERNELS=1`, no AVX-512, no compiler),
`load_attention()` is None and the model keeps the reference path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specdec import native

from .metadata import AttentionMetadata

KERNEL = native.NativeKernel(
    (Path(__file__).with_name("paged_attention.c"),),
    flags=("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    cpu_flags=("avx512f", "avx512bw", "avx512dq", "avx512vl"),
)
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    # qkv, row_stride, positions, cos, signed_sin, num_positions, k_cache, v_cache, num_slots,
    # slots, block_tables, max_blocks, num_blocks, seq_lens, query_start_loc, num_seqs,
    # block_size, hq, hkv, d, scale, out, threads
    "rope_write_attend": [_P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _P, _P,
                          _I64, _I64, _I64, _I64, _I64, _F, _P, _I],
}
MAX_HEAD_DIM = 512  # the kernel's per-thread query buffer
# Longer windows (prefill) go to SDPA: the kernel walks the keys once per query row, which at
# 1,000 prompt tokens is 1.3x and at 3,000 2.1x slower than SDPA's blocked loops (draft prefill).
MAX_QUERY_LEN = 64


def load_attention() -> ctypes.CDLL | None:
    """The loaded kernel, building it on first use; None where it cannot run."""
    return native.load(KERNEL, SIGNATURES)


def supports(meta: AttentionMetadata, qkv: torch.Tensor, k_cache: torch.Tensor, k_scale: float, v_scale: float) -> bool:
    """Whether `rope_write_attend` handles this step's layers: bf16 CPU tensors, a bf16 cache
    stored unscaled, head_dim a multiple of 32 (rope works on 16-lane halves) up to 512, windows
    of at most `MAX_QUERY_LEN` rows (decode and verify, not prefill). Decided by the first layer
    of a forward and kept in `meta.scratch` for the others."""
    use = meta.scratch.get("cpu_attention")
    if use is None:
        head_dim = k_cache.shape[-1]
        use = meta.scratch["cpu_attention"] = bool(
            qkv.device.type == "cpu"
            and qkv.dtype == torch.bfloat16
            and k_cache.dtype == torch.bfloat16
            and k_scale == 1.0
            and v_scale == 1.0
            and head_dim % 32 == 0
            and head_dim <= MAX_HEAD_DIM
            and meta.max_query_len <= MAX_QUERY_LEN
            and load_attention() is not None
        )
        if use:  # the library for the other layers' calls (loading it reads the environment)
            meta.scratch["cpu_attention_lib"] = load_attention()
    return use


def rope_write_attend(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D] bf16, rows q | k | v; q and k rotated in place
    num_q_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor | None,  # [T] int64; None: no rope
    cos: torch.Tensor | None,  # [P, D] fp32
    signed_sin: torch.Tensor | None,  # [P, D] fp32: sin with its first half negated
    k_cache: torch.Tensor,  # [N, S, Hkv, D] bf16
    v_cache: torch.Tensor,  # [N, S, Hkv, D] bf16
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq * D] bf16
    """Rotate q and k, write k and v to their slots, attend: see `paged_attention.c`."""
    num_blocks, block_size, _, head_dim = k_cache.shape
    assert qkv.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert qkv.shape == (meta.num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim), qkv.shape
    out = qkv.new_empty(qkv.shape[0], num_q_heads * head_dim)
    rope = positions is not None
    if rope and not (positions.dtype == torch.int64 and cos.dtype == signed_sin.dtype == torch.float32
                     and positions.is_contiguous() and cos.is_contiguous() and signed_sin.is_contiguous()):
        raise ValueError("rope needs contiguous int64 positions and fp32 cos / signed_sin tables")
    lib = meta.scratch.get("cpu_attention_lib") or load_attention()
    if lib is None:
        reason = KERNEL.unavailable_reason() or f"its build failed (run it by hand: {KERNEL.command('x.so')})"
        raise RuntimeError(f"the CPU attention kernel cannot run here: {reason}")
    rc = lib.rope_write_attend(
        qkv.data_ptr(), qkv.shape[1],
        positions.data_ptr() if rope else None, cos.data_ptr() if rope else None,
        signed_sin.data_ptr() if rope else None, cos.shape[0] if rope else 0,
        k_cache.data_ptr(), v_cache.data_ptr(), num_blocks * block_size, meta.slot_mapping.data_ptr(),
        meta.block_tables.data_ptr(), meta.block_tables.shape[1], num_blocks, meta.seq_lens.data_ptr(),
        meta.query_start_loc.data_ptr(), meta.num_seqs, block_size, num_q_heads, num_kv_heads,
        head_dim, scale, out.data_ptr(), torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(ERRORS.get(rc, f"rope_write_attend failed ({rc})"))
    return out


ERRORS = {
    -1: "a position is outside the rotary table",
    -2: "a slot is outside the KV cache",
    -3: "a block table entry is outside the KV cache",
    -4: "query rows, sequence lengths and block tables disagree",
}
