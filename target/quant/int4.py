"""`Int4Linear`: weight-only int4 per group of inputs on torch's CPU kernel (`"int4"`, `"auto"`).

Decoding is memory-bound: each forward reads every weight once, so bytes per weight set the speed.
torch ships a CPU kernel that dequantizes inside the GEMM (`_weight_int4pack_mm_for_cpu`). GGUF
Q4_K weights lie on a 16-level grid per 32-element sub-block, so int4 with group size 32
re-quantizes them almost exactly; Q6_K / Q8_0 tensors do not fit 4 bits. Mode `"auto"` takes int4
only where the reconstruction is near exact and leaves the rest dense; `"int4"` quantizes every
linear (lossy on weights off the grid).

The int4 kernel is fast for one row but compute-bound beyond it (1 row 0.38 ms, 5 rows 1.3 ms,
9 rows 2.0 ms for a 1536x8960 matrix on two Zen 4 cores), which makes verifying k+1 tokens cost
k+1 forwards; `"int4+w8a8"` adds an int8 copy for windows of several rows (see `Int4Linear`).
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdec import kernel_abi, native
from specdec.target.quant.int8 import Int8Linear, cat_biases, int_mm_is_fast, quantize_int8

INT4_GROUP = 32
# "int4+w8a8": windows of at least this many rows take the int8 copy. A whole 0.5B draft forward
# (2 cores) took 26 / 50 / 73 / 732 ms for 2 / 5 / 10 / 150 rows in int4 and 42 / 46 / 53 / 317 ms
# in int8: int8 reads twice the bytes, int4 unpacking is compute-bound beyond ~4 rows.
INT8_MIN_ROWS = 5
INT4_PACK_BLOCK = 64  # output channels per block of `_convert_weight_to_int4pack_for_cpu`'s layout
AUTO_INT4_MAX_ERROR = 0.02  # relative Frobenius error under which int4 is taken as exact enough
# `_quantize_int4_rows` for groups of 32 in C (AVX2, eight groups at a time), bitwise its torch path
QUANTIZER = native.NativeKernel(
    (Path(__file__).with_name("int4_quant.c"),), flags=("-mavx2",), cpu_flags=("avx2",),
    functions=("int4_quantize_rows",),
)


class Int4Linear(nn.Module):
    """`y = x @ w.T + b` with w = (q - 8) * scale + zero per group of `group_size` inputs.

    With an int8 copy of the weights (`weight_int8 [N, K]`, per-channel `int8_scale [N]`: the
    `"int4+w8a8"` mode), windows of `INT8_MIN_ROWS` rows or more multiply in int8 instead
    (`torch._int_mm`, activations per row): the int4 kernel is compute-bound beyond a few rows (a
    150-token draft prefill took 732 ms in int4, 317 ms in int8). Rows then round differently from single-row
    decoding, which is why only the draft uses the mode.
    """

    def __init__(
        self, weight_int4: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None,
        in_features: int, group_size: int = INT4_GROUP,
        weight_int8: torch.Tensor | None = None, int8_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("weight_int4", weight_int4)  # packed by _convert_weight_to_int4pack_for_cpu
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [K/g, N, 2] bf16
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), False)
        self.group_size = group_size
        self.in_features, self.out_features = in_features, scales_and_zeros.shape[1]
        self.register_buffer("weight_int8", weight_int8)  # [N, K] int8 or None
        self.register_buffer("int8_scale", int8_scale)  # [N] fp32 or None

    @classmethod
    def from_quantized(
        cls, q: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None, int8_from: torch.Tensor | None = None,
    ) -> "Int4Linear":
        """From `quantize_int4`'s output; `int8_from` (the float weight) adds the int8 copy."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        group = q.shape[1] // sz.shape[0]
        w8 = s8 = None
        if int8_from is not None:
            w8, s8 = quantize_int8(int8_from)
        return cls(packed, sz, None if bias is None else bias.detach(), q.shape[1], group, w8, s8)

    @classmethod
    def from_state(
        cls, tensors: dict[str, torch.Tensor | None], in_features: int, bias: torch.Tensor | None
    ) -> "Int4Linear":
        """From the tensors a cache file holds (`formats.INT4.state_keys`; the int8 copy may be None)."""
        sz = tensors["scales_and_zeros"]
        return cls(
            tensors["weight_int4"], sz, bias, in_features, in_features // sz.shape[0],
            tensors["weight_int8"], tensors["int8_scale"],
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.bfloat16:  # the model's own layout: no reshapes or casts
            if self.weight_int8 is not None and x.shape[0] >= INT8_MIN_ROWS:
                return self._forward_int8(x)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.weight_int4, self.group_size, self.scales_and_zeros
            )  # [M, N]
            return y if self.bias is None else y.add_(self.bias)
        return self.forward(x.reshape(-1, self.in_features).to(torch.bfloat16)).reshape(
            *x.shape[:-1], self.out_features
        ).to(x.dtype)

    def _forward_int8(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] bf16 -> [M, N] bf16
        if not int_mm_is_fast():  # Int8Linear on fbgemm
            int8 = self.__dict__.get("_int8")  # not a submodule: no second copy in state_dict
            if int8 is None:
                int8 = self.__dict__["_int8"] = Int8Linear(self.weight_int8, self.int8_scale, None)
            y = int8(x.float())  # [M, N] fp32
            return (y if self.bias is None else y.add_(self.bias)).to(torch.bfloat16)
        x32 = x.float()
        amax = x32.abs().amax(-1, keepdim=True).clamp_(min=1e-8)  # [M, 1]
        xq = x32.mul_(127.0 / amax).round_().to(torch.int8)  # [M, K] per-row symmetric
        y = torch._int_mm(xq, self.weight_int8.t()).float()  # [M, N] exact int32 sums
        y = y.mul_(amax / 127.0).mul_(self.int8_scale)
        return (y if self.bias is None else y.add_(self.bias)).to(torch.bfloat16)


