"""The ctypes twin of `kernel_abi.h`: the descriptors, the prototypes and the status codes of
specdec's C kernels, declared once for every library, and the load-time check that they match
what the compiler laid out (`kernel_abi.c`'s table).

A mismatch (a field added on one side only, a changed type, a renumbered status) raises
`KernelABIError` at load, naming the struct and field, instead of a kernel reading the wrong
bytes.
"""

from __future__ import annotations

import ctypes
import enum

import torch

ABI_VERSION = 12  # kernel_abi.h SPECDEC_ABI_VERSION
GROUP = 32  # SPECDEC_GROUP: inputs per qgemm weight / activation group
TILE = 16  # SPECDEC_TILE: output channels per qgemm weight tile
SUPER = 256  # SPECDEC_SUPER: inputs per k-quant super-block
TILE_Q4_K = 12  # SPECDEC_TILE_Q4_K: the tile_bits of a GGUF Q4_K tile (ggml's type id)
TILE_Q6_K = 14  # SPECDEC_TILE_Q6_K: of a GGUF Q6_K tile
TILE_Q5_0 = 6  # SPECDEC_TILE_Q5_0: of a GGUF Q5_0 tile (ggml's type id)
TILE_Q8_0 = 24  # SPECDEC_TILE_Q8_0: of a GGUF Q8_0 tile (ggml's id 8 is the int8 tiles')
TILE_Q4_0 = 2  # SPECDEC_TILE_Q4_0: of a GGUF Q4_0 tile (ggml's type id)
TILE_Q4_1 = 3  # SPECDEC_TILE_Q4_1: of a GGUF Q4_1 tile
TILE_Q5_K = 13  # SPECDEC_TILE_Q5_K: of a GGUF Q5_K tile
TILE_IQ4_NL = 20  # SPECDEC_TILE_IQ4_NL: of a GGUF IQ4_NL tile
TILE_MXFP4 = 39  # SPECDEC_TILE_MXFP4: of a GGUF MXFP4 tile
TILE_IQ4_XS = 23  # SPECDEC_TILE_IQ4_XS: of a GGUF IQ4_XS tile
TILE_Q3_K = 11  # SPECDEC_TILE_Q3_K: of a GGUF Q3_K tile
TILE_Q2_K = 10  # SPECDEC_TILE_Q2_K: of a GGUF Q2_K tile
TILE_F16 = 1  # SPECDEC_TILE_F16: of a GGUF F16 tile (ggml's type id)
TILE_BF16 = 30  # SPECDEC_TILE_BF16: of a GGUF BF16 tile (ggml's type id)
MAX_HEAD_DIM = 512  # SPECDEC_MAX_HEAD_DIM: rope_write_attend's per-thread query buffer
MAX_LATENT_DIM = 1024  # SPECDEC_MAX_LATENT_DIM: latent_attend's widest latent
SHM_HEADER = 4096  # SPECDEC_SHM_HEADER: group_allreduce's region header

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class KernelABIError(RuntimeError):
    """A kernel library disagrees with this module about a descriptor, a constant or the version."""


class Status(enum.IntEnum):
    """`enum specdec_status`: what every kernel returns."""

    OK = 0
    ERR_NO_MEMORY = 1
    ERR_INVALID_ARGUMENT = 2
    ERR_POSITION = 3
    ERR_SLOT = 4
    ERR_BLOCK = 5
    ERR_LENGTHS = 6
    ERR_PEER_GONE = 7
    ERR_TIMEOUT = 8


# status -> (exception, message); MemoryError only where an allocation really failed
ERRORS: dict[Status, tuple[type[Exception], str]] = {
    Status.ERR_NO_MEMORY: (MemoryError, "could not allocate its scratch buffers"),
    Status.ERR_INVALID_ARGUMENT: (ValueError, "refused its arguments (a size, flag or pointer it does not take)"),
    Status.ERR_POSITION: (ValueError, "a position is outside the rotary table"),
    Status.ERR_SLOT: (ValueError, "a slot is outside the KV cache"),
    Status.ERR_BLOCK: (ValueError, "a block table entry is outside the KV cache"),
    Status.ERR_LENGTHS: (ValueError, "query rows, sequence lengths and block tables disagree"),
    Status.ERR_PEER_GONE: (RuntimeError, "another rank's process of the tensor-parallel group ended"),
    Status.ERR_TIMEOUT: (TimeoutError, "another rank of the tensor-parallel group did not arrive in time"),
}


