"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 300  # entries in logit_bias (OpenAI's limit)


@dataclass(frozen=True)
class StructuredSpec:
    """What the answer must match (structured output, `specdec.structured`): any JSON object
    (`json_object()`, OpenAI's JSON mode), a JSON schema (`json_schema(schema)`), a regular
    expression (`regex(pattern)`) or an llguidance Lark grammar (`lark(grammar)`, e.g. tool calls:
    `specdec.tool_grammar`). `source` is the schema as JSON text, the pattern or the grammar;
    specs compare equal by it, so an engine compiles each grammar once.

    >>> SamplingParams(structured=StructuredSpec.json_schema({"type": "array", "items": {"type": "integer"}}))
    """

    kind: Literal["json_object", "json_schema", "regex", "lark"]
    source: str = ""

    @classmethod
    def json_object(cls) -> "StructuredSpec":
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str) -> "StructuredSpec":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"the json schema is not JSON: {error}") from error
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a json schema is an object (or a boolean), got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))  # keeps the properties in order

    @classmethod
    def regex(cls, pattern: str) -> "StructuredSpec":
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("a regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> "StructuredSpec":
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError("a lark grammar must be a non-empty string")
        return cls("lark", grammar)


@dataclass
class SamplingParams:
    """How one request samples. `temperature == 0` means greedy.

    The logit controls act on the logits of every row the target verifies and the draft proposes
    from, each with its own prefix, before the temperature (`specdec.verify.controls`):
    `logit_bias` adds to token logits (OpenAI: -100..100); `repetition_penalty` (vLLM/HF, > 0, 1 =
    off) divides positive / multiplies negative logits of every token in the prompt or output;
    `frequency_penalty` / `presence_penalty` (OpenAI, -2..2) subtract `f * count + p * (count > 0)`
    for tokens of the output; `min_tokens` bans EOS and `stop_token_ids` until that many tokens
    are out. Greedy rows take the argmax of the controlled logits. `min_p` (after temperature)
    drops tokens whose probability is below `min_p` times the top token's.

    `structured`: the answer must match this grammar (JSON object / JSON schema / regex); every
    verify and draft row is masked to the tokens the grammar allows after that row's prefix, and
    EOS only where the grammar may end. It cannot be combined with `ignore_eos` or `min_tokens`
    (both keep EOS out where the grammar may force it).

    `logprobs`: None = off; N >= 0 = report each emitted token's log-probability and the N most
    likely alternatives (`specdec.sequence.TokenLogprobs`), from the target's distribution after
    the logit controls and the temperature (1 for greedy rows), before top-k/top-p/min_p.
    `prompt_logprobs` (vLLM's): the same for each prompt token after the first, from the target's
    plain log-softmax (no controls, no temperature), computed in its prefill (the prompt then
    skips the prefix cache: cached blocks kept no logits).

    >>> SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, stop=["\\n\\n"], seed=1)
    """

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0: off
    max_tokens: int = 256
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredSpec | None = None

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
        self._check_controls()

    def _check_controls(self) -> None:
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        self.logit_bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()}
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias.items():
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {token}: {bias}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.structured is not None and (self.ignore_eos or self.min_tokens):
            raise ValueError("structured output cannot be combined with ignore_eos or min_tokens: "
                             "the grammar decides where the answer ends")

    @property
    def has_logit_controls(self) -> bool:
        """Any control that changes logits (the warp's other inputs are temperature/top-k/top-p/min_p)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
