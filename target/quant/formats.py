"""The registry of quantized linear formats and of the modes that produce them.

A format is what a cache file's manifest names a linear (`int4`, `int8`, `qlinear`): its module
class, how parts fuse into one module (q/k/v, gate/up) and which tensors a cache file stores for
it. A mode (`EngineConfig.target_quant`) is one way of converting an `nn.Linear` into a format.

    >>> MODES["w4a8-auto"].format.name
    'qlinear'
    >>> sorted(MODES) == sorted(m for m in QUANT_MODES if m != "none")
    True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specdec.target.quant.int4 import AUTO_INT4_MAX_ERROR, Int4Linear, fuse_int4, int4_from_linear
from specdec.target.quant.int8 import Int8Linear, fuse_int8
from specdec.target.quant.modes import QUANT_MODES
from specdec.target.quant.qlinear import QLinear, fuse_qlinear


@dataclass(frozen=True)
class LinearFormat:
    """One quantized linear format; `module.from_state(tensors, in_features, bias)` rebuilds it."""

    name: str  # the cache manifest's word for it
    module: type[nn.Module]
    fuse: Callable[[list[nn.Module]], nn.Module | None]  # None unless every part is this format
    state_keys: tuple[str, ...]  # the tensors a cache file holds per linear, besides the bias

    def from_state(
        self, tensors: dict[str, torch.Tensor | None], in_features: int, bias: torch.Tensor | None
    ) -> nn.Module:
        return self.module.from_state(tensors, in_features, bias)


INT4 = LinearFormat("int4", Int4Linear, fuse_int4, ("weight_int4", "scales_and_zeros", "weight_int8", "int8_scale"))
INT8 = LinearFormat("int8", Int8Linear, fuse_int8, ("weight_int8", "weight_scale"))
QLINEAR = LinearFormat("qlinear", QLinear, fuse_qlinear, ("tiles", "tile_offsets", "tile_bits"))
FORMATS = {f.name: f for f in (INT4, INT8, QLINEAR)}


@dataclass(frozen=True)
class QuantMode:
    """A quantization mode: which format it makes and how from one `nn.Linear` (`from_linear`
    returns the linear itself where the format does not fit it)."""

    name: str
    format: LinearFormat
    from_linear: Callable[[nn.Linear], nn.Module]
    smooth: bool = False  # SmoothQuant the model on calibration activations first
    needs_kernel: bool = False  # runs only where `qgemm` does
    file_blocks: bool = False  # a GGUF's tensors of `kquant.KIND_NAMES`' types become tiles as stored (`kquant`)


MODES = {m.name: m for m in (
    QuantMode("int4", INT4, int4_from_linear),
    QuantMode("auto", INT4, functools.partial(int4_from_linear, max_error=AUTO_INT4_MAX_ERROR)),
    QuantMode("int4+w8a8", INT4, functools.partial(int4_from_linear, int8_copy=True)),
    QuantMode("w8a8", INT8, Int8Linear.from_float, smooth=True),
    QuantMode("w4a8", QLINEAR, functools.partial(QLinear.from_linear, int4_max_error=math.inf), needs_kernel=True),
    QuantMode("w4a8-auto", QLINEAR, functools.partial(QLinear.from_linear, int4_max_error=AUTO_INT4_MAX_ERROR),
              needs_kernel=True),
    # the file's own blocks (`kquant.KIND_NAMES`: Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS, Q4_0, Q4_1, Q5_0,
    # IQ4_NL, MXFP4, Q8_0, F16, BF16), no re-quantization; "w4a8-auto" for every other tensor
    QuantMode("gguf", QLINEAR, functools.partial(QLinear.from_linear, int4_max_error=AUTO_INT4_MAX_ERROR),
              needs_kernel=True, file_blocks=True),
)}


def format_of(module: nn.Module) -> LinearFormat | None:
    """The format of a quantized linear; None for anything else (dense)."""
    return next((f for f in FORMATS.values() if type(module) is f.module), None)


def linear_kind(module: nn.Module) -> str:
    """The quantized format of a linear, as counted and cached: int4, int8, qlinear or dense."""
    fmt = format_of(module)
    return "dense" if fmt is None else fmt.name
