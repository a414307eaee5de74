"""POST /v1/chat/completions and /v1/completions: validate, admit, submit, then stream or collect.

A request for n choices submits n engine requests for its prompt together; the siblings start on
the first one's prompt blocks (`share_prompt_with`), and their deltas arrive on one stream.
Every admitted request owns a concurrency slot per choice and its engine request ids until
`ActiveRequest.close` runs, exactly once, on every path out: the stream finished, the engine failed, the client went
away (sse-starlette cancels the stream; a non-streaming request races its disconnect), or the
response never started. Closing an unfinished request aborts its unfinished choices on the engine
thread, which frees their blocks in both pools.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from sse_starlette import EventSourceResponse

from specdec.api.engine_loop import EngineDeadError, EngineInfo, GenerationRequest, RequestFailedError, RequestStream
from specdec.api.errors import APIError
from specdec.api.logprobs import TokenTexts
from specdec.api.protocol import ChatFormat, ChoiceOutput, CompletionFormat, ResponseFormat, Usage
from specdec.api.reasoning import is_harmony, parses_reasoning, starts_in_reasoning
from specdec.api.schemas import (
    ERROR_RESPONSES, ChatCompletionRequest, CompletionRequest, FieldError, GenerationFields,
)
from specdec.api.state import ServerState, TemplateVariables, server_state
from specdec.api.tools import ToolDefinition
from specdec.sampling_params import SamplingParams, StructuredSpec
from specdec.sequence import StepDelta, TokenLogprobs
from specdec.verify import AcceptanceStats

router = APIRouter()
_SEED_MODULUS = 2**63  # choice i samples with seed + i, wrapped into SamplingParams' range


@router.post("/v1/chat/completions", tags=["openai"], responses=ERROR_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = server_state(request)
    state.screen_fields(request, body)
    return await answer_chat(request, state, body, body.template_variables())


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's request translates into; what it refuses is a 400 naming the
    (chat) field."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ()))
        raise APIError(400, f"{param}: {err.get('msg', 'invalid value').removeprefix('Value error, ')}", param,
                       "invalid_value") from exc


async def answer_chat(request: Request, state: ServerState, body: ChatCompletionRequest,
                      variables: TemplateVariables, make_format: type[ChatFormat] = ChatFormat) -> Any:
    """A chat request answered in `make_format`'s shape (chat completions; Anthropic's Messages and
    OpenAI's Responses translate their requests into one, `specdec.api.anthropic` / `.responses`)."""
    state.check_model(body.model)
    tool_use = body.tool_use
    tool_grammar = state.tool_grammar(tool_use)
    messages = [m.as_template_dict() for m in body.messages]
    tools = tool_use.template_tools()
    prompt_ids = state.chat_prompt_ids(messages, tools=tools, variables=variables)
    reasoning = _parses_reasoning(state, body)
    starts = reasoning and starts_in_reasoning(state.settings.reasoning_parser,
                                               state.chat_prompt_text(messages, tools, variables))
    fmt = make_format(state.settings.model_name, body.include_usage, body.num_choices, _token_texts(state, body),
                      parse_tool_calls=tool_use.active, parse_reasoning=reasoning, starts_in_reasoning=starts,
                      tool_format=(state.tool_call_format or "hermes") if tool_use.active else "hermes",
                      tool_schemas={t.function.name: t.function.parameters or {} for t in tool_use.tools},
                      harmony=is_harmony(state.tokenizer) or state.tool_call_format == "harmony")
    return await _generate(request, state, body, prompt_ids, fmt, "messages", tool_grammar)


