"""Quantized linears for the CPU: weight-only int4 (group-wise) and W8A8 (int8 weights and activations).

Decoding is memory-bound: each forward reads every weight once, so bytes per weight set the speed.
torch ships a CPU kernel that dequantizes inside the GEMM (`_weight_int4pack_mm_for_cpu`). GGUF
Q4_K weights lie on a 16-level grid per 32-element sub-block, so int4 with group size 32
re-quantizes them almost exactly; Q6_K / Q8_0 tensors do not fit 4 bits. `quantize_model(model,
"auto")` takes int4 only where the reconstruction is near exact and leaves the rest dense;
`"int4"` quantizes every linear (lossy on weights off the grid).

The int4 kernel is fast for one row but compute-bound beyond it (1 row 0.38 ms, 5 rows 1.3 ms,
9 rows 2.0 ms for a 1536x8960 matrix on two Zen 4 cores), which makes verifying k+1 tokens cost
k+1 forwards. `"w8a8"` instead uses fbgemm's int8 GEMM (VNNI): 0.49 / 0.49 / 0.57 ms for 1 / 5 / 9
rows, flat up to ~9 rows, which is what verification needs. Activations are quantized per row
(token) with a fixed quantization scale after a per-row rescale, so a row's result does not depend
on the other rows of the batch (integer accumulation is exact). Per-token int8 activations suffer
from outlier channels; `specdec.target.smoothing` first migrates them into the weights
(SmoothQuant), an exact rewrite in real arithmetic.

torch's weight-only int8 kernel (`_weight_int8pack_mm`, torch 2.13 CPU) crashed with a segmentation
fault in our tests and is not flat in rows (1.1 / 1.9 / 3.3 ms), so there is no weight-only int8.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from specdec.config import QUANT_MODES

INT4_GROUP = 32
# "int4+w8a8": windows of at least this many rows take the int8 copy. A whole 0.5B draft forward
# (2 cores) took 26 / 50 / 73 / 732 ms for 2 / 5 / 10 / 150 rows in int4 and 42 / 46 / 53 / 317 ms
# in int8: int8 reads twice the bytes, int4 unpacking is compute-bound beyond ~4 rows.
INT8_MIN_ROWS = 5
INT4_PACK_BLOCK = 64  # output channels per block of `_convert_weight_to_int4pack_for_cpu`'s layout
AUTO_INT4_MAX_ERROR = 0.02  # relative Frobenius error under which int4 is taken as exact enough


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
        if not int_mm_is_fast():
            fbgemm = self.__dict__.get("_fbgemm")  # not a submodule: no second copy in state_dict
            if fbgemm is None:
                fbgemm = self.__dict__["_fbgemm"] = Int8Linear(self.weight_int8, self.int8_scale, None)
            y = fbgemm(x.float())  # [M, N] fp32
            return (y if self.bias is None else y.add_(self.bias)).to(torch.bfloat16)
        x32 = x.float()
        amax = x32.abs().amax(-1, keepdim=True).clamp_(min=1e-8)  # [M, 1]
        xq = x32.mul_(127.0 / amax).round_().to(torch.int8)  # [M, K] per-row symmetric
        y = torch._int_mm(xq, self.weight_int8.t()).float()  # [M, N] exact int32 sums
        y = y.mul_(amax / 127.0).mul_(self.int8_scale)
        return (y if self.bias is None else y.add_(self.bias)).to(torch.bfloat16)


def int_mm_is_fast() -> bool:
    """Whether `torch._int_mm` has a VNNI kernel here. Without AVX-512 VNNI or AVX-VNNI (an AVX2
    EPYC, say) it ran a 512x1536x8960 GEMM at 0.2-1.9 GMAC/s against fbgemm's ~40, which made a
    128-token draft prefill take 24 s instead of ~1 s."""
    from specdec.native import cpu_has

    return cpu_has("avx512_vnni") or cpu_has("avx_vnni")


def fbgemm_activation_range() -> tuple[float, int]:
    """(r, zero point) for fbgemm's uint8 activations. Without AVX-512 VNNI fbgemm multiplies with
    `vpmaddubsw`, which adds pairs of u8 x s8 products into a saturating int16: activations up to
    255 overflow it (a 256-input linear was 12% off on an AVX2 EPYC). 7 bits (r 63, zero point
    64) keep every pair below 2^15, as fbgemm's own `reduce_range` does."""
    from specdec.native import cpu_has

    return (127.0, 128) if cpu_has("avx512_vnni") else (63.0, 64)


