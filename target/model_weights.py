"""Build a `LlamaForCausalLM` from a local folder (config.json + safetensors or a GGUF link)."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.target.checkpoint_reader import (
    checkpoint_sha256, gguf_paths, is_image_part, layer_index, open_checkpoint, param_sources,
)
from specdec.target.config import ModelConfig
from specdec.target.default_pair import finish_check
from specdec.target.gguf_file import GGUFFile
from specdec.target.model import LlamaForCausalLM
from specdec.target.quant.cache_file import load_quantized, quant_cache_path, save_quantized
from specdec.target.quant.convert import prepare_quantized
from specdec.target.quant import kquant
from specdec.target.quant.formats import MODES, format_of
from specdec.target.quant.qlinear import QLinear, release_freed_memory
from specdec.target.quant.shipped_stats import load_shipped
from specdec.target.quant.smoothing import calibration_text
from specdec.target.quantized_stream import calibration_forward, stream_quantized
from specdec.target.tokenizer import load_tokenizer

__all__ = ["DTYPES", "LoadPart", "calibration_forward", "calibration_ids", "load_config", "load_model", "parse_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_config(model_dir: str | Path) -> ModelConfig:
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(str(model_dir)))


@dataclass(frozen=True)
class LoadPart:
    """The part of a model one process of a split target holds (`specdec.parallel`), taken while
    loading so that the whole model is never held at once: `layers`, the decoder layers kept
    (the others are not read; the model keeps `layers` with `layer_offset` at its start), and
    `cut(i, layer)`, applied to layer i as soon as it is read (a tensor-parallel rank keeps its
    share of it there). Where a path cannot (a first quantization into the cache file, which
    needs the whole model), the model comes out whole and the caller cuts it afterwards."""

    layers: range | None = None
    cut: Callable[[int, torch.nn.Module], None] | None = None

    def keeps(self, i: int) -> bool:
        return self.layers is None or i in self.layers


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    quant: str = "none", part: LoadPart | None = None,
) -> LlamaForCausalLM:
    """Build the model from a local folder; `quant` (see `quant.formats.MODES`) quantizes its linears (CPU).

    A quantized model is built layer by layer from the checkpoint file (`quantized_stream`) and
    cached after the first load (see `quant.cache_file`), so later loads read the quantized bytes
    directly. `part`: only that part of it (`LoadPart`).
    """
    if quant != "none":
        return _load_quantized(Path(model_dir), dtype, device, quant, part)
    return _load_dense(Path(model_dir), dtype, device, part)


def _load_quantized(model_dir: Path, dtype: torch.dtype, device, quant: str, part: LoadPart | None) -> LlamaForCausalLM:
    if torch.device(device).type != "cpu":
        raise ValueError("the int4 / w8a8 kernels are CPU only; use quantization 'none' on GPU")
    path = quant_cache_path(model_dir, quant, dtype)
    if not path.exists():
        model = _quantize_to_cache(model_dir, dtype, quant, path, part)
        if model is not None:  # the file's blocks as stored: nothing worth a cache
            model = _finish(_keep_layers(model, part), device)
            prepare_quantized(model)
            release_freed_memory()
            return model
    with torch.device("meta"):
        model = LlamaForCausalLM(load_config(model_dir))
    model = load_quantized(model, path, lambda: GGUFFile.open(gguf_paths(model_dir)))
    if part is not None:  # the cache's tiles view its mapping: cut before `prepare_quantized` copies them
        model = _keep_layers(model, part)
        _cut_layers(model, part)
    model = _finish(model, device)
    prepare_quantized(model)
    release_freed_memory()  # fusing and packing copied every tile once
    return model


def _keep_layers(model: LlamaForCausalLM, part: LoadPart | None) -> LlamaForCausalLM:
    """The model with only `part.layers` (those the loader left unread go)."""
    if part is None or part.layers is None:
        return model
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[part.layers.start : part.layers.stop])
    model.layer_offset = part.layers.start
    return model


def _cut_layers(model: LlamaForCausalLM, part: LoadPart) -> None:
    if part.cut is not None:
        for i, layer in enumerate(model.model.layers):
            part.cut(model.layer_offset + i, layer)


def _quantize_to_cache(model_dir: Path, dtype: torch.dtype, quant: str, path: Path,
                       part: LoadPart | None = None) -> LlamaForCausalLM | None:
    """Quantize the model into its cache file. The model is then loaded from that file as every
    later load does: the same bytes, and none of the quantization's memory kept (it held the
    quantized model beside the mapped GGUF and the copies that packing makes: 5.8 GB peak for the
    default target, against 3.0 GB for a whole later run).

    Where no linear was re-quantized (mode "gguf" on a GGUF of `kquant.KIND_NAMES`' types only: every one
    repacked as stored, ~2 s for the default target) nothing is cached: the model is returned, and
    every load is a first load."""
    # Quantize from float32 read tensor by tensor: a bf16 copy would knock Q4_K weights off
    # their 4-bit grid, and a whole float32 model would be 4x the packed one.
    start = time.perf_counter()
    shipped = load_shipped(checkpoint_sha256(model_dir)) if MODES[quant].smooth else None
    # `part` only where nothing goes to the cache (the file's blocks as stored): a cache holds the whole model
    streamed_part = part if MODES[quant].file_blocks else None
    model, seconds = stream_quantized(
        model_dir, load_config(model_dir), quant, dtype, lambda: calibration_ids(model_dir), stats=shipped,
        part=streamed_part,
    )
    finish_check(model_dir)  # nothing derived from unchecked bytes is cached
    if MODES[quant].file_blocks and not any(_requantized(m) for m in model.modules() if not _on_meta(m)):
        print(f"specdec: read {model_dir.name}'s quantized blocks as stored ({quant}) in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        return model
    if streamed_part is not None:  # a tensor of a kind read as stored was not: the whole model, for the cache
        del model
        gc.collect()
        model, seconds = stream_quantized(
            model_dir, load_config(model_dir), quant, dtype, lambda: calibration_ids(model_dir), stats=shipped)
    written = time.perf_counter()
    save_quantized(model, path)
    seconds["write"] = time.perf_counter() - written
    phases = ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items() if s)
    if shipped is not None:
        phases += ", calibration statistics shipped"
    print(f"specdec: quantized {model_dir.name} to {quant} in {time.perf_counter() - start:.0f} s "
          f"({phases}); cached in {path.parent}", file=sys.stderr, flush=True)
    del model
    gc.collect()
    release_freed_memory()
    return None


def _requantized(module: torch.nn.Module) -> bool:
    """Whether `module` is a linear whose weights were quantized here (not taken as stored)."""
    if format_of(module) is None:
        return False
    return not (isinstance(module, QLinear) and set(module.tile_bits.unique().tolist()) <= kquant.BLOCK_BYTES.keys())


def calibration_ids(model_dir: Path) -> list[int]:
    """The calibration text in the model's tokens (a folder without a tokenizer: spread ids)."""
    try:
        return load_tokenizer(model_dir).encode(calibration_text())
    except (OSError, ValueError):
        vocab = load_config(model_dir).vocab_size
        return [(i * 7919) % vocab for i in range(512)]


