"""specdec: speculative decoding over paged KV caches, lossless by rejection sampling.

    >>> from specdec import Engine, EngineConfig, SamplingParams
    >>> engine = Engine(EngineConfig())                      # the default Qwen2.5-Coder pair
    >>> engine.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))

The names below load on first use (PEP 562), so `import specdec.cache` (or any other part)
does not load the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Engine": "specdec.engine",
    "EngineConfig": "specdec.config",
    "RequestOutput": "specdec.sequence",
    "SamplingParams": "specdec.sampling_params",
    "StepDelta": "specdec.sequence",
    "StructuredSpec": "specdec.sampling_params",
    "TokenOrigin": "specdec.sequence",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from specdec.config import EngineConfig
    from specdec.engine import Engine
    from specdec.sampling_params import SamplingParams, StructuredSpec
    from specdec.sequence import RequestOutput, StepDelta, TokenOrigin


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