def raise_for_status(rc: int, function: str) -> None:
    """Nothing for `OK`; else the exception `ERRORS` maps `rc` to, naming `function`."""
    if rc == Status.OK:
        return
    try:
        error, message = ERRORS[Status(rc)]
    except ValueError:
        raise RuntimeError(f"{function} returned {rc}, which is no specdec_status") from None
    raise error(f"{function}: {message}")


def check_tensor(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...]) -> None:
    """`ValueError` naming `name` unless `t` is a contiguous CPU tensor of one of `dtypes` and
    `shape`: what a C kernel reading it by pointer needs."""
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU for the C kernel, got {t.device}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


class Linear(ctypes.Structure):
    """`struct specdec_linear`: a QLinear's buffers."""

    c_name = "specdec_linear"
    _fields_ = [("tiles", _P), ("tile_offsets", _P), ("tile_bits", _P), ("in_features", _I64),
                ("out_features", _I64), ("bias", _P)]


class Moe(ctypes.Structure):
    """`struct specdec_moe`: a mixture-of-experts block's router and expert QLinears."""

    c_name = "specdec_moe"
    _fields_ = [("router", _P), ("gate_up", ctypes.POINTER(Linear)), ("down", ctypes.POINTER(Linear)),
                ("shared_gate_up", ctypes.POINTER(Linear)), ("shared_down", ctypes.POINTER(Linear)),
                ("shared_gate", _P), ("num_experts", _I64), ("top_k", _I64), ("hidden", _I64),
                ("router_bf16", _I64), ("norm_topk", _I64)]


class Mla(ctypes.Structure):
    """`struct specdec_mla`: a layer's multi-head latent attention past its first projection."""

    c_name = "specdec_mla"
    _fields_ = [("q_b", Linear), ("q_a_norm", _P), ("kv_a_norm", _P), ("kv_b", _P), ("nope_dim", _I64),
                ("rope_dim", _I64), ("v_dim", _I64), ("interleave", _I64), ("eps", _F)]