class Int8Linear(nn.Module):
    """`y = x @ w.T + b` with int8 weights per output channel and int8 activations per row (W8A8).

    fbgemm's packed weights (`linear_prepack`) cannot be saved, so the module keeps the int8
    weights and scales as buffers (what the cache stores) and packs them on first use or in
    `prepack()`.
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

    def prepack(self) -> None:
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
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            x2 * (r / amax) if x.dtype == torch.float32 else x2.mul_(r / amax),  # x2 is a copy
            1.0, zero_point, self._packed,
        )  # [M, N]
        y = y.mul_(amax / r) if self.bias is None else torch.addcmul(self.bias, y, amax / r)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: `(q [N, K] int8, scale [N] fp32)`, w ~ q * scale."""
    w = weight.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)  # [N]
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def fuse_int8(parts: list[nn.Module]) -> Int8Linear | None:
    """One `Int8Linear` whose output is the concatenation of `parts`' outputs (same input), or
    None unless all parts are `Int8Linear`.

    Exact: weights keep their per-channel scales and every row's activation scale is the same.
    """
    if not all(isinstance(p, Int8Linear) for p in parts):
        return None
    return Int8Linear(
        torch.cat([p.weight_int8 for p in parts]), torch.cat([p.weight_scale for p in parts]),
        _cat_biases(parts, torch.float32),
    )


def _cat_biases(parts: list[nn.Module], dtype: torch.dtype) -> torch.Tensor | None:
    """The fused module's bias: the parts' biases end to end (zeros for a part without), or None."""
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=dtype) for p in parts])


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
        _cat_biases(parts, torch.bfloat16), parts[0].in_features, parts[0].group_size,
        torch.cat([p.weight_int8 for p in parts]) if with_int8 else None,
        torch.cat([p.int8_scale for p in parts]) if with_int8 else None,
    )