@router.post("/v1/completions", tags=["openai"], responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = server_state(request)
    state.screen_fields(request, body)
    state.check_model(body.model)
    prompt_ids = state.completion_prompt_ids(body.prompt)
    echo = state.prompt_text(body.prompt, prompt_ids) if body.echo else ""
    fmt = CompletionFormat(state.settings.model_name, body.include_usage, body.num_choices,
                           _token_texts(state, body), echo, prompt_texts=state.token_texts if body.scores_prompt else None,
                           echo_logprobs=bool(body.echo) and body.logprobs is not None,
                           vllm_prompt_logprobs=body.prompt_logprobs is not None,
                           answer_nothing=body.max_tokens == 0, prompt_ids=prompt_ids)
    return await _generate(request, state, body, prompt_ids, fmt, "prompt")


def _parses_reasoning(state: ServerState, body: ChatCompletionRequest) -> bool:
    """Split the answer into reasoning and content: a thinking model's (`--reasoning-parser`),
    unless a grammar holds the answer from its first token (a forced call, a JSON answer), which
    leaves no room to think."""
    forced = body.tool_use.choice not in ("none", "auto")
    structured = body.response_format is not None and body.response_format.type != "text"
    return not (forced or structured) and parses_reasoning(state.settings.reasoning_parser, state.tokenizer)


def _token_texts(state: ServerState, body: GenerationFields) -> TokenTexts | None:
    return state.token_texts if body.requested_logprobs() is not None else None


async def _generate(
    request: Request, state: ServerState, body: GenerationFields, prompt_ids: list[int],
    fmt: ResponseFormat, prompt_param: str, tool_grammar: StructuredSpec | None = None,
) -> Any:
    info = state.info()
    max_tokens = _max_tokens(body.requested_max_tokens(), len(prompt_ids), info.max_model_len, prompt_param)
    try:
        params = body.sampling_params(max_tokens, info.vocab_size, tool_grammar)
    except FieldError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from exc
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc
    if tool_grammar is not None:
        await _check_tool_schemas(info, body.tools or [])
    if params.structured is not None:
        await _check_grammar(info, params.structured, "tools" if tool_grammar is not None else "response_format")
    fmt.prompt_tokens = len(prompt_ids)
    active = ActiveRequest.admit(state, fmt.id, len(prompt_ids), body.num_choices)
    try:
        stream = state.engine.submit_all(active.generation_requests(prompt_ids, params, body))
    except EngineDeadError as exc:
        active.close(None)
        raise APIError(503, f"the engine is not running: {exc}", code="engine_dead") from exc
    if body.stream:
        return _ClosingEventSource(
            _sse_events(active, stream, fmt), on_close=lambda: active.close("aborted"),
            ping=state.settings.ping_seconds, send_timeout=state.settings.send_timeout_seconds, sep="\n",
        )
    return await _collect(request, active, stream, fmt)


async def _check_grammar(info: EngineInfo, spec: StructuredSpec, param: str) -> None:
    """A schema the grammar compiler refuses is a 400 naming `param` (`response_format`, or
    `tools` for the tool calls' grammar), before anything is queued or streamed. Compiled off the
    event loop (the first one compiles the tokenizer's token table, ~2 s on a 152k vocabulary);
    the engine finds it cached."""
    if info.grammars is None:
        raise APIError(400, "structured output needs a tokenizer", param, "invalid_value")
    try:
        await asyncio.to_thread(info.grammars.grammar, spec)
    except ValueError as exc:
        raise APIError(400, str(exc), param, "invalid_value") from exc


async def _check_tool_schemas(info: EngineInfo, tools: list[ToolDefinition]) -> None:
    """Each function's parameters compile as a JSON schema, or a 400 names that tool's."""
    for i, tool in enumerate(tools):
        param = f"tools.{i}.function.parameters"
        try:
            spec = StructuredSpec.json_schema(tool.function.parameters or {"type": "object"})
        except ValueError as exc:
            raise APIError(400, str(exc), param, "invalid_value") from exc
        await _check_grammar(info, spec, param)


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int, prompt_param: str) -> int:
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens, which leaves no room for an answer.", prompt_param, "context_length_exceeded",
        )
    if requested is not None and requested > room:
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
            "Please reduce the prompt or max_tokens.", "max_tokens", "context_length_exceeded",
        )
    return room if requested is None else requested


@dataclass
class Choice:
    """One of a request's n samples: its engine request and what has come back so far."""

    index: int
    request_id: str
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # from the first delta, when asked
    num_tokens: int = 0
    num_cached_tokens: int = 0
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)  # the engine's, from the finishing delta
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it
    last_token_at: float | None = None

    def output(self, with_logprobs: bool) -> ChoiceOutput:
        return ChoiceOutput("".join(self.texts), self.finish_reason or "stop", self.logprobs if with_logprobs else None,
                            self.prompt_logprobs, self.stop_string)