class Layer(ctypes.Structure):
    """`struct specdec_layer`: one decoder layer's linears and RMSNorm weights, or its MoE block,
    and its latent attention."""

    c_name = "specdec_layer"
    _fields_ = [("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
                ("input_norm", _P), ("post_attention_norm", _P), ("moe", ctypes.POINTER(Moe)),
                ("q_norm", _P), ("k_norm", _P), ("mla", ctypes.POINTER(Mla))]


class Attention(ctypes.Structure):
    """`struct specdec_attention`: one step's rotary tables and paged-cache geometry."""

    c_name = "specdec_attention"
    _fields_ = [("positions", _P), ("cos", _P), ("signed_sin", _P), ("num_positions", _I64),
                ("num_slots", _I64), ("slots", _P), ("block_tables", _P), ("max_blocks", _I64),
                ("num_blocks", _I64), ("seq_lens", _P), ("query_start_loc", _P), ("num_seqs", _I64),
                ("block_size", _I64), ("hq", _I64), ("hkv", _I64), ("d", _I64), ("tree_masks", _P)]


class Group(ctypes.Structure):
    """`struct specdec_group`: a tensor-parallel group's shared region and this rank's calls."""

    c_name = "specdec_group"
    _fields_ = [("region", _P), ("rank", _I64), ("world", _I64), ("slot_bytes", _I64), ("calls", _P),
                ("timeout_ms", _I64)] + [(f"{part}_{what}", _I64) for part in ("att", "ffn", "out")
                                          for what in ("start", "width", "full")]


class AbiEntry(ctypes.Structure):
    """`struct specdec_abi_entry`: one row of `kernel_abi.c`'s layout table."""

    c_name = "specdec_abi_entry"
    _fields_ = [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", _I64), ("size", _I64)]


STRUCTURES: tuple[type[ctypes.Structure], ...] = (Linear, Moe, Mla, Layer, Attention, Group, AbiEntry)
CONSTANTS = {"SPECDEC_GROUP": GROUP, "SPECDEC_TILE": TILE, "SPECDEC_SUPER": SUPER,
             "SPECDEC_TILE_Q4_K": TILE_Q4_K, "SPECDEC_TILE_Q6_K": TILE_Q6_K, "SPECDEC_TILE_Q5_0": TILE_Q5_0,
             "SPECDEC_TILE_Q8_0": TILE_Q8_0, "SPECDEC_TILE_Q4_0": TILE_Q4_0,
             "SPECDEC_TILE_Q4_1": TILE_Q4_1, "SPECDEC_TILE_Q5_K": TILE_Q5_K, "SPECDEC_TILE_IQ4_NL": TILE_IQ4_NL,
             "SPECDEC_TILE_MXFP4": TILE_MXFP4, "SPECDEC_TILE_IQ4_XS": TILE_IQ4_XS,
             "SPECDEC_TILE_Q3_K": TILE_Q3_K, "SPECDEC_TILE_Q2_K": TILE_Q2_K, "SPECDEC_TILE_F16": TILE_F16,
             "SPECDEC_TILE_BF16": TILE_BF16, "SPECDEC_MAX_HEAD_DIM": MAX_HEAD_DIM,
             "SPECDEC_MAX_LATENT_DIM": MAX_LATENT_DIM, "SPECDEC_SHM_HEADER": SHM_HEADER,
             **{f"SPECDEC_{s.name}": int(s) for s in Status}}

# name -> (restype, argtypes): kernel_abi.h's prototypes
PROTOTYPES: dict[str, tuple[type, list]] = {
    # x, x_bf16, m, k, glu, tiles, tile_offsets, tile_bits, n, bias, residual, y, y_bf16,
    # norm_w, norm_w_bf16, eps, threads
    "qgemm": (_I, [_P, _I, _I64, _I64, _I, _P, _P, _P, _I64, _P, _P, _P, _I, _P, _I, _F, _I]),
    # a, qkv, row_stride, k_cache, v_cache, scale, out, threads
    "rope_write_attend": (_I, [ctypes.POINTER(Attention), _P, _I64, _P, _P, _F, _P, _I]),
    # a, q, cache, dv, scale, out, threads
    "latent_attend": (_I, [ctypes.POINTER(Attention), _P, _P, _I64, _F, _P, _I]),
    # x, x_bf16, t, heads, k, n, w, w_head_stride, transposed, out, out_bf16, threads
    "head_matmul": (_I, [_P, _I, _I64, _I64, _I64, _I64, _P, _I64, _I, _P, _I, _I]),
    # a, kv_a, row_stride, rope_dim, interleave, norm_w, norm_bf16, eps, cache, threads
    "latent_write": (_I, [ctypes.POINTER(Attention), _P, _I64, _I64, _I, _P, _I, _F, _P, _I]),
    # a, q, row_stride, nope, rope_dim, interleave, w_uk, w_head_stride, query, threads
    "latent_query": (_I, [ctypes.POINTER(Attention), _P, _I64, _I64, _I64, _I, _P, _I64, _P, _I]),
    # x, x_bf16, m, block, norm_w, norm_bf16, eps, residual, y, expert_ids, threads
    "moe_block": (_I, [_P, _I, _I64, ctypes.POINTER(Moe), _P, _I, _F, _P, _P, _P, _I]),
    # h, num_rows, layers, num_layers, norm_bf16, eps, a, kv, scale, qkv, att, gate_up, expert_ids,
    # top_k, group, partial, threads
    "decoder_layers": (_I, [_P, _I64, ctypes.POINTER(Layer), _I64, _I, _F, ctypes.POINTER(Attention), _P,
                            _F, _P, _P, _P, _P, _I64, ctypes.POINTER(Group), _P, _I]),
    # group, x, n
    "group_allreduce": (_I, [ctypes.POINTER(Group), _P, _I64]),
    # w, n, k, group, q, scales_and_zeros, sz_rows, with_error, err_sq, threads
    "int4_quantize_rows": (_I, [_P, _I64, _I64, _I64, _P, _P, _I64, _I, _P, _I]),
    # raw, row_stride, n, k, kind, out, threads
    "kquant_pack": (_I, [_P, _I64, _I64, _I64, _I, _P, _I]),
    # raw, row_stride, rows, ids, n, k, kind, out, out_bf16
    "gguf_rows": (_I, [_P, _I64, _I64, _P, _I64, _I64, _I, _P, _I]),
    # mixed, n, conv_w, channels, kernel, g, beta, key_heads, heads, dk, dv, tiled, conv_in, ssm_in, keep,
    # conv_out, ssm_out, out, threads
    "gated_delta_window": (_I, [_P, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64, _I, _P, _P, _I64, _P, _P,
                                _P, _I]),
    # bytes, threads, repeats, out (bytes/s)
    "roofline_read_bandwidth": (_I, [_I64, _I, _I, ctypes.POINTER(ctypes.c_double)]),
    # rounds, threads, out (multiply-adds/s)
    "roofline_int8_peak": (_I, [_I64, _I, ctypes.POINTER(ctypes.c_double)]),
    "specdec_abi_version": (_I64, []),
    "specdec_abi_layout": (ctypes.POINTER(AbiEntry), [ctypes.POINTER(_I64)]),
}


def bind(lib: ctypes.CDLL, functions: tuple[str, ...]) -> ctypes.CDLL:
    """Declare `functions` (and the layout functions) on `lib` from `PROTOTYPES`, then
    `check_layout`; `KernelABIError` where the library lacks one or disagrees."""
    for name in ("specdec_abi_version", "specdec_abi_layout", *functions):
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise KernelABIError(f"{lib._name} exports no {name}") from None
        fn.restype, fn.argtypes = PROTOTYPES[name]
    check_layout(lib)
    return lib


def check_layout(lib: ctypes.CDLL, structures: tuple[type[ctypes.Structure], ...] = STRUCTURES,
                 constants: dict[str, int] = CONSTANTS) -> None:
    """Compare the library's ABI version, struct sizes, field offsets and sizes, and constants with
    `structures` and `constants`; `KernelABIError` listing every difference."""
    version = lib.specdec_abi_version()
    if version != ABI_VERSION:
        raise KernelABIError(f"{lib._name} has ABI version {version}, specdec.kernel_abi {ABI_VERSION}")
    ours = {(s.c_name, ""): (ctypes.sizeof(s), ctypes.sizeof(s)) for s in structures}
    for s in structures:
        ours.update({(s.c_name, f[0]): (getattr(s, f[0]).offset, getattr(s, f[0]).size) for f in s._fields_})
    ours.update({("constant", name): (value, 0) for name, value in constants.items()})
    theirs = {(e.type.decode(), e.field.decode()): (e.offset, e.size) for e in _layout(lib)}
    problems = [
        f"{t}.{f or 'sizeof'}: C {theirs.get((t, f), 'missing')}, Python {ours.get((t, f), 'missing')}"
        for t, f in sorted(ours.keys() | theirs.keys())
        if ours.get((t, f)) != theirs.get((t, f))
    ]
    if problems:
        raise KernelABIError(f"{lib._name} disagrees with specdec.kernel_abi ((offset, size) or "
                             f"(value, 0)): " + "; ".join(problems))


def _layout(lib: ctypes.CDLL) -> list[AbiEntry]:
    count = _I64()
    table = lib.specdec_abi_layout(ctypes.byref(count))
    return [table[i] for i in range(count.value)]
