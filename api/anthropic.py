"""POST /v1/messages: Anthropic's Messages API on the same engine, for clients written against it
(the `anthropic` SDK, agents that speak only it).

A request is translated into a chat request (`to_chat`) and answered by the chat path, so the
chat template, tools (constrained calls, `specdec.api.tools`), reasoning, the prefix cache and
speculation all work as for /v1/chat/completions; only the shapes differ:

- `system` (text or text blocks) leads as a system message; a user message's `tool_result`
  blocks become `tool` messages (their text; `is_error` prefixes "Error: "), its text blocks the
  user's text; an assistant message's `tool_use` blocks its `tool_calls`, `thinking` its
  `reasoning_content`. Image and document blocks: 400 naming them. `cache_control` anywhere: no
  effect (prompt prefixes are cached on their own).
- `tools` (`name`, `description`, `input_schema`) are functions; server tools (`type` other than
  `custom`): 400. `tool_choice`: `auto`, `any` (= required), `tool` (that one), `none`;
  `disable_parallel_tool_use`: one call.
- `thinking`: `{"type": "enabled"}` / `{"type": "disabled"}` sets the template's
  `enable_thinking` where it has one (Qwen3); a template without the switch accepts the type the
  model already does (a thinking model: enabled) and refuses the other by name; `adaptive` and
  `between_tools` leave the model as it is. `budget_tokens` is not enforced (`max_tokens` bounds
  reasoning and answer together). `output_config.format` (`json_schema`) constrains the answer as
  `response_format` does; `output_config.effort` reaches a template that reads `reasoning_effort`
  (else 400 naming it). `temperature`, `top_p`, `top_k` (dropped from the 2026 SDK, sent by
  others) are honoured.
- The answer: `content` blocks `thinking` / `text` / `tool_use` (ids `toolu_...`), `stop_reason`
  `end_turn` / `max_tokens` / `stop_sequence` (with `stop_sequence`) / `tool_use`, `usage` with
  `cache_read_input_tokens` (prompt tokens the prefix cache held; `input_tokens` are the others).
  Streamed as Anthropic streams: `message_start`, per block `content_block_start`,
  `content_block_delta` (`text_delta`, `thinking_delta`, `input_json_delta`),
  `content_block_stop`, then `message_delta` and `message_stop`, each an SSE event of its type.
- Errors have Anthropic's body `{"type": "error", "error": {"type", "message"}}`
  (`specdec.api.errors`); the API key may come as `x-api-key`.

POST /v1/messages/count_tokens answers `{"input_tokens": N}` for the same body (the prompt as
the chat template renders it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from specdec.api.answer import Block, BlockEvent, Blocks, whole_answer
from specdec.api.completions import answer_chat, chat_request
from specdec.api.errors import APIError, anthropic_error_body
from specdec.api.protocol import ChatFormat, ChoiceOutput, Usage, sse_data
from specdec.api.reasoning import parses_reasoning
from specdec.api.schemas import ERROR_RESPONSES, ChatCompletionRequest, RequestBody
from specdec.api.state import server_state
from specdec.sequence import StepDelta

router = APIRouter()
_FLOAT = dict(allow_inf_nan=False)


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(RequestBody):
    """POST /v1/messages (and /v1/messages/count_tokens, which needs no `max_tokens`)."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0.0, le=1.0, **_FLOAT)
    top_p: float | None = Field(None, gt=0.0, le=1.0, **_FLOAT)
    top_k: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM's extension, as on chat
    # no effect on the answer
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None  # prompt prefixes are cached on their own
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    diagnostics: dict[str, Any] | None = None


@router.post("/v1/messages", tags=["anthropic"], responses=ERROR_RESPONSES)
async def messages(body: MessagesRequest, request: Request) -> Any:
    state = server_state(request)
    state.screen_fields(request, body)
    if body.max_tokens is None:
        raise APIError(400, "max_tokens: Field required", "max_tokens", "invalid_value")
    chat, variables = to_chat(body, state.chat_template, _thinks(state))
    return await answer_chat(request, state, chat, variables, MessagesFormat)


