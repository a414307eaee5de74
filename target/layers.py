"""The pieces every decoder layer variant uses: RMS norms and the linears' fused calls (a
`QLinear` fuses the norm before it and the residual add or GLU after it into its kernel).
`model.py` builds the layers from them; `mla.py`'s latent attention too."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.target.config import ModelConfig


class RMSNorm(nn.Module):
    kernel_fusable = True  # what QLinear's fused norm computes (`normed`)

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as transformers does, then scale in the model dtype.
        x32 = x.float()
        inv_rms = x32.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        x32 = x32 * inv_rms if x32 is x else x32.mul_(inv_rms)  # x.float() made a copy: reuse it
        return self.weight * x32.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by `1 + weight` in fp32, then casts (Llama casts, then scales)."""

    kernel_fusable = False

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(config: ModelConfig, size: int) -> RMSNorm:
    offset = config.gemma_norms or config.offset_norms
    return GemmaRMSNorm(size, config.rms_norm_eps) if offset else RMSNorm(size, config.rms_norm_eps)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def normed(norm: RMSNorm | None, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`linear(norm(x))`; one call where the linear fuses the norm into its kernel
    (`fuses_rmsnorm`: `QLinear`), saving the norm's eight ops per call."""
    if norm is None:
        return linear(x)
    if getattr(linear, "fuses_rmsnorm", False) and norm.kernel_fusable and norm.weight.dtype in (torch.bfloat16, torch.float32):
        return linear(x, norm.weight, norm.eps)
    return linear(norm(x))


def plus_linear(
    residual: torch.Tensor | None, linear: nn.Module, x: torch.Tensor, glu: bool = False
) -> torch.Tensor:
    """`residual + linear(x)` (None: no residual), or with `glu` of `silu(gate) * up` where `x` is
    `gate | up`; one call where the linear fuses both into its kernel (`fuses_epilogue`: `QLinear`)."""
    if getattr(linear, "fuses_epilogue", False):
        return linear(x, residual=residual, glu=glu)
    if glu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    return linear(x) if residual is None else residual + linear(x)
