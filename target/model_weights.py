"""Build a `LlamaForCausalLM` from a local HF folder (config.json + *.safetensors)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.target.config import ModelConfig
from specdec.target.model import LlamaForCausalLM
from specdec.target.quant.cache_file import load_quantized, quant_cache_path, save_quantized
from specdec.target.quant.convert import prepare_quantized, quantize_model
from specdec.target.quant.formats import MODES, linear_kind
from specdec.target.quant.smoothing import calibration_text
from specdec.target.runner import ModelRunner, Window
from specdec.target.tokenizer import load_tokenizer

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


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    quant: str = "none",
) -> LlamaForCausalLM:
    """Build the model from a local HF folder; `quant` (see `quant.formats.MODES`) quantizes its linears (CPU).

    A quantized model is cached after the first load (see `quant.cache_file`), so later loads read the
    quantized bytes directly.
    """
    if quant != "none":
        return _load_quantized(Path(model_dir), dtype, device, quant)
    return _load_dense(Path(model_dir), dtype, device)


def _load_quantized(model_dir: Path, dtype: torch.dtype, device, quant: str) -> LlamaForCausalLM:
    if torch.device(device).type != "cpu":
        raise ValueError("the int4 / w8a8 kernels are CPU only; use quantization 'none' on GPU")
    path = quant_cache_path(model_dir, quant, dtype)
    if path.exists():
        with torch.device("meta"):
            model = LlamaForCausalLM(load_config(model_dir))
        model = _finish(load_quantized(model, path), device)
    else:
        # Quantize from fp32: a bf16 copy would knock Q4_K weights off their 4-bit grid.
        model = _load_dense(model_dir, torch.float32, device)
        smooth = quant in MODES and MODES[quant].smooth
        calibrate = calibration_forward(model, _calibration_ids(model_dir)) if smooth else None
        quantize_model(model, quant, calibrate=calibrate)
        _cast_dense(model, dtype)
        save_quantized(model, path)
    prepare_quantized(model)
    return model


def calibration_forward(model: LlamaForCausalLM, token_ids: list[int]) -> Callable[[], None]:
    """One forward of `model` over `token_ids` (as many as its positions allow), every row through
    the LM head: what SmoothQuant measures activations on (`quant.smoothing`)."""

    def forward() -> None:
        ids = token_ids[: model.max_positions]
        block = 16
        runner = ModelRunner.build(model, block, None, num_blocks=(len(ids) + block - 1) // block + 1)
        table = runner.new_table()
        table.ensure_slots(len(ids))
        runner.forward([Window(table, ids, len(ids))])

    return forward


def _calibration_ids(model_dir: Path) -> list[int]:
    """The calibration text in the model's tokens (a folder without a tokenizer: spread ids)."""
    try:
        return load_tokenizer(model_dir).encode(calibration_text())
    except (OSError, ValueError):
        vocab = load_config(model_dir).vocab_size
        return [(i * 7919) % vocab for i in range(512)]


def _cast_dense(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast every parameter outside the quantized linears (they keep their scales and bias)."""
    for module in model.modules():
        if linear_kind(module) != "dense":
            continue
        for name, param in module.named_parameters(recurse=False):
            setattr(module, name, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))


def _load_dense(model_dir: Path, dtype: torch.dtype, device) -> LlamaForCausalLM:
    """Instantiate the model without initialising weights, then fill it from the safetensors files."""
    config = load_config(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors files")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in params:
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    if "rotary_emb" in name:
                        continue
                    raise ValueError(f"unexpected weight {name!r} in {file.name}")
                tensor = f.get_tensor(name).to(device=device, dtype=dtype)
                _assign(model, name, torch.nn.Parameter(tensor, requires_grad=False))
                loaded.add(name)
    missing = set(params) - loaded
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
        model.lm_head.weight = model.model.embed_tokens.weight
    if missing:
        raise ValueError(f"{model_dir} lacks weights: {sorted(missing)[:5]}...")
    return _finish(model, device)


def _finish(model: LlamaForCausalLM, device) -> LlamaForCausalLM:
    """Rebuild the (non-persistent) rope tables on a real device; eval mode."""
    config = model.config
    model.rotary = model.rotary.__class__(config.hf_config, config.head_dim, model.max_positions)
    return model.to(device).eval()


def _assign(model: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, param)
