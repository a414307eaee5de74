"""POST /v1/responses (and GET /v1/responses/{id}): OpenAI's Responses API on the same engine.

A request is translated into a chat request (`to_chat`) and answered by the chat path, as
/v1/messages is (`specdec.api.anthropic`):

- `input`: text (one user message) or items: messages (`role` user / system / developer /
  assistant, `content` text or `input_text` / `output_text` parts), `function_call` (an earlier
  call: the assistant's `tool_calls`), `function_call_output` (a `tool` message), `reasoning` (an
  earlier answer's reasoning: the next assistant message's `reasoning_content`). `instructions`
  lead as a system message (not carried to later responses, as OpenAI's).
- `previous_response_id`: the conversation of a stored response (its input and output) goes
  before this input; the prompt then starts as that one's did, so the prefix cache serves it.
  Responses are stored (`store`, default true) in the server's memory (with `--replicas`, the
  ingress's), the last `STORED` of them within `STORED_CHARS` of conversation text; an unknown id:
  404 `previous_response_not_found`.
- `tools`: `{"type": "function", "name", "description", "parameters", "strict"}` (other tool
  types: 400); `tool_choice` `auto` / `none` / `required` / `{"type": "function", "name"}`;
  `parallel_tool_calls`. `text.format`: `text`, `json_object`, `json_schema` (constrained, as
  `response_format`). `reasoning.effort` reaches a template that reads `reasoning_effort` (else
  400 naming it); `reasoning.summary` has no effect (the reasoning itself is returned).
- The answer: `output` items `reasoning` (`content: [{"type": "reasoning_text"}]`), `message`
  (`output_text`), `function_call` (`call_id`, `name`, `arguments`); `status` `completed`, or
  `incomplete` with `incomplete_details.reason: "max_output_tokens"`; `usage` with
  `input_tokens_details.cached_tokens`. Streamed as OpenAI streams it: `response.created`,
  `response.in_progress`, per item `response.output_item.added`, `response.content_part.added`,
  `response.output_text.delta` / `response.reasoning_text.delta` /
  `response.function_call_arguments.delta`, their `.done`, `response.output_item.done`, then
  `response.completed` (or `response.incomplete`) with the whole response, every event with its
  `sequence_number`.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from specdec.api.answer import Block, BlockEvent, Blocks, whole_answer
from specdec.api.completions import answer_chat, chat_request
from specdec.api.errors import APIError
from specdec.api.protocol import ChatFormat, ChoiceOutput, Usage, sse_data
from specdec.api.schemas import ERROR_RESPONSES, ChatCompletionRequest, RequestBody
from specdec.api.state import server_state
from specdec.sequence import StepDelta

router = APIRouter()
STORED = 1024  # responses kept for previous_response_id, least recently used dropped first
STORED_CHARS = 64 << 20  # ... and while their conversations hold more text than this
_FLOAT = dict(allow_inf_nan=False)
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(RequestBody):
    """POST /v1/responses."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, **_FLOAT)
    top_p: float | None = Field(None, gt=0.0, le=1.0, **_FLOAT)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = True
    # specdec / vLLM extensions, as on chat
    top_k: int | None = None
    seed: int | None = None
    cache_salt: str | None = None
    # no effect on the answer
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    truncation: str | None = None  # "disabled" (the default) or "auto": a prompt over the context is a 400 either way
    include: list[str] | None = None
    # refused unless off
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None


@dataclass
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages: the input (without instructions) and the output
    chars: int = 0  # the conversation's size as JSON text


def _keep(store: OrderedDict[str, Stored], response_id: str, stored: Stored) -> None:
    """Store a response; drop the least recently used beyond `STORED` of them or `STORED_CHARS`
    (a chain of responses stores its whole conversation at each link)."""
    stored.chars = len(json.dumps(stored.conversation, ensure_ascii=False))
    store[response_id] = stored
    total = sum(s.chars for s in store.values())
    while len(store) > 1 and (len(store) > STORED or total > STORED_CHARS):
        total -= store.popitem(last=False)[1].chars


