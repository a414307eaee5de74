"""OpenAI response bodies and stream chunks, for chat and text completions.

A stream is: [a role chunk per choice (chat), or an echo chunk per choice (completions with
`echo`)], one content chunk per engine step that emitted tokens for a choice, a chunk carrying a
choice's `finish_reason` as soon as it finishes (the chunks of the n choices interleave, each with
its `index`), a usage chunk (`choices: []`) when `stream_options.include_usage` is set, then
`data: [DONE]`. With logprobs asked for, each content chunk carries its own tokens' entries
(`specdec.api.logprobs`). Each content chunk carries a `specdec` extension field:

    "specdec": {"drafted": 4, "accepted": 2, "origins": ["accepted", "accepted", "recovered"],
                "pieces": ["def", " quick", "sort"]}

`origins[i]` says where the i-th token of this step came from (accepted draft token, the
target's correction, the bonus token after a fully accepted draft, or plain target decoding) and
`pieces[i]` is its text; the pieces join to the chunk's content.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specdec.api.errors import APIError, error_body
from specdec.api.logprobs import (
    TokenTexts, chat_logprobs, completion_logprobs, prompt_completion_logprobs, vllm_prompt_logprobs,
)
from specdec.api.answer import AnswerEvent, AnswerParser, ReasoningDelta, whole_answer
from specdec.api.reasoning import split_reasoning
from specdec.api.tool_calls import split_tool_calls, stream_delta
from specdec.sequence import StepDelta, TokenLogprobs


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
class ChoiceOutput:
    """One finished choice of a non-streamed answer."""

    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # [None] + prompt tokens 1..'s, when asked
    stop_string: str | None = None  # the stop string that ended it


@dataclass
class ResponseFormat:
    """Builds one request's chunks and final body; `ChatFormat` / `CompletionFormat` fill in the
    shape. `n` choices, indexed 0..n-1; `token_texts` is set when logprobs were asked for; `echo`
    is the prompt text every completion choice starts with (completions only)."""

    model: str
    include_usage: bool = False
    n: int = 1
    token_texts: TokenTexts | None = None
    echo: str = ""
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0  # set once the prompt is tokenized

    id_prefix = "cmpl-"
    chunk_object = "text_completion"
    response_object = "text_completion"

    def __post_init__(self) -> None:
        self.id = self.id or f"{self.id_prefix}{uuid.uuid4().hex}"
        self._text_offsets = [len(self.echo)] * self.n  # streamed legacy logprobs: where the next token starts

    def first_chunks(self) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        return [self._chunk([self._choice(i, self.echo, None, None)]) for i in range(self.n)]

    def delta_chunks(self, index: int, delta: StepDelta) -> list[dict[str, Any]]:
        chunk = self._chunk([self._choice(index, delta.text, None, self._stream_logprobs(index, delta))])
        chunk["specdec"] = step_extension(delta)
        return [chunk]

    def finish_chunks(self, index: int, finish_reason: str, stop_string: str | None = None) -> list[dict[str, Any]]:
        return [self._chunk([self._choice(index, None, finish_reason, None)])]

    def last_chunks(self, usage: Usage) -> list[dict[str, Any]]:
        """After every choice finished: the usage chunk, when asked for."""
        return [self.usage_chunk(usage)] if self.include_usage else []

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage.as_dict()
        return chunk

    done_marker = True  # the stream ends with `data: [DONE]`

    def sse(self, chunk: dict[str, Any]) -> Any:
        """One chunk as sse-starlette sends it: a `data:` line (OpenAI's chat and completions)."""
        return sse_data(chunk)

    def error_events(self, error: APIError) -> list[Any]:
        """What a stream sends when the engine fails mid-answer."""
        return [{"event": "error", "data": json.dumps(error_body(error.message, error.type, error.param, error.code))},
                "[DONE]"]

    def response(self, choices: list[ChoiceOutput], usage: Usage, extension: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id, "object": self.response_object, "created": self.created, "model": self.model,
            "choices": [self._final_choice(i, choice) for i, choice in enumerate(choices)],
            "usage": usage.as_dict(),
            "specdec": extension,
        }

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                 "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _stream_logprobs(self, index: int, delta: StepDelta) -> dict[str, Any] | None:
        if self.token_texts is None:
            return None
        logprobs = self._logprobs(delta.logprobs or [], self._text_offsets[index])
        self._text_offsets[index] += sum(len(self.token_texts(e.token_id)[0]) for e in delta.logprobs or [])
        return logprobs

    def _logprobs(self, entries: list[TokenLogprobs], text_offset: int) -> dict[str, Any]:
        return completion_logprobs(entries, self.token_texts, text_offset)

    def _choice(self, index: int, text: str | None, finish_reason: str | None,
                logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}

    def _final_logprobs(self, choice: ChoiceOutput) -> dict[str, Any] | None:
        if self.token_texts is None:
            return None
        return self._logprobs(choice.logprobs or [], len(self.echo))

    def _final_choice(self, index: int, choice: ChoiceOutput) -> dict[str, Any]:
        return {"index": index, "text": self.echo + choice.text, "logprobs": self._final_logprobs(choice),
                "finish_reason": choice.finish_reason}


@dataclass
class CompletionFormat(ResponseFormat):
    """POST /v1/completions. `echo_logprobs` (`echo` with `logprobs`): the legacy logprobs start
    with the prompt's tokens (the first one's logprob and alternatives null, as OpenAI's); `vllm_prompt_logprobs`:
    vLLM's `prompt_logprobs` list per choice; `answer_nothing` (`max_tokens` 0): the prompt scored,
    no completion (its one engine token dropped)."""

    echo_logprobs: bool = False
    vllm_prompt_logprobs: bool = False
    answer_nothing: bool = False
    prompt_ids: list[int] = field(default_factory=list)
    prompt_texts: TokenTexts | None = None  # the prompt's tokens spelled, when it is scored

    def response(self, choices: list[ChoiceOutput], usage: Usage, extension: dict[str, Any]) -> dict[str, Any]:
        if self.answer_nothing:
            choices = [ChoiceOutput("", "length", [] if c.logprobs is not None else None, c.prompt_logprobs)
                       for c in choices]
            usage = Usage(usage.prompt_tokens, 0, usage.cached_tokens)
        return super().response(choices, usage, extension)

    def _final_choice(self, index: int, choice: ChoiceOutput) -> dict[str, Any]:
        out = super()._final_choice(index, choice)
        prompt = choice.prompt_logprobs or []
        if self.echo_logprobs and self.prompt_texts is not None and prompt:
            out["logprobs"] = _join_logprobs(prompt_completion_logprobs(self.prompt_ids, prompt, self.prompt_texts),
                                             out["logprobs"])
        if self.vllm_prompt_logprobs:
            out["prompt_logprobs"] = vllm_prompt_logprobs(prompt, self.prompt_texts)
        return out


def sse_data(chunk: dict[str, Any]) -> str:
    return json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))


