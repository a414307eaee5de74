"""Build and load the group-quantized GEMM kernel (`qgemm.c`, with the decoder-layer loop of
`decoder.c` that calls it) for this CPU (see `specdec.native`).

Where there is no compiler, no AVX-512 VNNI, or `SPECDEC_NO_KERNELS=1` is set, `load_qgemm()`
returns None and the engine keeps torch's kernels (`"w8a8"`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from specdec import native

SOURCE = Path(__file__).with_name("qgemm.c")
KERNEL = native.NativeKernel(
    (SOURCE, Path(__file__).with_name("decoder.c")),
    flags=("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    cpu_flags=("avx512f", "avx512bw", "avx512_vnni"),
)
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    # x, x_bf16, m, k, glu, tiles, tile_offsets, tile_bits, n, bias, residual, y, y_bf16,
    # norm_w, norm_w_bf16, eps, threads
    "qgemm": [_P, _I, _I64, _I64, _I, _P, _P, _P, _I64, _P, _P, _P, _I, _P, _I, _F, _I],
    # h, num_rows, layers, num_layers, norm_bf16, eps, attention, attend, scale, qkv, att,
    # gate_up, threads
    "decoder_layers": [_P, _I64, _P, _I64, _I, _F, _P, _P, _F, _P, _P, _P, _I],
}


class KernelUnavailableError(RuntimeError):
    """The quantized CPU kernel cannot run here (why is in the message)."""


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used on this machine, or None when it can."""
    return KERNEL.unavailable_reason()


def load_qgemm() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None where it cannot run."""
    return None if unavailable_reason() is not None else _load()


def _load() -> ctypes.CDLL | None:
    return native.load(KERNEL, SIGNATURES)


def require_qgemm() -> ctypes.CDLL:
    """The kernel, or `KernelUnavailableError` saying why not."""
    lib = load_qgemm()
    if lib is None:
        reason = unavailable_reason() or f"building {SOURCE.name} failed (run it by hand: {KERNEL.command('x.so')})"
        raise KernelUnavailableError(
            f"quantization 'w4a8' needs the AVX-512 VNNI kernel, which cannot run here: {reason}. "
            "Use 'w8a8' instead."
        )
    return lib
