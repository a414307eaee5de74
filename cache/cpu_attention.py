"""Paged attention on the CPU in one C call per layer (`paged_attention.c`): rope, KV write, attend.

Replaces the ~30 torch ops a layer's attention takes on the reference path (rope, two scatters,
the gathers, the masks, SDPA) for bf16 models on a bf16 cache: the per-op overhead of those, not
the arithmetic, is what decoding a few rows pays on the CPU. Reads keys and values in place through
the block tables. Where the kernel cannot run (`SPECDEC_NO_KERNELS=1`, no AVX2, no compiler),
`load_attention()` is None and the model keeps the reference path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specdec import kernel_abi, native
from specdec.kernel_abi import MAX_HEAD_DIM, MAX_LATENT_DIM, check_tensor

from .metadata import AttentionMetadata

SOURCE = Path(__file__).with_name("paged_attention.c")


def kernel(level: native.SimdLevel | str | None = None) -> native.NativeKernel:
    """The library for `level` (None: the one this machine runs; see `native.simd_kernel`)."""
    return native.simd_kernel((SOURCE,), ("rope_write_attend", "latent_attend", "head_matmul", "latent_write",
                                          "latent_query"), level)


# Longer latent windows (MLA prefill) decompress the latents instead (`target/mla.py`). Windows
# of GQA / MHA layers have no limit: every window, prompt chunks included, goes through
# `rope_write_attend`, so a row's result never depends on how its prompt was chunked (SDPA's
# causal, masked and blocked kernels each round differently: a prompt prefilled in one chunk and
# in several gave logits 0.5 apart, and the chunking follows the load). The default target's
# prefill here runs at 0.87-1.15x SDPA's speed at 512 prompt tokens, 1.04x at 1,536 and 0.90-0.92x
# at 3,000 (2 threads; `git show 7336cd4c7a51:docs/results/issue36/prefill_ab.py`).
MAX_QUERY_LEN = 64


def load_attention() -> ctypes.CDLL | None:
    """The loaded kernel, building it on first use; None where it cannot run."""
    return kernel().load()


def supports(meta: AttentionMetadata, qkv: torch.Tensor, k_cache: torch.Tensor, k_scale: float, v_scale: float) -> bool:
    """Whether `rope_write_attend` handles this step's layers (every window: decode, verify and
    prompt chunks): bf16 CPU tensors, a bf16 cache stored unscaled, head_dim a multiple of 32
    (rope works on 16-lane halves) up to `MAX_HEAD_DIM`. Decided by the first layer of a forward
    and kept in `meta.scratch` for the others."""
    use = meta.scratch.get("cpu_attention")
    if use is None:  # a padded static step (`meta.real`) runs the torch layers
        use = meta.scratch["cpu_attention"] = meta.real is None and _kernel_reads(meta, qkv, k_cache, k_scale, v_scale)
    return use


def _kernel_reads(meta: AttentionMetadata, qkv: torch.Tensor, k_cache: torch.Tensor, k_scale: float,
                  v_scale: float) -> bool:
    """What `rope_write_attend` needs: the C backend allowed, bf16 CPU
    tensors, a bf16 cache stored unscaled, heads a multiple of 32 up to `MAX_HEAD_DIM`, the
    kernel built (its library then kept in `meta.scratch` for the other layers' calls)."""
    head_dim = k_cache.shape[-1]
    use = bool(
        meta.backend in ("auto", "c")
        and qkv.device.type == "cpu"
        and qkv.dtype == torch.bfloat16
        and k_cache.device.type == "cpu"
        and k_cache.dtype == torch.bfloat16
        and k_scale == 1.0
        and v_scale == 1.0
        and head_dim % 32 == 0
        and head_dim <= MAX_HEAD_DIM
        and load_attention() is not None
    )
    if use:  # (loading it reads the environment)
        meta.scratch["cpu_attention_lib"] = load_attention()
    return use


def supports_latent(meta: AttentionMetadata, query: torch.Tensor, cache: torch.Tensor, kv_scale: float) -> bool:
    """Whether `latent_attend` handles this step's latent layers: as `supports` asks, with the
    latent (its width a multiple of 16 up to `MAX_LATENT_DIM`) in place of a head. Decided by the
    first layer of a forward and kept in `meta.scratch`."""
    use = meta.scratch.get("cpu_latent_attention")
    if use is None:
        use = meta.scratch["cpu_latent_attention"] = meta.real is None and bool(
            cache.shape[-1] % 16 == 0 and meta.max_query_len <= MAX_QUERY_LEN and _latent_kernel_reads(meta, query, cache, kv_scale)
        )
        if use:  # the library for the other layers' calls (loading it reads the environment)
            meta.scratch["cpu_attention_lib"] = load_attention()
    return use


def _latent_kernel_reads(meta: AttentionMetadata, x: torch.Tensor, cache: torch.Tensor, kv_scale: float) -> bool:
    """What every latent kernel needs: bf16 CPU tensors, a bf16 cache stored unscaled, latents up
    to `MAX_LATENT_DIM` wide, the C backend allowed and built."""
    return (meta.backend in ("auto", "c") and x.device.type == "cpu" and x.dtype == torch.bfloat16
            and cache.device.type == "cpu" and cache.dtype == torch.bfloat16 and kv_scale == 1.0
            and cache.shape[-1] <= MAX_LATENT_DIM and load_attention() is not None)


def writes_latent(meta: AttentionMetadata, kv_a: torch.Tensor, cache: torch.Tensor, kv_scale: float) -> bool:
    """Whether `latent_write` writes this step's latents: bf16 CPU tensors, a bf16 cache stored
    unscaled, the kernel built; any window length (a row's latent is its own: prefill chunks
    write them as decode steps do). Decided by the first layer and kept in `meta.scratch`."""
    use = meta.scratch.get("cpu_latent_write")
    if use is None:
        use = meta.scratch["cpu_latent_write"] = _latent_kernel_reads(meta, kv_a, cache, kv_scale)
    return use


def _latent_rope_descriptor(meta: AttentionMetadata, rotation, cache: torch.Tensor, num_q_heads: int):
    """The step's latent descriptor with its rotary tables (`latent_write`, `latent_query`), made
    once a step and kept in `meta.scratch` beside the rotation it points into (every layer's cache
    has the first one's geometry; another rotation gets its own)."""
    key = ("latent_rope_descriptor", tuple(cache.shape), num_q_heads)
    kept = meta.scratch.get(key)
    if kept is None or kept[0] is not rotation:
        a = attention_descriptor(meta, rotation.positions, rotation.cos_table, rotation.signed_sin_table, cache,
                                 num_q_heads, 1, latent=True)
        meta.scratch[key] = (rotation, a)
        return a
    check_tensor("cache", cache, (torch.bfloat16,), key[1])
    return kept[1]


def _lib(meta: AttentionMetadata) -> ctypes.CDLL:
    """The loaded kernel (the step's, where kept); `RuntimeError` saying why where it cannot run."""
    lib = meta.scratch.get("cpu_attention_lib") or load_attention()
    if lib is None:
        raise RuntimeError(f"the CPU attention kernel cannot run here: {kernel().unavailable_reason()}")
    return lib


def latent_write(
    kv_a: torch.Tensor,  # [T, >= D] bf16 (a strided view of a fused projection's rows is fine): c | k_rope
    norm_weight: torch.Tensor,  # [rank] bf16 or fp32: kv_a_layernorm's
    eps: float,
    interleave: bool,  # k_rope's pairs interleaved (DeepSeek): laid out as halves before rope
    rotation,  # `target.rope.Rotation`: positions and the fp32 tables [P, rope]
    cache: torch.Tensor,  # [N, S, 1, D] bf16: the layer's latents
    meta: AttentionMetadata,
) -> None:
    """Multi-head latent attention's cache write in C: each row's `[rmsnorm(c) | rope(k_rope)]`
    into its slot (see `paged_attention.c`), row by row."""
    rank = norm_weight.shape[0]
    a = _latent_rope_descriptor(meta, rotation, cache, 1)
    rope = a.d - rank
    if rotation.cos_table.shape[-1] != rope or kv_a.dim() != 2 or kv_a.shape[0] != meta.num_tokens \
            or kv_a.shape[1] < a.d or kv_a.stride(1) != 1 or kv_a.dtype != torch.bfloat16:
        raise ValueError(f"latent_write: rows {list(kv_a.shape)} (strides {kv_a.stride()}) of {a.d} latent dims, "
                         f"rank {rank}, rope tables of {rotation.cos_table.shape[-1]}")
    check_tensor("norm_weight", norm_weight, (torch.bfloat16, torch.float32), (rank,))
    rc = _lib(meta).latent_write(ctypes.byref(a), kv_a.data_ptr(), kv_a.stride(0), rope, int(interleave),
                                 norm_weight.data_ptr(), norm_weight.dtype == torch.bfloat16, eps, cache.data_ptr(),
                                 torch.get_num_threads())
    kernel_abi.raise_for_status(rc, "latent_write")


def latent_query(
    q: torch.Tensor,  # [T, H * (nope + rope)] bf16, rows contiguous in their last dim
    w_uk: torch.Tensor,  # [H, nope, rank] bf16, each head's matrix contiguous (a view of kv_b_proj's weight)
    interleave: bool,
    rotation,  # `target.rope.Rotation`
    cache: torch.Tensor,  # [N, S, 1, rank + rope] bf16: the layer's latents (their geometry)
    meta: AttentionMetadata,
) -> torch.Tensor:  # [T, H, rank + rope] bf16
    """The absorbed path's queries in C: per head `[q_nope . W_UK | rope(q_rope)]`, row by row
    (see `paged_attention.c`)."""
    heads, nope, rank = w_uk.shape
    a = _latent_rope_descriptor(meta, rotation, cache, heads)
    rope = a.d - rank
    if (q.dim() != 2 or q.shape != (meta.num_tokens, heads * (nope + rope)) or q.stride(1) != 1
            or q.dtype != torch.bfloat16 or w_uk.dtype != torch.bfloat16 or w_uk.stride()[1:] != (rank, 1)
            or rotation.cos_table.shape[-1] != rope):
        raise ValueError(f"latent_query: q {q.dtype} {list(q.shape)}, W_UK {w_uk.dtype} {list(w_uk.shape)} "
                         f"strides {w_uk.stride()}, {a.d} latent dims, rope tables of {rotation.cos_table.shape[-1]}")
    query = q.new_empty(meta.num_tokens, heads, a.d)
    rc = _lib(meta).latent_query(ctypes.byref(a), q.data_ptr(), q.stride(0), nope, rope, int(interleave),
                                 w_uk.data_ptr(), w_uk.stride(0), query.data_ptr(), torch.get_num_threads())
    kernel_abi.raise_for_status(rc, "latent_query")
    return query


def latent_attend(
    query: torch.Tensor,  # [T, Hq, D] bf16: D = latent rank + rope
    cache: torch.Tensor,  # [N, S, 1, D] bf16: the layer's latents, this step's already written
    value_dim: int,  # the latent rank: the values are the latents' first value_dim dims
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, value_dim] bf16
    """Multi-head latent attention's absorbed path: every query head over the latents as keys and
    their first `value_dim` dims as values (see `paged_attention.c`). Tensors checked first (the
    step's descriptor once: every layer's cache has the first layer's geometry)."""
    num_tokens, num_q_heads, dim = query.shape
    key = ("latent_descriptor", tuple(cache.shape), num_q_heads)
    a = meta.scratch.get(key)
    if a is None:
        a = meta.scratch[key] = attention_descriptor(meta, None, None, None, cache, num_q_heads, 1, latent=True)
    else:
        check_tensor("cache", cache, (torch.bfloat16,), key[1])
    check_tensor("query", query, (torch.bfloat16,), (meta.num_tokens, num_q_heads, dim))
    if dim != a.d or value_dim % 16 or not 0 < value_dim <= min(dim, MAX_HEAD_DIM):
        raise ValueError(f"latent_attend: queries of {dim} dims, latents of {a.d}, values of {value_dim}")
    out = query.new_empty(num_tokens, num_q_heads, value_dim)
    rc = _lib(meta).latent_attend(ctypes.byref(a), query.data_ptr(), cache.data_ptr(), value_dim, scale, out.data_ptr(),
                           torch.get_num_threads())
    kernel_abi.raise_for_status(rc, "latent_attend")
    return out


def head_matmul(
    x: torch.Tensor,  # [T, H, k] bf16 or fp32, contiguous
    w: torch.Tensor,  # [H, k, n] (transposed False) or [H, n, k] (True) bf16; each head's matrix contiguous
    transposed: bool,
    out_dtype: torch.dtype = torch.bfloat16,
    lib: ctypes.CDLL | None = None,  # the loaded kernel (`load_attention()` where None)
) -> torch.Tensor:  # [T, H, n]
    """Each row's heads times their own matrices (MLA's `W_UK` before the absorbed attention and
    `W_UV` after it), fp32 accumulation in a fixed order per row (`paged_attention.c`): a row's
    result does not depend on the other rows, as a batched GEMM's may."""
    t, heads, k = x.shape
    n = w.shape[2] if not transposed else w.shape[1]
    if x.dtype not in (torch.bfloat16, torch.float32) or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"head_matmul: x must be a contiguous bf16 or fp32 CPU tensor, got {x.dtype} {list(x.shape)}")
    expected = (heads, k, n) if not transposed else (heads, n, k)
    if (w.dtype != torch.bfloat16 or tuple(w.shape) != expected or w.stride()[1:] != (expected[2], 1)
            or w.device.type != "cpu"):
        raise ValueError(f"head_matmul: w must be bf16 {list(expected)} with contiguous heads, got {w.dtype} "
                         f"{list(w.shape)} strides {w.stride()}")
    lib = lib or load_attention()
    if lib is None:
        raise RuntimeError(f"the CPU attention kernel cannot run here: {kernel().unavailable_reason()}")
    out = torch.empty(t, heads, n, dtype=out_dtype)
    rc = lib.head_matmul(x.data_ptr(), x.dtype == torch.bfloat16, t, heads, k, n, w.data_ptr(), w.stride(0),
                         int(transposed), out.data_ptr(), out_dtype == torch.bfloat16, torch.get_num_threads())
    kernel_abi.raise_for_status(rc, "head_matmul")
    return out


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
    """Rotate q and k, write k and v to their slots, attend: see `paged_attention.c`. Every
    tensor is checked (`ValueError` naming it) before a pointer reaches the kernel."""
    a = attention_descriptor(meta, positions, cos, signed_sin, k_cache, num_q_heads, num_kv_heads)
    check_tensor("qkv", qkv, (torch.bfloat16,), (meta.num_tokens, (num_q_heads + 2 * num_kv_heads) * a.d))
    check_tensor("v_cache", v_cache, (torch.bfloat16,), tuple(k_cache.shape))
    out = qkv.new_empty(qkv.shape[0], num_q_heads * a.d)
    rc = _lib(meta).rope_write_attend(
        ctypes.byref(a), qkv.data_ptr(), qkv.shape[1], k_cache.data_ptr(), v_cache.data_ptr(), scale,
        out.data_ptr(), torch.get_num_threads(),
    )
    kernel_abi.raise_for_status(rc, "rope_write_attend")
    return out