@router.post("/v1/messages/count_tokens", tags=["anthropic"], responses=ERROR_RESPONSES)
async def count_tokens(body: MessagesRequest, request: Request) -> dict[str, int]:
    state = server_state(request)
    state.screen_fields(request, body)
    state.check_model(body.model)
    chat, variables = to_chat(body, state.chat_template, _thinks(state))
    ids = state.chat_prompt_ids([m.as_template_dict() for m in chat.messages], tools=chat.tool_use.template_tools(),
                                variables=variables)
    return {"input_tokens": len(ids)}


def _thinks(state: Any) -> bool:
    return parses_reasoning(state.settings.reasoning_parser, state.tokenizer)


def to_chat(body: MessagesRequest, template: str, thinks: bool) -> tuple[ChatCompletionRequest, list]:
    """The chat request of a Messages request, and its chat template variables."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system, "system")})
    for i, message in enumerate(body.messages):
        messages += _chat_messages(message, f"messages.{i}.content")
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_tokens": body.max_tokens, "stream": body.stream,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "stop": body.stop_sequences,
        "cache_salt": body.cache_salt,
    }
    if body.tools:
        chat["tools"] = [_function(tool, f"tools.{i}") for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"], parallel = _tool_choice(body.tool_choice)
        if parallel is False:
            chat["parallel_tool_calls"] = False
    variables = _thinking(body.thinking, template, thinks)
    output = dict(body.output_config or {})
    if output.get("format") is not None:
        fmt = output.pop("format")
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "output_config.format: {\"type\": \"json_schema\", \"schema\": {...}} expected",
                           "output_config.format", "invalid_value")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    effort = output.pop("effort", None)
    if effort is not None:
        if not isinstance(effort, str):
            raise APIError(400, "output_config.effort: a string expected", "output_config.effort", "invalid_value")
        variables.append(("output_config.effort", "reasoning_effort", effort))
    if output:
        name = sorted(output)[0]
        raise APIError(400, f"output_config.{name}: not supported", f"output_config.{name}", "unsupported_parameter")
    return chat_request(chat), variables


def _text(content: str | list[dict[str, Any]], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{param}.{j}: only text blocks are supported here", f"{param}.{j}", "invalid_value")
        texts.append(block["text"])
    return "\n".join(texts)


def _chat_messages(message: AnthropicMessage, param: str) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, reasoning, results = [], [], [], []
    for j, block in enumerate(message.content):
        kind, where = block.get("type"), f"{param}.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and message.role == "assistant":
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": {
                "name": str(block.get("name", "")), "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and message.role == "user":
            content = block.get("content") or ""
            text = _text(content, f"{where}.content")
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": f"Error: {text}" if block.get("is_error") else text})
        elif kind == "thinking" and message.role == "assistant":
            reasoning.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking" and message.role == "assistant":
            continue  # nothing readable to give the template
        else:
            raise APIError(400, f"{where}: {kind!r} blocks are not supported in {message.role} messages (text, "
                           "tool_use and thinking from the assistant, tool_result from the user)", where,
                           "invalid_value")
    out = list(results)
    if message.role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        if reasoning:
            turn["reasoning_content"] = "\n".join(reasoning)
        out.append(turn)
    elif texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _function(tool: dict[str, Any], param: str) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom"):
        raise APIError(400, f"{param}: server tools ({tool['type']!r}) are not supported; send custom tools "
                       "(name, description, input_schema)", f"{param}.type", "invalid_value")
    unknown = sorted(set(tool) - {"type", "name", "description", "input_schema", "cache_control"})
    if unknown:
        raise APIError(400, f"{param}.{unknown[0]}: unknown field", f"{param}.{unknown[0]}", "unknown_parameter")
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> tuple[Any, bool | None]:
    kind = choice.get("type")
    parallel = None if not choice.get("disable_parallel_tool_use") else False
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise APIError(400, f"tool_choice.type: {kind!r} is not one of auto, any, tool, none", "tool_choice.type",
                   "invalid_value")


def _thinking(thinking: dict[str, Any] | None, template: str, thinks: bool) -> list[tuple[str, str, Any]]:
    if thinking is None:
        return []
    kind = thinking.get("type")
    if kind in ("adaptive", "between_tools"):
        return []  # as the model does
    if kind not in ("enabled", "disabled"):
        raise APIError(400, f"thinking.type: {kind!r} is not one of enabled, disabled, adaptive, between_tools",
                       "thinking.type", "invalid_value")
    if "enable_thinking" in template:
        return [("thinking", "enable_thinking", kind == "enabled")]
    if (kind == "enabled") != thinks:
        raise APIError(400, f"thinking: this model's chat template has no thinking switch, and the model "
                       f"{'does not think' if kind == 'enabled' else 'always thinks'}", "thinking.type",
                       "invalid_value")
    return []


def _stop_reason(reason: str, stop_string: str | None) -> tuple[str, str | None]:
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    return ("stop_sequence", stop_string) if stop_string else ("end_turn", None)


def _usage(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def _block(block: Block, whole: bool) -> dict[str, Any]:
    if block.kind == "text":
        return {"type": "text", "text": block.text if whole else ""}
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if whole else "", "signature": ""}
    return {"type": "tool_use", "id": "toolu_" + block.call_id.removeprefix("call_"), "name": block.name,
            "input": json.loads(block.text or "{}") if whole else {}}


_DELTAS = {"text": ("text_delta", "text"), "reasoning": ("thinking_delta", "thinking"),
           "call": ("input_json_delta", "partial_json")}


@dataclass
class MessagesFormat(ChatFormat):
    """An Anthropic message, whole or as its stream of events (one choice)."""

    id_prefix = "msg_"
    done_marker = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._parser = self.answer_parser()
        self._blocks = Blocks()
        self._stop: tuple[str, str | None] = ("end_turn", None)

    def sse(self, chunk: dict[str, Any]) -> Any:
        return {"event": chunk["type"], "data": sse_data(chunk)}

    def first_chunks(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": self._message([], (None, None), Usage(self.prompt_tokens))}]

    def delta_chunks(self, index: int, delta: StepDelta) -> list[dict[str, Any]]:
        return self._events(self._blocks.add(self._parser.feed(delta.text)))

    def finish_chunks(self, index: int, reason: str, stop_string: str | None = None) -> list[dict[str, Any]]:
        events = self._blocks.add(self._parser.finish()) + self._blocks.close()
        self._stop = _stop_reason(self._parser.finish_reason(reason), stop_string)
        return self._events(events)

    def last_chunks(self, usage: Usage) -> list[dict[str, Any]]:
        return [{"type": "message_delta", "delta": {"stop_reason": self._stop[0], "stop_sequence": self._stop[1]},
                 "usage": _usage(usage)}, {"type": "message_stop"}]

    def error_events(self, error: APIError) -> list[Any]:
        return [{"event": "error", "data": sse_data(anthropic_error_body(error.status_code, error.message))}]

    def response(self, choices: list[ChoiceOutput], usage: Usage, extension: dict[str, Any]) -> dict[str, Any]:
        choice = choices[0]
        parser = self.answer_parser()
        blocks = whole_answer(parser, choice.text)
        stop = _stop_reason(parser.finish_reason(choice.finish_reason), choice.stop_string)
        return self._message([_block(b, whole=True) for b in blocks], stop, usage) | {"specdec": extension}

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                 usage: Usage) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": _usage(usage)}

    def _events(self, events: list[BlockEvent]) -> list[dict[str, Any]]:
        out = []
        for event in events:
            index = event.block.index
            if event.what == "start":
                out.append({"type": "content_block_start", "index": index,
                            "content_block": _block(event.block, whole=False)})
            elif event.what == "delta":
                kind, key = _DELTAS[event.block.kind]
                out.append({"type": "content_block_delta", "index": index, "delta": {"type": kind, key: event.text}})
            else:
                out.append({"type": "content_block_stop", "index": index})
        return out