def fuse_int4(parts: list[nn.Module]) -> Int4Linear | None:
    """One `Int4Linear` whose output is the concatenation of `parts`' outputs (same input), or
    None unless all parts are `Int4Linear` of one group size with whole blocks of outputs.

    Exact: the CPU packing lays out output channels in blocks of `INT4_PACK_BLOCK`, so whole
    blocks of packed rows concatenate (a part of 96 outputs would not: tested).
    """
    if not all(isinstance(p, Int4Linear) for p in parts):
        return None
    if len({p.group_size for p in parts}) != 1 or any(p.out_features % INT4_PACK_BLOCK for p in parts):
        return None
    if len({p.weight_int8 is None for p in parts}) != 1:
        return None
    with_int8 = parts[0].weight_int8 is not None
    return Int4Linear(
        torch.cat([p.weight_int4 for p in parts]), torch.cat([p.scales_and_zeros for p in parts], 1),
        cat_biases(parts, torch.bfloat16), parts[0].in_features, parts[0].group_size,
        torch.cat([p.weight_int8 for p in parts]) if with_int8 else None,
        torch.cat([p.int8_scale for p in parts]) if with_int8 else None,
    )


def chunk_rows(in_features: int) -> int:
    """Rows per chunk of ~1M weights, the quantizers' unit of work: a chunk's temporaries stay in
    cache (1.3x faster than 4M for int4; whole-tensor temporaries made int8 groups 5x slower)."""
    return max(1, (1 << 20) // in_features)


def quantize_int4(
    weight: torch.Tensor, group_size: int, max_error: float = math.inf,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Asymmetric int4 per group: `q [N, K] int32` in 0..15, `scales_and_zeros [K/g, N, 2]` bf16.

    Each group's step is the smallest gap between its distinct values when all values sit on a
    grid of at most 16 levels (as GGUF Q4_K weights do: exact), else (max - min) / 15.

    With a finite `max_error`: None where the reconstruction's relative Frobenius error (bf16 steps
    and zeros, as the kernels use them: `int4_error`) reaches it, known as soon as the chunks done
    so far reach it, so a tensor that does not fit 4 bits (Q6_K, an LM head) stops early. The error
    is summed chunk by chunk while each chunk is in cache: a separate pass over a whole tensor
    (`int4_error`) took 22 s of the default pair's first load.
    """
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int32)
    sz = torch.empty(k // group_size, n, 2, dtype=torch.bfloat16)
    limit = math.inf if max_error == math.inf else (max_error * weight.float().norm().clamp(min=1e-12).item()) ** 2
    error = 0.0  # the squared error so far
    rows = chunk_rows(k)
    lib = QUANTIZER.load() if group_size == 32 else None
    for r in range(0, n, rows):
        if lib is not None:
            chunk_error = _quantize_int4_rows_c(lib, weight[r : r + rows], q, sz, r, limit < math.inf)
        else:
            q[r : r + rows], sz[:, r : r + rows], chunk_error = _quantize_int4_rows(
                weight[r : r + rows], group_size, limit < math.inf
            )
        error += chunk_error
        if error >= limit:
            return None
    return q, sz


def _quantize_int4_rows_c(
    lib: ctypes.CDLL, weight: torch.Tensor, q: torch.Tensor, sz: torch.Tensor, row0: int, with_error: bool,
) -> float:
    """`_quantize_int4_rows` of `weight [rows, K]` (groups of 32) by `int4_quant.c`, written into
    rows `row0:row0 + rows` of `q [N, K]` int32 and `sz [K/32, N, 2]` bf16; returns the squared error."""
    w = weight.float().contiguous()
    rows, k = w.shape
    err_sq = ctypes.c_double(0.0)
    rc = lib.int4_quantize_rows(
        w.data_ptr(), rows, k, 32, q.data_ptr() + row0 * k * q.element_size(),
        sz.data_ptr() + 2 * row0 * sz.element_size(), sz.shape[1], with_error, ctypes.byref(err_sq),
        torch.get_num_threads(),
    )
    kernel_abi.raise_for_status(rc, "int4_quantize_rows")
    return err_sq.value


def _quantize_int4_rows(
    weight: torch.Tensor, group_size: int, with_error: bool,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`quantize_int4` of a few rows, and (`with_error`, else 0) the reconstruction's squared error."""
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)  # [n, G, g]
    lo, hi = torch.aminmax(w, dim=-1)  # [n, G]
    minmax_step = ((hi - lo) / 15).clamp(min=1e-12)
    # numpy sorts 32-element rows ~4x faster than torch on this CPU; a sort is exact either way
    gaps = torch.from_numpy(np.sort(w.detach().numpy(), -1)).diff(dim=-1)  # [n, G, g-1]
    tiny = 1e-4 * minmax_step.unsqueeze(-1)
    grid_step = gaps.masked_fill_(gaps <= tiny, torch.inf).amin(-1)  # [n, G]; inf: constant group
    grid_step = torch.where(torch.isinf(grid_step), minmax_step, grid_step)
    step = torch.where((hi - lo) <= grid_step * 15.01, grid_step, minmax_step)
    levels = (w - lo[..., None]) / step[..., None]  # [n, G, g]
    q = levels.round()
    on_grid = levels.sub_(q).abs_().amax(-1) < 0.02  # [n, G]
    # off the grid: the min-max step, whose levels are those already rounded unless the step changes
    redo = ~on_grid & (step != minmax_step)
    step = torch.where(on_grid, step, minmax_step)
    if redo.any():
        at = redo.nonzero(as_tuple=True)
        q[at] = ((w[at] - lo[at][:, None]) / step[at][:, None]).round()
    zero = lo + 8 * step  # the kernel computes (q - 8) * scale + zero
    scales_and_zeros = torch.stack([step, zero], -1).transpose(0, 1).to(torch.bfloat16)  # [G, n, 2]
    q = q.clamp_(0, 15)
    error = 0.0
    if with_error:  # as int4_error computes it
        scale, zero = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [n, G] each
        error = levels.copy_(q).sub_(8).mul_(scale[..., None]).add_(zero[..., None]).sub_(w).norm().item() ** 2
    return q.to(torch.int32).view(n, k), scales_and_zeros, error