class ActiveRequest:
    """One admitted request: its slots (one per choice), its n engine requests (the first one's id
    is the response's; the siblings' are `{id}-{i}`), their counters and the latency metrics."""

    def __init__(self, state: ServerState, request_id: str, prompt_len: int, n: int = 1) -> None:
        self.state, self.request_id, self.prompt_len = state, request_id, prompt_len
        self.choices = [Choice(i, request_id if i == 0 else f"{request_id}-{i}") for i in range(n)]
        self._by_request_id = {choice.request_id: choice for choice in self.choices}
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.closed = False

    @classmethod
    def admit(cls, state: ServerState, request_id: str, prompt_len: int, n: int = 1) -> ActiveRequest:
        limit = state.settings.max_concurrent
        if n > limit:
            raise APIError(400, f"n={n} is more than this server runs at once (--max-concurrent {limit})",
                           "n", "invalid_value")
        if not state.limiter.try_acquire(n):
            raise APIError(
                429, f"the server is already running its maximum of {limit} concurrent requests "
                "(a request with n choices counts n); retry later", code="too_many_concurrent_requests",
                headers={"Retry-After": "1"},
            )
        state.metrics.prompt_tokens.inc(prompt_len)
        return cls(state, request_id, prompt_len, n)

    def generation_requests(
        self, prompt_ids: list[int], params: SamplingParams, body: GenerationFields,
    ) -> list[GenerationRequest]:
        """One engine request per choice; the siblings share the first one's prompt blocks, and
        choice i samples with seed + i (so choice 0 is the n=1 answer)."""
        leader = self.choices[0].request_id
        return [
            GenerationRequest(
                choice.request_id, prompt_ids,
                params if params.seed is None or not choice.index
                else replace(params, seed=(params.seed + choice.index) % _SEED_MODULUS),
                body.num_speculative_tokens, body.cache_salt, share_prompt_with=leader if choice.index else None,
            )
            for choice in self.choices
        ]

    @property
    def usage(self) -> Usage:
        """The prompt once, the completions of all choices; cached tokens as the first choice found them."""
        return Usage(self.prompt_len, sum(c.num_tokens for c in self.choices), self.choices[0].num_cached_tokens)

    @property
    def finished(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices)

    def on_delta(self, delta: StepDelta) -> Choice:
        choice = self._by_request_id[delta.request_id]
        now, num_tokens = time.perf_counter(), len(delta.token_ids)
        metrics = self.state.metrics
        if num_tokens:
            if self.first_token_at is None:
                self.first_token_at = now
                metrics.ttft.observe(now - self.arrival)
            if choice.last_token_at is None:
                metrics.generated_tokens.inc(num_tokens)
            else:
                metrics.observe_tokens(num_tokens, now - choice.last_token_at)
            choice.last_token_at = now
        choice.num_tokens += num_tokens
        choice.texts.append(delta.text)
        choice.logprobs.extend(delta.logprobs or [])
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        choice.num_cached_tokens = delta.num_cached_tokens
        if delta.stats is not None:
            choice.stats = delta.stats
        if delta.finished:
            choice.finish_reason = delta.finish_reason or "stop"
            choice.stop_string = delta.stop_string
        return choice

    def extension(self) -> dict[str, Any]:
        stats = AcceptanceStats()
        for choice in self.choices:
            stats.merge(choice.stats)
        return {"drafted": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens,
                "acceptance_rate": stats.acceptance_rate}

    def close(self, outcome: str | None) -> None:
        """Release the slots and abort the choices the engine still runs; count the outcome (the
        first choice's finish reason if all finished; None: an error answer, counted by its
        handler). Idempotent."""
        if self.closed:
            return
        self.closed = True
        for choice in self.choices:
            if choice.finish_reason is None:
                self.state.engine.abort(choice.request_id)
        self.state.limiter.release(len(self.choices))
        reason = self.choices[0].finish_reason if self.finished else None
        if reason or outcome:
            self.state.metrics.requests.labels(reason or outcome).inc()


async def _sse_events(active: ActiveRequest, stream: RequestStream, fmt: ResponseFormat) -> AsyncIterator[Any]:
    try:
        for chunk in fmt.first_chunks():
            yield fmt.sse(chunk)
        async for delta in stream:
            choice = active.on_delta(delta)
            if delta.token_ids or delta.text:
                for chunk in fmt.delta_chunks(choice.index, delta):
                    yield fmt.sse(chunk)
            if delta.finished:
                for chunk in fmt.finish_chunks(choice.index, choice.finish_reason, delta.stop_string):
                    yield fmt.sse(chunk)
        for chunk in fmt.last_chunks(active.usage):
            yield fmt.sse(chunk)
        active.close("stop")
        if fmt.done_marker:
            yield "[DONE]"
    except (EngineDeadError, RequestFailedError, ValueError) as exc:
        active.close("invalid" if isinstance(exc, ValueError) else "error")
        for event in fmt.error_events(_engine_error(exc)):
            yield event
    finally:  # cancelled by a disconnect, or closed mid-stream: abort at once
        active.close("aborted")


async def _collect(request: Request, active: ActiveRequest, stream: RequestStream, fmt: ResponseFormat) -> Any:
    async def consume() -> None:
        async for delta in stream:
            active.on_delta(delta)

    consumer = asyncio.ensure_future(consume())
    disconnect = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({consumer, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not consumer.done():
            return None  # nobody is listening; `finally` aborts the request
        try:
            consumer.result()
        except (EngineDeadError, RequestFailedError, ValueError) as exc:
            active.close(None)  # the error handler counts the answer
            raise _engine_error(exc) from exc
        active.close("stop")
        with_logprobs = fmt.token_texts is not None
        return fmt.response([c.output(with_logprobs) for c in active.choices], active.usage, active.extension())
    finally:
        consumer.cancel()
        disconnect.cancel()
        active.close("aborted")


def _engine_error(exc: Exception) -> APIError:
    """A request the engine refused (ValueError) is the client's fault; a dead engine or a failed
    step is ours."""
    if isinstance(exc, EngineDeadError):
        return APIError(500, f"the engine stopped while generating: {exc}", type="server_error", code="engine_error")
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"generating this request failed: {exc}", type="server_error", code="engine_error")
    return APIError(400, str(exc), code="invalid_value")


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body was read already, so only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _ClosingEventSource(EventSourceResponse):
    """An EventSourceResponse that runs `on_close` however the response ends, even if the event
    generator never started (e.g. the client left before the headers were sent)."""

    def __init__(self, content: AsyncIterator[Any], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
