"""Convert a model's linears in place (`quantize_model`), and ready them to run (`prepare_quantized`).

Both walk the format registry (`formats`): the model knows nothing of the formats, only that a
module may offer `fuse_projections` and the `fuses_rmsnorm` / `fuses_epilogue` flags.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from tqdm.auto import tqdm

from specdec.target.quant.formats import FORMATS, MODES, linear_kind
from specdec.target.quant.int8 import Int8Linear
from specdec.target.quant.modes import QUANT_MODES
from specdec.target.quant.qgemm import require_qgemm
from specdec.target.quant.qlinear import QLinear, pack_tiles
from specdec.target.quant.smoothing import smooth_model


def quantize_model(
    model: nn.Module, mode: str, progress: bool = True, calibrate: Callable[[], None] | None = None
) -> dict[str, int]:
    """Replace projections and the LM head by quantized linears in place; returns how many of each.

    The embedding stays as it is (a lookup reads one row per token). CPU only. A mode that smooths
    (`"w8a8"`) first folds SmoothQuant into the model from the activations `calibrate()` runs
    through it (the loader's forward over the calibration text; None: no smoothing).
    """
    if mode not in QUANT_MODES:
        raise ValueError(f"quantization must be one of {QUANT_MODES}, got {mode!r}")
    counts = {**{name: 0 for name in FORMATS}, "dense": 0}
    if mode == "none":
        return counts
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("the quantized kernels are CPU only; use quantization 'none' on GPU")
    quant = MODES[mode]
    if quant.needs_kernel:
        require_qgemm()  # fail before quantizing, with the reason
    untie_lm_head(model)
    if quant.smooth:
        smooth_model(model, calibrate)
    return quantize_linears(model, mode, progress=progress)


def untie_lm_head(model: nn.Module) -> None:
    """Give the LM head its own weight where it shares the embedding's: the head is quantized (and
    smoothed), the embedding stays a dense lookup."""
    if getattr(model, "lm_head", None) is not None and model.lm_head.weight is model.model.embed_tokens.weight:
        weight = model.model.embed_tokens.weight
        model.lm_head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False,
                                  device=weight.device)
        model.lm_head.weight = nn.Parameter(weight.detach().clone(), False)


def quantize_linears(
    model: nn.Module, mode: str, prefix: str = "", progress: bool = False
) -> dict[str, int]:
    """Replace the `nn.Linear`s of `model` under `prefix` (a module name; "": all) by `mode`'s
    format in place; returns how many linears took each format. One decoder layer at a time is
    how the streaming loader (`target.quantized_stream`) calls it."""
    quant = MODES[mode]
    counts = {**{name: 0 for name in FORMATS}, "dense": 0}
    targets = [(n, m) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and not getattr(m, "keep_dense", False)  # an MoE router
               and (not prefix or n == prefix or n.startswith(prefix + "."))]
    for name, linear in tqdm(targets, desc=f"quantizing to {mode} (once; cached)", unit="linear",
                             leave=False, disable=not progress):
        new = quant.from_linear(linear)
        counts[linear_kind(new)] += 1
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    return counts


def prepare_quantized(model: nn.Module) -> None:
    """Fuse q/k/v and gate/up where a format's `fuse` can: fewer, larger GEMMs, ~85 fewer calls
    per forward for a 28-layer model. Move `QLinear` tiles into one arena on huge pages. Then pack
    every `Int8Linear` for fbgemm now (two threads: packing is ~60 ms per 14M weights)."""
    for module in model.modules():
        fuse = getattr(module, "fuse_projections", None)
        if fuse is not None:
            for fmt in FORMATS.values():
                fuse(fmt.fuse)
    pack_tiles([m for m in model.modules() if isinstance(m, QLinear)])
    modules = [m for m in model.modules() if isinstance(m, Int8Linear) and m._packed is None]
    with ThreadPoolExecutor(max_workers=max(1, min(2, torch.get_num_threads()))) as pool:
        list(pool.map(Int8Linear.prepack, modules))