def _chat_delta(event: AnswerEvent) -> dict[str, Any]:
    return {"reasoning_content": event.text} if isinstance(event, ReasoningDelta) else stream_delta(event)


def _join_logprobs(prompt: dict[str, Any], answer: dict[str, Any] | None) -> dict[str, Any]:
    if not answer:
        return prompt
    return {key: prompt[key] + answer[key] for key in prompt}


@dataclass
class ChatFormat(ResponseFormat):
    """POST /v1/chat/completions. With `parse_reasoning` (a thinking model), each choice's text is
    split by a `ReasoningParser` into `reasoning_content` and `content` (`starts_in_reasoning`:
    the prompt left a `<think>` open); with `parse_tool_calls` (tools offered), the content goes
    through a `ToolCallParser`. Streamed through either, a step's chunk carries the step's first
    delta (reasoning, content or tool call; `{}` while the parsers hold text back) with its logprobs
    and `specdec` field, and its further deltas follow in chunks of their own (the extension's
    `pieces` are then the raw text)."""

    parse_tool_calls: bool = False
    parse_reasoning: bool = False
    starts_in_reasoning: bool = False
    tool_format: str = "hermes"  # the calls' format (`specdec.tool_grammar.CALL_FORMATS`)
    tool_schemas: dict[str, Any] | None = None  # function name -> parameters (Qwen3-Coder's values are read by them)
    harmony: bool = False  # a gpt-oss answer: reasoning, content and calls read from its messages

    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"
    response_object = "chat.completion"

    def __post_init__(self) -> None:
        super().__post_init__()
        parsed = self.parse_tool_calls or self.parse_reasoning or self.harmony
        self._answers = [self.answer_parser() for _ in range(self.n)] if parsed else None

    def answer_parser(self) -> AnswerParser:
        return AnswerParser(self.parse_reasoning, self.starts_in_reasoning, self.parse_tool_calls, self.tool_format,
                            self.tool_schemas, self.harmony)

    def delta_chunks(self, index: int, delta: StepDelta) -> list[dict[str, Any]]:
        if self._answers is None:
            return super().delta_chunks(index, delta)
        deltas = [_chat_delta(event) for event in self._answers[index].feed(delta.text)] or [{}]
        chunks = [self._chunk([self._delta_choice(index, d, None)]) for d in deltas]
        chunks[0]["choices"][0]["logprobs"] = self._stream_logprobs(index, delta)
        chunks[0]["specdec"] = step_extension(delta)
        return chunks

    def finish_chunks(self, index: int, reason: str, stop_string: str | None = None) -> list[dict[str, Any]]:
        if self._answers is None:
            return super().finish_chunks(index, reason)
        answer = self._answers[index]
        chunks = [self._chunk([self._delta_choice(index, _chat_delta(event), None)]) for event in answer.finish()]
        return chunks + super().finish_chunks(index, answer.finish_reason(reason))

    def _delta_choice(self, index: int, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def _final_harmony(self, index: int, choice: ChoiceOutput, message: dict[str, Any]) -> dict[str, Any]:
        """A gpt-oss choice whole: its messages' blocks (`whole_answer`) as the chat message's fields."""
        parser = self.answer_parser()
        blocks = whole_answer(parser, choice.text)
        texts = lambda kind: "".join(b.text for b in blocks if b.kind == kind) or None  # noqa: E731
        message["content"], message["reasoning_content"] = texts("text"), texts("reasoning")
        calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
                 for b in blocks if b.kind == "call"]
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "message": message, "logprobs": self._final_logprobs(choice),
                "finish_reason": parser.finish_reason(choice.finish_reason)}

    def first_chunks(self) -> list[dict[str, Any]]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(self.n)]

    def _logprobs(self, entries: list[TokenLogprobs], text_offset: int) -> dict[str, Any]:
        return chat_logprobs(entries, self.token_texts)

    def _choice(self, index: int, text: str | None, finish_reason: str | None,
                logprobs: dict[str, Any] | None) -> dict[str, Any]:
        delta = {} if text is None else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def _final_choice(self, index: int, choice: ChoiceOutput) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        reason = choice.finish_reason
        if self.harmony:
            return self._final_harmony(index, choice, message)
        if self.parse_reasoning:
            message["reasoning_content"], message["content"] = split_reasoning(choice.text, self.starts_in_reasoning)
        if self.parse_tool_calls:
            message["content"], calls = split_tool_calls(message["content"], self.tool_format, self.tool_schemas)
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "message": message, "logprobs": self._final_logprobs(choice), "finish_reason": reason}
