"""`Int8Linear`: W8A8, int8 weights per output channel and int8 activations per row, on fbgemm: the
`w8a8` quantization, which the CPU defaults take only where specdec's own C kernel (`qgemm`, AVX2
or better) cannot run; fbgemm packs the weights on every load (`linear_prepack`, ~14 ns per weight).

fbgemm's int8 GEMM (VNNI) costs 0.49 / 0.49 / 0.57 ms for 1 / 5 / 9 rows of a 1536x8960 matrix
(two Zen 4 cores): flat up to ~9 rows, which is what verifying k+1 tokens needs. Activations are
quantized per row (token) with a fixed quantization scale after a per-row rescale, so a row's
result does not depend on the other rows of the batch (integer accumulation is exact).
Per-token int8 activations suffer from outlier channels; `smoothing` first migrates them into
the weights (SmoothQuant), an exact rewrite in real arithmetic.

torch's weight-only int8 kernel (`_weight_int8pack_mm`, torch 2.13 CPU) crashed with a segmentation
fault in our tests and is not flat in rows (1.1 / 1.9 / 3.3 ms), so there is no weight-only int8.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from specdec.native import cpu_has


def int_mm_is_fast() -> bool:
    """Whether `torch._int_mm` has a VNNI kernel here. Without AVX-512 VNNI or AVX-VNNI (an AVX2
    EPYC, say) it ran a 512x1536x8960 GEMM at 0.2-1.9 GMAC/s against fbgemm's ~40, which made a
    128-token draft prefill take 24 s instead of ~1 s."""
    return cpu_has("avx512_vnni") or cpu_has("avx_vnni")


def fbgemm_activation_range() -> tuple[float, int]:
    """(r, zero point) for fbgemm's uint8 activations. Without AVX-512 VNNI fbgemm multiplies with
    `vpmaddubsw`, which adds pairs of u8 x s8 products into a saturating int16: activations up to
    255 overflow it (a 256-input linear was 12% off on an AVX2 EPYC). 7 bits (r 63, zero point
    64) keep every pair below 2^15, as fbgemm's own `reduce_range` does."""
    return (127.0, 128) if fbgemm_uses_vnni() else (63.0, 64)


def fbgemm_uses_vnni() -> bool:
    """Whether fbgemm multiplies with AVX-512 VNNI: the CPU has it and fbgemm's own switch
    `FBGEMM_ENABLE_INSTRUCTIONS` does not hold it to AVX2 or plain AVX-512 (which also lets a VNNI
    machine run, and time, what an AVX2 machine runs)."""
    forced = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "").upper()
    return cpu_has("avx512_vnni") and forced not in ("AVX2", "AVX512", "AVX512_256")


class Int8Linear(nn.Module):
    """`y = x @ w.T + b` with int8 weights per output channel and int8 activations per row (W8A8).

    fbgemm's packed weights (`linear_prepack`) cannot be saved, so the module keeps the int8
    weights and scales as buffers (what the cache stores) and packs them on first use or in
    `prepack()` into `_packed` (None until then).
    """

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight_int8", weight_int8)  # [N, K] int8
        self.register_buffer("weight_scale", weight_scale)  # [N] fp32
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), False)
        self.out_features, self.in_features = weight_int8.shape
        self._packed = None

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "Int8Linear":
        return cls(*quantize_int8(linear.weight.detach()), linear.bias)

    @classmethod
    def from_state(
        cls, tensors: dict[str, torch.Tensor | None], in_features: int, bias: torch.Tensor | None
    ) -> "Int8Linear":
        """From the tensors a cache file holds (`formats.INT8.state_keys`)."""
        return cls(tensors["weight_int8"], tensors["weight_scale"], bias)

    def prepack(self) -> None:
        """Set `_packed`: fbgemm's packed weights (~14 ns per weight on an AVX2 EPYC)."""
        with warnings.catch_warnings():  # torch deprecates quantized tensors; fbgemm still takes them
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(
                self.weight_int8, self.weight_scale.double(),
                torch.zeros_like(self.weight_scale, dtype=torch.long), 0,
            )
        self._packed = torch.ops.quantized.linear_prepack(qw, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            self.prepack()
        x2 = x.reshape(-1, self.in_features).float()  # [M, K]
        amax = x2.abs().amax(-1, keepdim=True).clamp_(min=1e-8)  # [M, 1]
        # Each row is rescaled to [-r, r]; the fixed (scale 1, zero point r + 1) quantization then
        # rounds every row alike, whatever else is in the batch.
        r, zero_point = fbgemm_activation_range()
        x_scaled = x2 * (r / amax) if x.dtype == torch.float32 else x2.mul_(r / amax)  # x2 is a copy
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            x_scaled, 1.0, zero_point, self._packed,
        )  # [M, N]
        y = y.mul_(amax / r) if self.bias is None else torch.addcmul(self.bias, y, amax / r)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: `(q [N, K] int8, scale [N] fp32)`, w ~ q * scale."""
    w = weight.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)  # [N]
    return torch.div(w, scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale  # one temporary


def fuse_int8(parts: list[nn.Module]) -> Int8Linear | None:
    """One `Int8Linear` whose output is the concatenation of `parts`' outputs (same input), or
    None unless all parts are `Int8Linear`.

    Exact: weights keep their per-channel scales and every row's activation scale is the same.
    """
    if not all(isinstance(p, Int8Linear) for p in parts):
        return None
    return Int8Linear(
        torch.cat([p.weight_int8 for p in parts]), torch.cat([p.weight_scale for p in parts]),
        cat_biases(parts, torch.float32),
    )


def cat_biases(parts: list[nn.Module], dtype: torch.dtype) -> torch.Tensor | None:
    """A fused module's bias (every format's `fuse` shares it): the parts' biases end to end (zeros for a part without), or None."""
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=dtype) for p in parts])

