"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16


@dataclass
class SamplingParams:
    """How one request samples. `temperature == 0` means greedy.

    >>> SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, stop=["\\n\\n"], seed=1)
    """

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # 1.0: off
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive int32, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a non-negative 64-bit integer, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
