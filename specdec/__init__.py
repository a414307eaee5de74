"""specdec: speculative decoding over paged KV caches, lossless by rejection sampling.

    >>> from specdec import Engine, EngineConfig, SamplingParams
    >>> engine = Engine(EngineConfig())                      # the default Qwen2.5-Coder pair
    >>> engine.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))
"""

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams
from specdec.sequence import RequestOutput, StepDelta, TokenOrigin

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams", "StepDelta", "TokenOrigin"]
