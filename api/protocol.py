"""OpenAI response bodies and stream chunks, for chat and text completions.

A stream is: [role chunk (chat only)], one content chunk per engine step that emitted tokens, a
chunk carrying `finish_reason`, a usage chunk (`choices: []`) when `stream_options.include_usage`
is set, then `data: [DONE]`. Each content chunk carries a `specdec` extension field:

    "specdec": {"drafted": 4, "accepted": 2, "origins": ["accepted", "accepted", "recovered"],
                "pieces": ["def", " quick", "sort"]}

`origins[i]` says where the i-th token of this step came from (accepted draft token, the
target's correction, the bonus token after a fully accepted draft, or plain target decoding) and
`pieces[i]` is its text; the pieces join to the chunk's content.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specdec.sequence import StepDelta


@dataclass
class Usage:
    """Token counts as OpenAI reports them; `cached_tokens` are prompt tokens whose KV the target
    found in its prefix cache (`usage.prompt_tokens_details.cached_tokens`)."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def step_extension(delta: StepDelta) -> dict[str, Any]:
    return {
        "drafted": delta.num_drafted,
        "accepted": delta.num_accepted,
        "origins": [origin.value for origin in delta.origins],
        "pieces": list(delta.pieces),
    }


@dataclass
class ResponseFormat:
    """Builds one request's chunks and final body; `ChatFormat` / `CompletionFormat` fill in the shape."""

    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    id_prefix = "cmpl-"
    chunk_object = "text_completion"
    response_object = "text_completion"

    def __post_init__(self) -> None:
        self.id = self.id or f"{self.id_prefix}{uuid.uuid4().hex}"

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    def delta_chunk(self, delta: StepDelta) -> dict[str, Any]:
        chunk = self._chunk([self._choice(delta.text, None)])
        chunk["specdec"] = step_extension(delta)
        return chunk

    def finish_chunk(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk([self._choice(None, finish_reason)])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage.as_dict()
        return chunk

    def response(self, text: str, finish_reason: str, usage: Usage, extension: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id, "object": self.response_object, "created": self.created, "model": self.model,
            "choices": [self._final_choice(text, finish_reason)],
            "usage": usage.as_dict(),
            "specdec": extension,
        }

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                 "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, text: str | None, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    def _final_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


@dataclass
class CompletionFormat(ResponseFormat):
    """POST /v1/completions."""


@dataclass
class ChatFormat(ResponseFormat):
    """POST /v1/chat/completions."""

    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"
    response_object = "chat.completion"

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])]

    def _choice(self, text: str | None, finish_reason: str | None) -> dict[str, Any]:
        delta = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def _final_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}