def int4_error(weight: torch.Tensor, q: torch.Tensor, sz: torch.Tensor) -> float:
    """Relative Frobenius error of an int4 reconstruction (bf16 scales, as the kernel uses)."""
    n, k = weight.shape
    group = k // sz.shape[0]
    scale, zero = sz.float().transpose(0, 1).unbind(-1)  # [N, G] each
    w = ((q.view(n, -1, group).float() - 8) * scale[..., None] + zero[..., None]).view(n, k)
    return ((w - weight.float()).norm() / weight.float().norm().clamp(min=1e-12)).item()


def int4_from_linear(linear: nn.Linear, max_error: float = math.inf, int8_copy: bool = False) -> nn.Module:
    """The `Int4Linear` of `linear`, or `linear` itself where its shape does not fit (K % 32, N %
    16) or the int4 weights are `max_error` or more off (relative Frobenius error; `"auto"`).
    `int8_copy` adds the int8 weights of `"int4+w8a8"`."""
    w, b = linear.weight.detach(), linear.bias
    if w.shape[1] % INT4_GROUP or w.shape[0] % 16:
        return linear
    quantized = quantize_int4(w, INT4_GROUP, max_error)
    if quantized is None:
        return linear
    return Int4Linear.from_quantized(*quantized, b, int8_from=w if int8_copy else None)