def prepare_quantized(model: nn.Module) -> None:
    """Fuse q/k/v and gate/up where `fuse_int8`, `fuse_int4` or `fuse_qlinear` can: fewer, larger
    GEMMs, ~85 fewer calls per forward for a 28-layer model. Move `QLinear` tiles into one arena
    on huge pages. Then pack every `Int8Linear` for fbgemm now (two threads: packing is ~60 ms per
    14M weights)."""
    from concurrent.futures import ThreadPoolExecutor

    from specdec.target.qlinear import QLinear, fuse_qlinear, pack_tiles

    for module in model.modules():
        fuse = getattr(module, "fuse_projections", None)
        if fuse is not None:
            for fuse_fn in (fuse_int8, fuse_int4, fuse_qlinear):
                fuse(fuse_fn)
    pack_tiles([m for m in model.modules() if isinstance(m, QLinear)])
    modules = [m for m in model.modules() if isinstance(m, Int8Linear) and m._packed is None]
    with ThreadPoolExecutor(max_workers=max(1, min(2, torch.get_num_threads()))) as pool:
        list(pool.map(Int8Linear.prepack, modules))


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group: `q [N, K] int32` in 0..15, `scales_and_zeros [K/g, N, 2]` bf16.

    Each group's step is the smallest gap between its distinct values when all values sit on a
    grid of at most 16 levels (as GGUF Q4_K weights do: exact), else (max - min) / 15.
    """
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int32)
    sz = torch.empty(k // group_size, n, 2, dtype=torch.bfloat16)
    rows = max(1, (1 << 22) // k)  # chunks of ~4M weights bound the temporary memory
    for r in range(0, n, rows):
        q[r : r + rows], sz[:, r : r + rows] = _quantize_int4_rows(weight[r : r + rows], group_size)
    return q, sz


def _quantize_int4_rows(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)  # [n, G, g]
    lo, hi = w.amin(-1), w.amax(-1)  # [n, G]
    minmax_step = ((hi - lo) / 15).clamp(min=1e-12)
    gaps = w.sort(-1).values.diff(dim=-1)  # [n, G, g-1]
    tiny = 1e-4 * minmax_step.unsqueeze(-1)
    grid_step = torch.where(gaps > tiny, gaps, torch.inf).amin(-1)  # [n, G]; inf: constant group
    grid_step = torch.where(torch.isinf(grid_step), minmax_step, grid_step)
    step = torch.where((hi - lo) <= grid_step * 15.01, grid_step, minmax_step)
    levels = (w - lo[..., None]) / step[..., None]
    on_grid = (levels - levels.round()).abs().amax(-1) < 0.02  # [n, G]
    step = torch.where(on_grid, step, minmax_step)
    q = ((w - lo[..., None]) / step[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    zero = lo + 8 * step  # the kernel computes (q - 8) * scale + zero
    return q, torch.stack([step, zero], -1).transpose(0, 1).to(torch.bfloat16)


def int4_error(weight: torch.Tensor, q: torch.Tensor, sz: torch.Tensor) -> float:
    """Relative Frobenius error of an int4 reconstruction (bf16 scales, as the kernel uses)."""
    n, k = weight.shape
    group = k // sz.shape[0]
    scale, zero = sz.float().transpose(0, 1).unbind(-1)  # [N, G] each
    w = ((q.view(n, -1, group).float() - 8) * scale[..., None] + zero[..., None]).view(n, k)
    return ((w - weight.float()).norm() / weight.float().norm().clamp(min=1e-12)).item()


def linear_kind(module: nn.Module) -> str:
    """The quantized format of a linear, as counted and cached: int4, int8, qlinear or dense."""
    from specdec.target.qlinear import QLinear

    kinds = {Int4Linear: "int4", Int8Linear: "int8", QLinear: "qlinear"}
    return kinds.get(type(module), "dense")


def _choose(linear: nn.Linear, mode: str) -> nn.Module:
    """The quantized version of a linear for `mode` (every mode but "none" and "w8a8"), or the
    linear itself where the format does not fit its shape (or, for "auto", its values)."""
    w, b = linear.weight.detach(), linear.bias
    if mode.startswith("w4a8"):
        from specdec.target.qlinear import QLinear

        if not QLinear.fits(w):
            return linear
        return QLinear.from_weight(w, b, AUTO_INT4_MAX_ERROR if mode == "w4a8-auto" else float("inf"))
    if w.shape[1] % INT4_GROUP or w.shape[0] % 16:
        return linear
    q, sz = quantize_int4(w, INT4_GROUP)
    if mode != "auto" or int4_error(w, q, sz) < AUTO_INT4_MAX_ERROR:
        return Int4Linear.from_quantized(q, sz, b, int8_from=w if mode == "int4+w8a8" else None)
    return linear


def quantize_model(
    model: nn.Module, mode: str, progress: bool = True, calibration_ids: list[int] | None = None
) -> dict[str, int]:
    """Replace projections and the LM head by quantized linears in place; returns how many of each.

    The embedding stays as it is (a lookup reads one row per token). CPU only. `"w8a8"` first
    smooths the model on `calibration_ids` (activation statistics; see `smoothing`).
    """
    if mode not in QUANT_MODES:
        raise ValueError(f"quantization must be one of {QUANT_MODES}, got {mode!r}")
    counts = {"int4": 0, "int8": 0, "qlinear": 0, "dense": 0}
    if mode == "none":
        return counts
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("the quantized kernels are CPU only; use quantization 'none' on GPU")
    if mode.startswith("w4a8"):
        from specdec.target.qgemm import require_qgemm

        require_qgemm()  # fail before quantizing, with the reason
    if getattr(model, "lm_head", None) is not None and model.lm_head.weight is model.model.embed_tokens.weight:
        model.lm_head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
        model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone(), False)
    from tqdm.auto import tqdm

    if mode == "w8a8":
        from specdec.target.smoothing import smooth_model

        smooth_model(model, calibration_ids or [])
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in tqdm(targets, desc=f"quantizing to {mode} (once; cached)", unit="linear",
                             leave=False, disable=not progress):
        new = Int8Linear.from_float(linear) if mode == "w8a8" else _choose(linear, mode)
        counts[linear_kind(new)] += 1
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    return counts
