"""From an `EngineConfig` to the engine's parts: models, tokenizer and runners with sized KV caches.

The config is a plain value; what depends on the machine (the device of `"auto"`, the
quantization of `None`, which needs to know whether the C kernel builds here) is resolved here,
by `resolve_config`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from specdec.config import EngineConfig
from specdec.target.model_files import resolve_model
from specdec.target.model_weights import load_model, parse_dtype
from specdec.target.quant.qgemm import load_qgemm
from specdec.target.runner import ModelRunner
from specdec.target.tokenizer import load_tokenizer

GIB = 1 << 30


class TokenizerMismatchError(ValueError):
    """Draft and target do not share a tokenizer, so draft tokens mean nothing to the target."""


def resolve_config(config: EngineConfig) -> EngineConfig:
    """`config` with the quantization of each model chosen where it is None.

    On the CPU in bfloat16, where the AVX-512 VNNI kernel runs (`quant.qgemm`, built here once,
    ~2 s), the target takes "w4a8-auto" and the draft "w4a8"; without the kernel "w8a8" and
    "int4+w8a8"; elsewhere "none" (see `EngineConfig.target_quant`).
    """
    if config.target_quant is not None and config.draft_quant is not None:
        return config
    target, draft = "none", "none"
    if config.dtype == "bfloat16" and config.resolved_device() == "cpu":
        kernel = load_qgemm() is not None
        target, draft = ("w4a8-auto", "w4a8") if kernel else ("w8a8", "int4+w8a8")
    return dataclasses.replace(
        config,
        target_quant=target if config.target_quant is None else config.target_quant,
        draft_quant=draft if config.draft_quant is None else config.draft_quant,
    )


def load_engine_parts(config: EngineConfig, log=None) -> tuple[Any, Any, Any]:
    """Resolve and load the target, the draft (when the draft proposer is used) and the tokenizer."""
    config = resolve_config(config)
    dtype, device = parse_dtype(config.dtype), config.resolved_device()
    t0 = time.perf_counter()
    target_dir = resolve_model(config.target)
    tokenizer = load_tokenizer(target_dir)
    target = load_model(target_dir, dtype, device, config.target_quant)
    draft = None
    if config.speculative and config.uses_draft_model:
        draft_dir = resolve_model(config.draft)
        check_same_tokenizer(tokenizer, load_tokenizer(draft_dir), config)
        draft = load_model(draft_dir, dtype, device, config.draft_quant)
        if draft.config.vocab_size != target.config.vocab_size:
            raise TokenizerMismatchError(
                f"draft vocab {draft.config.vocab_size} != target vocab {target.config.vocab_size}"
            )
    if log:
        log(f"loaded models in {time.perf_counter() - t0:.1f}s")
    return target, draft, tokenizer


def check_same_tokenizer(target_tok: Any, draft_tok: Any, config: EngineConfig) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise TokenizerMismatchError(
            f"draft {config.draft!r} and target {config.target!r} use different tokenizers; "
            "speculative decoding needs the same vocabulary (use --proposer ngram, or a draft "
            "from the target's family)"
        )


def build_runners(
    config: EngineConfig, target: torch.nn.Module, draft: torch.nn.Module | None
) -> tuple[ModelRunner, ModelRunner | None]:
    """Size both paged caches so they hold the same number of tokens within the memory budget."""
    uses_draft = config.speculative and config.uses_draft_model
    if uses_draft and draft is None:
        raise ValueError("proposer 'draft' needs a draft model")
    models = [target] + ([draft] if uses_draft else [])
    kv_dtype = torch.float8_e4m3fn if config.kv_dtype == "fp8" else None
    num_blocks = config.num_blocks
    if num_blocks is None:
        per_block = [ModelRunner.kv_spec(m, config.block_size, kv_dtype).bytes_per_block() for m in models]
        num_blocks = max(1, int(config.kv_cache_memory_gib * GIB) // sum(per_block))
    runners = [ModelRunner.build(m, config.block_size, kv_dtype, num_blocks=num_blocks) for m in models]
    return runners[0], (runners[1] if uses_draft else None)

