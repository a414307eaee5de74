"""Rotary position embeddings, with the scaling variants transformers defines (llama3, yarn, ...)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


LAYER_TYPES = ("full_attention", "sliding_attention")  # Gemma 3 keys rope parameters by layer type


def layer_typed(hf_config: Any) -> bool:
    """Whether the config names rope parameters per layer type (Gemma 3: local and global)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return bool(set(params) & set(LAYER_TYPES))


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict:
    """The rope dict of a config from transformers 5 (`rope_parameters`) or 4 (`rope_scaling`);
    `layer_type` picks one of a layer-typed config's dicts."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inv_frequencies(hf_config: Any, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """`(inv_freq [D/2], attention_scaling)` for the rope type the config names (for `layer_type`'s
    layers where the config is layer-typed)."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = float(params.get("rope_theta", 10000.0))
        # on the CPU also under the loader's meta device (where arange imports torch._dynamo: ~2 s)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
        return (1.0 / base**exponents).float(), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"rope type {rope_type!r} is not supported")
    typed = {} if layer_type is None else {"layer_type": layer_type}
    with torch.device("cpu"):  # also under the loader's meta device: these read their own tensors
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **typed)
    return inv_freq.float(), float(scaling)


def _tables(inv_freq: torch.Tensor, scaling: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cos [P, D], signed_sin [P, D])` fp32 for positions 0..P-1."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(positions, inv_freq)  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    # sin with its first half negated: rotate_half(x) * sin == swap_halves(x) * signed_sin
    signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1) * scaling
    return emb.cos() * scaling, signed


def _ambient(tables: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The tables (computed on the CPU) on the device modules are built on now (`with
    torch.device("cuda")`); under the loader's meta device they stay on the CPU, real."""
    device = torch.get_default_device()
    return tables if device.type in ("cpu", "meta") else tuple(t.to(device) for t in tables)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (neox / rotate-half layout); a
    layer-typed config (Gemma 3) also gets the sliding layers' tables (`local_rotation`)."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        typed = layer_typed(hf_config)
        cos, signed_sin = _ambient(_tables(*inv_frequencies(hf_config, head_dim, "full_attention" if typed else None),
                                           max_positions))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("signed_sin", signed_sin, persistent=False)
        local = (_ambient(_tables(*inv_frequencies(hf_config, head_dim, "sliding_attention"), max_positions)) if typed
                 else (None, None))
        self.register_buffer("local_cos", local[0], persistent=False)
        self.register_buffer("local_signed_sin", local[1], persistent=False)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        """Follow `.to(device)` but keep the tables fp32 under `.to(dtype)` / `.bfloat16()`: the C
        attention reads them as fp32, and the torch path casts the gathered rows itself."""
        tables = {name: t for name, t in self._buffers.items() if t is not None}
        super()._apply(fn, recurse)
        for name, t in tables.items():
            if self._buffers[name].dtype != t.dtype:
                self._buffers[name] = t.to(self._buffers[name].device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> "Rotation":
        """The rotation of the tokens at `positions [T]`, for a model computing in `dtype`."""
        return Rotation(positions, self.cos, self.signed_sin, dtype)

    def local_rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation | None:
        """As `forward`, with the sliding layers' parameters; None unless the config has them."""
        if self.local_cos is None:
            return None
        return Rotation(positions, self.local_cos, self.local_signed_sin, dtype)


@dataclass
class Rotation:
    """One step's rotary angles: the fp32 tables and the positions indexing them, for kernels that
    rotate by position themselves, and (`cos_sin`) the rows gathered in the model dtype."""

    positions: torch.Tensor  # [T] int64
    cos_table: torch.Tensor  # [P, D] fp32
    signed_sin_table: torch.Tensor  # [P, D] fp32
    dtype: torch.dtype

    @functools.cached_property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos [T, 1, D], signed_sin [T, 1, D])` in `dtype`, for `apply_rope`."""
        cos = self.cos_table[self.positions].to(self.dtype).unsqueeze(1)
        signed_sin = self.signed_sin_table[self.positions].to(self.dtype).unsqueeze(1)
        return cos, signed_sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, H, D]` by the per-token angles (neox layout: `x * cos + rotate_half(x) * sin`);
    tables narrower than D (`[.., R]`: partial rotary) turn the first R dims and pass the rest.

    `rotate_half(x) = [-x2, x1]`; with the sign folded into `signed_sin = [-sin, sin]` it is a
    swap of the halves, one `flip` over a `[.., 2, D/2]` view: bitwise the same result. `x` may be
    a strided view (the q|k part of a fused projection).
    """
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:  # partial rotary (Phi-4-mini, GLM): only the first `rotary` dims turn
        return torch.cat([apply_rope(x[..., :rotary], cos, signed_sin), x[..., rotary:]], dim=-1)
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # [x2, x1]
    return x * cos + swapped * signed_sin