@router.post("/v1/responses", tags=["openai"], responses=ERROR_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    state = server_state(request)
    state.screen_fields(request, body)
    for name, off in (("background", False), ("conversation", None), ("prompt", None), ("max_tool_calls", None),
                      ("top_logprobs", 0)):
        value = getattr(body, name)
        if value not in (None, off):
            raise APIError(400, f"{name}: not supported", name, "unsupported_parameter")
    store = state.stored_responses
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise APIError(404, f"Previous response with id {body.previous_response_id!r} not found.",
                           "previous_response_id", "previous_response_not_found")
        store.move_to_end(body.previous_response_id)
        history = stored.conversation
    conversation = history + input_messages(body.input)
    chat, variables = to_chat(body, conversation)
    make = functools.partial(ResponsesFormat, request_body=body, conversation=conversation,
                             store=store if body.store is not False else None)
    return await answer_chat(request, state, chat, variables, make)


@router.get("/v1/responses/{response_id}", tags=["openai"], responses=ERROR_RESPONSES)
async def get_response(response_id: str, request: Request) -> Any:
    stored = server_state(request).stored_responses.get(response_id)
    if stored is None:
        raise APIError(404, f"Response with id {response_id!r} not found.", "response_id", "not_found")
    return stored.response


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of a request's `input`."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []

    def assistant() -> dict[str, Any]:
        if not (messages and messages[-1]["role"] == "assistant" and not reasoning):
            messages.append({"role": "assistant", "content": ""})
        if reasoning:
            messages[-1]["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return messages[-1]

    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role: {role!r} is not user, system, developer or assistant",
                               f"{where}.role", "invalid_value")
            text = _parts_text(item.get("content", ""), f"{where}.content")
            if role == "assistant":
                turn = assistant()
                turn["content"] = (turn["content"] + "\n" + text) if turn["content"] else text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            turn = assistant()
            turn.setdefault("tool_calls", []).append({"id": str(item.get("call_id", "")), "type": "function",
                                                      "function": {"name": str(item.get("name", "")),
                                                                   "arguments": str(item.get("arguments", "{}"))}})
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                             "content": output if isinstance(output, str) else _parts_text(output, f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning.append("\n".join(str(p.get("text", "")) for p in parts if isinstance(p, dict)))
        else:
            raise APIError(400, f"{where}.type: {kind!r} items are not supported (message, function_call, "
                           "function_call_output, reasoning)", f"{where}.type", "invalid_value")
    return messages


def _parts_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param}: text or a list of text parts expected", param, "invalid_value")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS + ("refusal",):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{param}.{j}: {kind!r} parts are not supported (input_text, output_text)",
                           f"{param}.{j}", "invalid_value")
        if part["type"] != "refusal":
            texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def to_chat(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list]:
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_tokens": body.max_output_tokens, "stream": body.stream,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
        "cache_salt": body.cache_salt, "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        chat["tools"] = [_function(tool, f"tools.{i}") for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    fmt = (body.text or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    variables = []
    effort = (body.reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise APIError(400, "reasoning.effort: a string expected", "reasoning.effort", "invalid_value")
    if effort is not None:
        variables.append(("reasoning.effort", "reasoning_effort", effort))
    return chat_request(chat), variables


def _function(tool: dict[str, Any], param: str) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise APIError(400, f"{param}.type: {tool.get('type')!r} tools are not supported (function)",
                       f"{param}.type", "invalid_value")
    unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise APIError(400, f"{param}.{unknown[0]}: unknown field", f"{param}.{unknown[0]}", "unknown_parameter")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}}


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise APIError(400, f"tool_choice.type: {choice.get('type')!r} is not supported (auto, none, required, "
                   "or a function)", "tool_choice", "invalid_value")


