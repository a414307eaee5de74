"""Build and load the AVX2 W8A8 GEMM (`int8_avx2.c`) for this CPU (see `specdec.native`), and call
it on an `Int8Linear`'s buffers after checking them (`int8_gemm`).

The kernel multiplies straight from the row-major `weight_int8 [N, K]` that the cache stores, so a
model loads without fbgemm's packing (~14 ns per weight on an AVX2 EPYC: 19.5 s per load of the
1.5B target), and returns bitwise what fbgemm returns on the machines it serves: AVX2 without
AVX-512 VNNI, where fbgemm's activations are 7-bit (`int8.fbgemm_activation_range`). Where there is
no compiler, no AVX2, the build failed, or `SPECDEC_NO_KERNELS=1` is set, `load_int8_gemm()` returns
None and `Int8Linear` keeps fbgemm.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specdec import kernel_abi, native
from specdec.kernel_abi import check_tensor

SOURCE = Path(__file__).with_name("int8_avx2.c")
KERNEL = native.NativeKernel(
    (SOURCE,), flags=("-mavx2", "-mfma"), cpu_flags=("avx2", "fma"), functions=("int8_gemm_avx2",)
)
K_STEP = 32  # int8_avx2.c K_STEP: in_features must be a multiple of it


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used on this machine, or None when it can."""
    return KERNEL.unavailable_reason()


def load_int8_gemm() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None where it cannot run."""
    return KERNEL.load()


def int8_gemm(
    x_scaled: torch.Tensor,  # [M, K] fp32, each row scaled into the activation range
    weight_int8: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N] fp32
    zero_point: int,
) -> torch.Tensor:  # [M, N] fp32
    """`y[m, n] = float(sum_k q[m, k] * w[n, k]) * weight_scale[n]` with
    q = clamp(nearbyint(x_scaled + zero_point), 0, 255) - zero_point: bitwise what fbgemm's
    `linear_with_input_q_dq_qweight_dq_output_fp32` returns at activation scale 1 while
    |x_scaled| <= 63.5 (q is kept to [-63, 63], see `int8_avx2.c`). On `torch.get_num_threads()`
    threads; the result does not depend on their number. `ValueError` for a tensor or size the
    kernel does not take.

    >>> w = torch.tensor([[1, -2] * 16], dtype=torch.int8)  # [1, 32]
    >>> int8_gemm(torch.full((1, 32), 0.5), w, torch.ones(1), 64)  # q = nearbyint(64.5) - 64 = 0
    tensor([[0.]])
    """
    if x_scaled.dim() != 2 or weight_int8.dim() != 2:
        raise ValueError(f"x_scaled and weight_int8 must be 2-D, got {list(x_scaled.shape)} and "
                         f"{list(weight_int8.shape)}")
    (m, k), n = x_scaled.shape, weight_int8.shape[0]
    if k % K_STEP:
        raise ValueError(f"int8_gemm needs in_features % {K_STEP} == 0, got {k}")
    if not 0 <= zero_point <= 255:
        raise ValueError(f"zero_point must be in [0, 255], got {zero_point}")
    check_tensor("x_scaled", x_scaled, (torch.float32,), (m, k))
    check_tensor("weight_int8", weight_int8, (torch.int8,), (n, k))
    check_tensor("weight_scale", weight_scale, (torch.float32,), (n,))
    lib = load_int8_gemm()
    if lib is None:
        raise RuntimeError(f"the AVX2 int8 kernel cannot run here: {unavailable_reason()}")
    y = x_scaled.new_empty(m, n)
    rc = lib.int8_gemm_avx2(
        x_scaled.data_ptr(), m, k, weight_int8.data_ptr(), weight_scale.data_ptr(), n, y.data_ptr(), zero_point,
        torch.get_num_threads(),
    )
    kernel_abi.raise_for_status(rc, "int8_gemm_avx2")
    return y