def pairs_to_halves(x: torch.Tensor, rotary: int) -> torch.Tensor:
    """`x [.., D]` with its first `rotary` dims reordered from pairs `(x0, x1), (x2, x3), ...` (the
    order GLM-4 and GPT-J turn) to halves `(x0, x2, ..) | (x1, x3, ..)` (neox's, which `apply_rope`
    turns): the same rotation, of dims permuted alike in q and k, so attention scores are unchanged."""
    head, rest = x[..., :rotary], x[..., rotary:]
    return torch.cat([head[..., 0::2], head[..., 1::2], rest], dim=-1)


def partial_rotary_factor(hf_config: Any) -> float:
    """The share of each head that rope turns (1.0: all of it; Phi-4-mini 0.75)."""
    params = rope_parameters(hf_config, "full_attention" if layer_typed(hf_config) else None)
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    return 1.0 if factor is None else float(factor)


def llama3_rope_from_factors(factors: Any, rope_theta: float, head_dim: int) -> dict:
    """Llama 3.1+'s `rope_parameters` from the per-frequency divisors a GGUF stores in its
    `rope_freqs.weight` tensor (llama.cpp's converter writes the scaling there, not in metadata).

    llama3 scaling leaves short wavelengths alone (divisor 1), divides long ones by `factor`, and
    between them blends with `smooth = (original / wavelength - low) / (high - low)`. The divisors
    fix `factor` (their largest) and the two boundaries, so any one of (original, low, high) is
    free: low is taken as 1, Llama 3.x's own. Raises ValueError where the divisors are not of
    that form (no other scaling rewrites them back to the file's values).
    """
    import math

    factors = torch.as_tensor(factors, dtype=torch.float64).flatten()
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if factors.numel() != inv_freq.numel():
        raise ValueError(f"rope_freqs holds {factors.numel()} factors; a head of {head_dim} has {inv_freq.numel()} frequencies")
    factor = float(factors.max())
    wavelen = 2 * math.pi / inv_freq
    params = {"rope_type": "llama3", "rope_theta": float(rope_theta), "factor": factor, "low_freq_factor": 1.0}
    if factor <= 1.0:
        raise ValueError(f"rope_freqs does not scale (largest factor {factor})")
    # smooth_i from each blended divisor: 1 / f = (1 - smooth) / factor + smooth
    blended = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    if int(blended.sum()) >= 2:  # smooth = a / wavelength + b: a = original / (high - low), b = -low / (high - low)
        x, y = 1 / wavelen[blended], smooth[blended]
        a = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
        b = float(y.mean() - a * x.mean())
        span = -1 / b if b < 0 else 3.0
        original, high = a * span, 1.0 + span
    else:  # too few blended frequencies to fit: Llama 3's high = 4, the original context inside the gap
        high = 4.0
        if int(blended.sum()) == 1:
            original = float(wavelen[blended][0] * (3 * smooth[blended][0] + 1))
        else:
            longest_kept = float(wavelen[factors <= 1 + 1e-6].max(initial=0.0) if (factors <= 1 + 1e-6).any() else 0.0)
            shortest_scaled = float(wavelen[factors >= factor * (1 - 1e-6)].min())
            original = math.sqrt(max(longest_kept * high, 1.0) * shortest_scaled)
    if abs(original - round(original)) < 1e-3 * max(1.0, original):
        original = round(original)
    params.update(high_freq_factor=round(high, 6), original_max_position_embeddings=original)
    if not torch.allclose(_llama3_divisors(params, wavelen), factors, rtol=1e-4, atol=1e-6):
        raise ValueError("rope_freqs is not llama3 scaling (its factors fit no factor / low / high / original context)")
    return params


def _llama3_divisors(params: dict, wavelen: torch.Tensor) -> torch.Tensor:
    """What llama.cpp's converter writes to rope_freqs for llama3 `params` (its formula)."""
    original, low, high, factor = (params["original_max_position_embeddings"], params["low_freq_factor"],
                                   params["high_freq_factor"], params["factor"])
    smooth = (original / wavelen - low) / (high - low)
    out = 1 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen < original / high, torch.ones_like(out), out)
    return torch.where(wavelen > original / low, torch.full_like(out, factor), out)