def _response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format: an object expected ({\"type\": \"text\" | \"json_object\" | "
                       "\"json_schema\", ...})", "text.format", "invalid_value")
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesFormat(ChatFormat):
    """A Responses API response, whole or as its stream of events (one choice)."""

    request_body: ResponsesRequest | None = None
    conversation: list[dict[str, Any]] = field(default_factory=list)
    store: OrderedDict[str, Stored] | None = None

    id_prefix = "resp_"
    done_marker = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._parser = self.answer_parser()
        self._blocks = Blocks()
        self._item_ids: dict[int, str] = {}
        self._sequence = 0
        self._reason = "stop"

    def sse(self, chunk: dict[str, Any]) -> Any:
        chunk["sequence_number"] = self._sequence
        self._sequence += 1
        return {"event": chunk["type"], "data": sse_data(chunk)}

    def first_chunks(self) -> list[dict[str, Any]]:
        start = self._response([], "in_progress", None)
        return [{"type": "response.created", "response": start}, {"type": "response.in_progress", "response": start}]

    def delta_chunks(self, index: int, delta: StepDelta) -> list[dict[str, Any]]:
        return self._events(self._blocks.add(self._parser.feed(delta.text)))

    def finish_chunks(self, index: int, reason: str, stop_string: str | None = None) -> list[dict[str, Any]]:
        events = self._blocks.add(self._parser.finish()) + self._blocks.close()
        self._reason = self._parser.finish_reason(reason)
        return self._events(events)

    def last_chunks(self, usage: Usage) -> list[dict[str, Any]]:
        blocks = self._blocks.blocks[:-1] if self._parser.cut_call else self._blocks.blocks
        response = self._finished(blocks, self._reason, usage)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [{"type": kind, "response": response}]

    def error_events(self, error: APIError) -> list[Any]:
        return [self.sse({"type": "error", "code": error.code, "message": error.message, "param": error.param})]

    def response(self, choices: list[ChoiceOutput], usage: Usage, extension: dict[str, Any]) -> dict[str, Any]:
        choice = choices[0]
        parser = self.answer_parser()
        blocks = whole_answer(parser, choice.text)
        return self._finished(blocks, parser.finish_reason(choice.finish_reason), usage) | {"specdec": extension}

    def _finished(self, blocks: list[Block], reason: str, usage: Usage) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if reason == "length" else None
        response = self._response([self._item(b, done=True) for b in blocks],
                                  "incomplete" if incomplete else "completed", usage, incomplete)
        if self.store is not None:
            _keep(self.store, self.id, Stored(response, self.conversation + [_assistant(blocks)]))
        return response

    def _response(self, output: list[dict[str, Any]], status: str, usage: Usage | None,
                  incomplete: dict[str, str] | None = None) -> dict[str, Any]:
        body = self.request_body
        assert body is not None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "error": None, "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "previous_response_id": body.previous_response_id,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "store": body.store is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "text": body.text or {"format": {"type": "text"}}, "reasoning": body.reasoning or {"effort": None},
            "truncation": body.truncation or "disabled", "metadata": body.metadata or {}, "user": body.user,
            "usage": None if usage is None else {
                "input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens},
        }

    def _item_id(self, block: Block) -> str:
        if block.index not in self._item_ids:
            self._item_ids[block.index] = _new_id({"text": "msg", "reasoning": "rs", "call": "fc"}[block.kind])
        return self._item_ids[block.index]

    def _item(self, block: Block, done: bool) -> dict[str, Any]:
        item_id, status = self._item_id(block), "completed" if done else "in_progress"
        if block.kind == "text":
            return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                    "content": [_part(block)] if done else []}
        if block.kind == "reasoning":
            return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                    "content": [_part(block)] if done else []}
        return {"type": "function_call", "id": item_id, "call_id": block.call_id, "name": block.name,
                "arguments": block.text if done else "", "status": status}

    def _events(self, events: list[BlockEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            block = event.block
            at = {"item_id": self._item_id(block), "output_index": block.index}
            part = {} if block.kind == "call" else {"content_index": 0}
            if event.what == "start":
                out.append({"type": "response.output_item.added", "output_index": block.index,
                            "item": self._item(block, done=False)})
                if block.kind != "call":
                    out.append({"type": "response.content_part.added", **at, **part,
                                "part": _part(Block(block.kind, block.index))})
            elif event.what == "delta":
                kind = {"text": "output_text", "reasoning": "reasoning_text", "call": "function_call_arguments"}
                out.append({"type": f"response.{kind[block.kind]}.delta", **at, **part, "delta": event.text}
                           | ({"logprobs": []} if block.kind == "text" else {}))
            else:
                if block.kind == "call":
                    out.append({"type": "response.function_call_arguments.done", **at, "name": block.name,
                                "arguments": block.text})
                else:
                    kind = "output_text" if block.kind == "text" else "reasoning_text"
                    out.append({"type": f"response.{kind}.done", **at, **part, "text": block.text}
                               | ({"logprobs": []} if block.kind == "text" else {}))
                    out.append({"type": "response.content_part.done", **at, **part, "part": _part(block)})
                out.append({"type": "response.output_item.done", "output_index": block.index,
                            "item": self._item(block, done=True)})
        return out


def _part(block: Block) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": block.text}
    return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}


def _assistant(blocks: list[Block]) -> dict[str, Any]:
    """The answer as the assistant's chat message, for the next response's conversation."""
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if b.kind == "text")}
    reasoning = "".join(b.text for b in blocks if b.kind == "reasoning")
    if reasoning:
        turn["reasoning_content"] = reasoning
    calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
             for b in blocks if b.kind == "call"]
    if calls:
        turn["tool_calls"] = calls
    return turn

