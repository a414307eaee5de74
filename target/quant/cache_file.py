"""Quantize a model once and keep the result, so a warm load reads ~1/4 of the fp32 bytes.

The cache file holds the whole state dict after quantization (the formats' tensors, the bf16
embedding and norms) plus a manifest of which linear became which format (`formats.FORMATS`) and
of the modules left in the GGUF file (an embedding read in place: `GGUFEmbedding`, which the
loader maps from the model folder's GGUF again); it
is keyed on the model folder's path, the sizes and modification times of its weight files
(safetensors, the GGUF file a folder links to, or the default pair's parts manifest), the mode and dtype, and the text of the sources
that define the stored layout (`layout_key`), as the kernel builds are (`specdec.native`): a
layout change cannot hand the kernel a stale file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from specdec.paths import cache_dir
from specdec.target.gguf_embedding import GGUFEmbedding
from specdec.target.gguf_file import GGUFFile
from specdec.target.quant.formats import FORMATS, linear_kind

# What a cache file holds and how the kernel reads it: the converters, packers and fusers, the
# smoothing and its calibration text, this file's manifest, and the kernel that reads the tiles.
LAYOUT_SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("int4.py", "int8.py", "qlinear.py", "kquant.py", "formats.py", "convert.py", "smoothing.py",
                 "calibration.txt", "cache_file.py", "qgemm.c")
) + (Path(__file__).parent.parent / "gguf_embedding.py",)


@functools.cache
def layout_key(sources: tuple[Path, ...] = LAYOUT_SOURCES) -> str:
    """A hash of the layout's sources and of torch's version (its int4 packing is torch's own)."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sources:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def quant_cache_path(model_dir: Path, mode: str, dtype: torch.dtype) -> Path:
    # A GGUF folder's `model.gguf` is a link: stat() follows it to the file's size and mtime; the
    # default pair's `model.gguf.parts` is rewritten whenever its parts change.
    files = (sorted(Path(model_dir).glob("*.safetensors")) + sorted(Path(model_dir).glob("*.gguf"))
             + sorted(Path(model_dir).glob("*.gguf.parts")))
    key = "|".join([layout_key(), str(Path(model_dir).resolve()), mode, str(dtype)]
                   + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    dtype_name = str(dtype).removeprefix("torch.")
    return cache_dir() / "quantized" / f"{Path(model_dir).name}-{mode}-{dtype_name}-{digest}.safetensors"


def stale_siblings(path: Path) -> list[Path]:
    """The other cache files of `path`'s model, mode and dtype: written from an older layout or an
    older copy of the weights. Each is as large as the quantized model and nothing reads it again."""
    stem = path.name.rsplit("-", 1)[0]
    legacy = stem.rsplit("-", 1)[0]  # names before the dtype was in them: model-mode-digest
    pattern = re.compile(f"({re.escape(stem)}|{re.escape(legacy)})" + r"-[0-9a-f]{16}\.safetensors")
    return [p for p in path.parent.glob("*.safetensors") if p != path and pattern.fullmatch(p.name)]


def save_quantized(model: nn.Module, path: Path) -> None:
    """Write the model's state dict and quantization manifest (and `model.load_notices`, the load's
    lines on what was re-quantized) atomically, then delete the file it replaces
    (`stale_siblings`): without that, every layout change left gigabytes behind."""
    manifest = {name: kind for name, m in model.named_modules() if (kind := linear_kind(m)) != "dense"}
    in_gguf = {name: [m.gguf_name, str(m.dtype).removeprefix("torch.")]
               for name, m in model.named_modules() if isinstance(m, GGUFEmbedding)}
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("rotary.")}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        # one metadata entry: safetensors writes several in no fixed order, and the bytes of a
        # cache file are meant to be reproducible
        described = {"linears": manifest, "in_gguf": in_gguf, "notices": list(getattr(model, "load_notices", ()))}
        save_file(state, tmp, metadata={"manifest": json.dumps(described)})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for stale in stale_siblings(path):
        stale.unlink(missing_ok=True)


def load_quantized(model: nn.Module, path: Path, gguf: Callable[[], GGUFFile] | None = None) -> nn.Module:
    """Fill a (meta-device) model from a cache file written by `save_quantized`; `gguf()` opens
    the model's GGUF file where the cache left modules in it. The notices the first load printed
    (`model.load_notices`: which GGUF types were re-quantized) are printed again."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        described = json.loads(f.metadata()["manifest"])
        manifest, in_gguf = described["linears"], described["in_gguf"]
        for line in described.get("notices", ()):  # what the first load said of the file (mode gguf)
            print(f"specdec: {line}", file=sys.stderr, flush=True)
        # Tensors read from the file view its mapping, which lives as long as any of them does.
        # Tiles are copied into the model's arena (`prepare_quantized`); everything else is
        # copied here, so the mapping, and the ~1.3 GB of the target's file pages it keeps
        # resident, ends with the tiles' move.
        state = {k: f.get_tensor(k) if k.endswith(".tiles") else f.get_tensor(k).clone() for k in f.keys()}
    if in_gguf:
        if gguf is None:
            raise ValueError(f"{path} reads its embedding from the model's GGUF file, which was not given")
        mapped = gguf()
        for name, (gguf_name, dtype) in in_gguf.items():
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, GGUFEmbedding(mapped, gguf_name, getattr(torch, dtype)))
    for name, kind in manifest.items():
        fmt = FORMATS[kind]
        tensors = {key: state.pop(f"{name}.{key}", None) for key in fmt.state_keys}
        bias = state.pop(f"{name}.bias", None)
        module = fmt.from_state(tensors, model.get_submodule(name).in_features, bias)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, module)
    for name, tensor in state.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, torch.nn.Parameter(tensor, requires_grad=False))
    return model
