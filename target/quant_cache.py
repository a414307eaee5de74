"""Quantize a model once and keep the result, so a warm load reads ~1/4 of the fp32 bytes.

The cache file holds the whole state dict after quantization (int4 buffers, the bf16
embedding and norms) plus a manifest of which linear became what; it is keyed on the model
folder's path and the modification times of its weight files.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdec.target.model import LlamaForCausalLM
from specdec.target.qlinear import QLinear
from specdec.target.quant import Int4Linear, Int8Linear, linear_kind

FORMAT_VERSION = "2"  # bump when quantization changes, so stale caches are not reused


def quant_cache_path(model_dir: Path, mode: str, dtype: torch.dtype) -> Path:
    from specdec.target.default_pair import cache_dir

    files = sorted(Path(model_dir).glob("*.safetensors"))
    recipe = mode
    if mode == "w8a8":  # the smoothing depends on the calibration text and alpha
        from specdec.target.smoothing import signature

        recipe = f"{mode}:{signature()}"
    key = "|".join([FORMAT_VERSION, str(Path(model_dir).resolve()), recipe, str(dtype)]
                   + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "quantized" / f"{Path(model_dir).name}-{mode}-{digest}.safetensors"


def save_quantized(model: LlamaForCausalLM, path: Path) -> None:
    """Write the model's state dict and quantization manifest atomically."""
    manifest = {name: kind for name, m in model.named_modules() if (kind := linear_kind(m)) != "dense"}
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("rotary.")}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(state, tmp, metadata={"manifest": json.dumps(manifest)})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_quantized(model: LlamaForCausalLM, path: Path) -> LlamaForCausalLM:
    """Fill a (meta-device) model from a cache file written by `save_quantized`."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        manifest = json.loads(f.metadata()["manifest"])
        state = {k: f.get_tensor(k) for k in f.keys()}
    for name, kind in manifest.items():
        bias = state.pop(f"{name}.bias", None)
        if kind == "int8":
            module = Int8Linear(state.pop(f"{name}.weight_int8"), state.pop(f"{name}.weight_scale"), bias)
        elif kind == "qlinear":
            module = QLinear(
                state.pop(f"{name}.tiles"), state.pop(f"{name}.tile_offsets"), state.pop(f"{name}.tile_bits"),
                model.get_submodule(name).in_features, bias,
            )
        else:
            sz = state.pop(f"{name}.scales_and_zeros")
            packed = state.pop(f"{name}.weight_int4")
            in_features = model.get_submodule(name).in_features
            module = Int4Linear(
                packed, sz, bias, in_features, in_features // sz.shape[0],
                state.pop(f"{name}.weight_int8", None), state.pop(f"{name}.int8_scale", None),
            )
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, module)
    for name, tensor in state.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, torch.nn.Parameter(tensor, requires_grad=False))
    return model
