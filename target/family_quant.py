"""The quantization a model family takes: `engine_parts.resolve_config` asks here before loading.

The quantized path folds SmoothQuant into Llama's norms and separate q/k/v projections
(`quant.smoothing`), so families whose layers differ there (Gemma's `1 + w` norms and its
post-norms, Phi-3's fused projections) run unquantized unless a mode is asked for, and never
with a smoothing mode. Qwen3, Llama 3.x and windowed Mistral keep the defaults.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from specdec.target.config import ModelConfig
from specdec.target.quant.formats import MODES

log = logging.getLogger("specdec")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def family_quant(spec: str, default: str, chosen: str | None) -> str:
    """`chosen`, else `default`, for the model `spec` names; "none" instead of `default` (logged)
    for a family the quantized path does not implement. `ValueError` for a chosen mode that
    smooths such a family."""
    config = peek_config(spec)
    reason = None if config is None else config.unquantized_reason()
    if reason is None:
        return default if chosen is None else chosen
    if chosen is None:
        if default != "none":
            log.info("%s runs unquantized (quantization 'none', not %r): %s", spec, default, reason)
        return "none"
    if chosen in MODES and MODES[chosen].smooth:
        raise ValueError(f"quantization {chosen!r} smooths Llama-style layers and cannot run {spec}: {reason}; "
                         "choose 'none', 'int4' or 'auto'")
    return chosen


def peek_config(spec: str) -> ModelConfig | None:
    """The config of a local HF folder or a hub id, without its weights; None for anything else
    (the embedded pair, GGUF files) or where it cannot be read (the loader reports that)."""
    from transformers import AutoConfig

    path = Path(spec).expanduser()
    if not (path / "config.json").is_file() and (path.exists() or not _HUB_ID.fullmatch(spec)):
        return None
    try:
        return ModelConfig.from_hf(AutoConfig.from_pretrained(str(path) if path.is_dir() else spec))
    except (OSError, ValueError):
        return None