def _on_meta(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters(recurse=False))


def _load_dense(model_dir: Path, dtype: torch.dtype, device, part: LoadPart | None = None) -> LlamaForCausalLM:
    """Instantiate the model without initialising weights, then fill it tensor by tensor from its
    checkpoint (safetensors or GGUF: `checkpoint_reader`); of `part`'s layers only, cut as it says."""
    config = load_config(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    params = dict(model.named_parameters())
    with open_checkpoint(model_dir) as reader:
        sources = param_sources(reader, list(params), config)
        used = set(sources.values())
        unexpected = [n for n in reader.names() if n not in used and "rotary_emb" not in n and not is_image_part(n)
                      and not (n.endswith("lm_head.weight") and config.tie_word_embeddings)]
        if unexpected:
            raise ValueError(f"unexpected weights in {model_dir}: {unexpected[:5]}")
        for name, source in sources.items():
            if part is not None and (i := layer_index(name)) is not None and not part.keeps(i):
                continue
            tensor = reader.read(source).to(device=device, dtype=dtype)
            _assign(model, name, torch.nn.Parameter(tensor, requires_grad=False))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if part is not None:
        _cut_layers(_keep_layers(model, part), part)
    return _finish(model, device)


def _finish(model: LlamaForCausalLM, device) -> LlamaForCausalLM:
    """Rebuild the (non-persistent) rope tables on a real device; eval mode."""
    config = model.config
    model.rotary = model.rotary.__class__(config.hf_config, config.rotary_dim or config.head_dim, model.max_positions)
    return model.to(device).eval()


def _assign(model: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, param)
