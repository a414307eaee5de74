"""Build and load the group-quantized GEMM kernel (`qgemm.c`) for this CPU's instruction-set level
(`specdec.native.simd_level`: AVX-512 VNNI, AVX-VNNI or AVX2, bitwise the same results), and check
a `QLinear`'s buffers before their pointers reach it (`check_weights`).

Where there is no compiler, no AVX2, the build failed, `SPECDEC_ISA=none` or
`SPECDEC_NO_KERNELS=1` is set, `load_qgemm()` returns None and the engine keeps torch's kernels
(`"w8a8"`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specdec import native
from specdec.kernel_abi import GROUP, SUPER, TILE, check_tensor
from specdec.target.quant import kquant

SOURCE = Path(__file__).with_name("qgemm.c")
HEADERS = tuple(SOURCE.with_name(h) for h in ("qgemm_tiles.h", "kquant_tiles.h", "block32_tiles.h", "float_tiles.h"))


def kernel(level: native.SimdLevel | str | None = None) -> native.NativeKernel:
    """The library for `level` (None: the one this machine runs; see `native.simd_kernel`)."""
    return native.simd_kernel((SOURCE,), ("qgemm",), level, HEADERS)


FLOATS = (torch.bfloat16, torch.float32)  # what x, y, residual and norm weights may be
GROUP_BYTES = {4: 320, 8: 544}  # bytes per group of 32 inputs in an int4 / int8 tile (qgemm.c)
TILE_KINDS = {4: "int4", 8: "int8", **kquant.KIND_NAMES}  # tile_bits -> format


def tile_size(bits: int, in_features: int) -> int:
    """Bytes of one tile of format `bits` (a `tile_bits` value) over `in_features` inputs."""
    if bits in kquant.BLOCK_BYTES:
        return kquant.tile_bytes(bits, in_features)
    return in_features // GROUP * GROUP_BYTES[bits]


class KernelUnavailableError(RuntimeError):
    """The quantized CPU kernel cannot run here (why is in the message)."""


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used on this machine, or None when it can."""
    return kernel().unavailable_reason()


def load_qgemm() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None where it cannot run."""
    return kernel().load()


def require_qgemm() -> ctypes.CDLL:
    """The kernel, or `KernelUnavailableError` saying why not."""
    lib = load_qgemm()
    if lib is None:
        reason = unavailable_reason() or f"loading {SOURCE.name}'s library failed"
        raise KernelUnavailableError(
            f"quantization 'w4a8' needs specdec's C kernel (AVX2 or better), which cannot run here: {reason}. "
            "Use 'w8a8' instead."
        )
    return lib


def check_weights(tiles: torch.Tensor, tile_offsets: torch.Tensor, tile_bits: torch.Tensor,
                  bias: torch.Tensor | None, in_features: int, out_features: int) -> None:
    """`check_tensor` on a `QLinear`'s buffers (moved or replaced since it was made), and every
    tile of a known format (`TILE_KINDS`) and inside `tiles`: `ValueError` naming what is not."""
    check_tensor("tiles", tiles, (torch.uint8,), (tiles.numel(),))
    check_tensor("tile_offsets", tile_offsets, (torch.int64,), (out_features // TILE,))
    check_tensor("tile_bits", tile_bits, (torch.uint8,), (out_features // TILE,))
    if bias is not None:
        check_tensor("bias", bias, (torch.float32,), (out_features,))
    if in_features % GROUP or out_features % TILE:
        raise ValueError(f"QLinear needs in_features % {GROUP} == out_features % {TILE} == 0, "
                         f"got {in_features} and {out_features}")
    kinds = set(tile_bits.unique().tolist())
    if not kinds <= TILE_KINDS.keys():
        raise ValueError(f"tile_bits must all be one of {sorted(TILE_KINDS)}, got {sorted(kinds - TILE_KINDS.keys())}")
    if kinds & kquant.SUPER_KINDS and in_features % SUPER:
        raise ValueError(f"k-quant tiles need in_features % {SUPER} == 0, got {in_features}")
    sizes = torch.tensor([tile_size(b, in_features) if b in kinds else 0 for b in range(max(TILE_KINDS) + 1)])
    ends = tile_offsets + sizes[tile_bits.long()]
    if tile_offsets.numel() and (int(tile_offsets.min()) < 0 or int(ends.max()) > tiles.numel()):
        raise ValueError(f"tile_offsets point outside tiles ({tiles.numel()} bytes)")