def attention_descriptor(
    meta: AttentionMetadata,
    positions: torch.Tensor | None,  # [T] int64; None: no rope
    cos: torch.Tensor | None,  # [P, D] fp32
    signed_sin: torch.Tensor | None,  # [P, D] fp32
    k_cache: torch.Tensor,  # [N, S, Hkv, D] bf16 (one layer's; its geometry is every layer's)
    num_q_heads: int,
    num_kv_heads: int,
    latent: bool = False,  # k_cache holds latents (`latent_attend`): widths a multiple of 16 up to MAX_LATENT_DIM
) -> kernel_abi.Attention:
    """The step's `struct specdec_attention`, after checking every tensor it points to and the
    head sizes (`ValueError` naming what is wrong). The tensors must outlive its use."""
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [N, S, Hkv, D], got {list(k_cache.shape)}")
    num_blocks, block_size, _, head_dim = k_cache.shape
    check_tensor("k_cache", k_cache, (torch.bfloat16,), (num_blocks, block_size, num_kv_heads, head_dim))
    multiple, widest = (16, MAX_LATENT_DIM) if latent else (32, MAX_HEAD_DIM)
    if head_dim % multiple or head_dim > widest:
        raise ValueError(f"head_dim must be a multiple of {multiple} up to {widest} for the C kernel, got {head_dim}")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    t, b = meta.num_tokens, meta.num_seqs
    check_tensor("meta.slot_mapping", meta.slot_mapping, (torch.int64,), (t,))
    check_tensor("meta.block_tables", meta.block_tables, (torch.int32,), (b, meta.block_tables.shape[-1]))
    check_tensor("meta.seq_lens", meta.seq_lens, (torch.int32,), (b,))
    check_tensor("meta.query_start_loc", meta.query_start_loc, (torch.int32,), (b + 1,))
    if meta.tree_masks is not None:
        check_tensor("meta.tree_masks", meta.tree_masks, (torch.int64,), (t,))
    rope = positions is not None
    if rope:
        if cos is None or signed_sin is None:
            raise ValueError("rope needs the cos and signed_sin tables with positions")
        check_tensor("positions", positions, (torch.int64,), (t,))
        # latents rotate their last cos.shape[-1] dims (the key's rope part); heads all of theirs
        width = cos.shape[-1] if latent and cos.dim() == 2 and 0 < cos.shape[-1] < head_dim else head_dim
        check_tensor("cos", cos, (torch.float32,), (cos.shape[0], width))
        check_tensor("signed_sin", signed_sin, (torch.float32,), tuple(cos.shape))
    return kernel_abi.Attention(
        positions=positions.data_ptr() if rope else None, cos=cos.data_ptr() if rope else None,
        signed_sin=signed_sin.data_ptr() if rope else None, num_positions=cos.shape[0] if rope else 0,
        num_slots=num_blocks * block_size, slots=meta.slot_mapping.data_ptr(),
        block_tables=meta.block_tables.data_ptr(), max_blocks=meta.block_tables.shape[-1],
        num_blocks=num_blocks, seq_lens=meta.seq_lens.data_ptr(), query_start_loc=meta.query_start_loc.data_ptr(),
        num_seqs=b, block_size=block_size, hq=num_q_heads, hkv=num_kv_heads, d=head_dim,
        tree_masks=meta.tree_masks.data_ptr() if meta.tree_masks is not None else None,
    )
