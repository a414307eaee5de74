"""POST /v1/chat/completions and /v1/completions: validate, admit, submit, then stream or collect.

Every admitted request owns a concurrency slot and an engine request id until `ActiveRequest.close`
runs, exactly once, on every path out: the stream finished, the engine failed, the client went
away (sse-starlette cancels the stream; a non-streaming request races its disconnect), or the
response never started. Closing an unfinished request aborts it on the engine thread, which frees
its blocks in both pools.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette import EventSourceResponse

from specdec.api.engine_loop import EngineDeadError, GenerationRequest, RequestFailedError, RequestStream
from specdec.api.errors import APIError, error_body
from specdec.api.protocol import ChatFormat, CompletionFormat, ResponseFormat, Usage
from specdec.api.schemas import ERROR_RESPONSES, ChatCompletionRequest, CompletionRequest, GenerationFields
from specdec.api.state import ServerState, server_state
from specdec.sequence import StepDelta
from specdec.verify import AcceptanceStats

router = APIRouter()


@router.post("/v1/chat/completions", tags=["openai"], responses=ERROR_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = server_state(request)
    state.check_model(body.model)
    prompt_ids = state.chat_prompt_ids([m.as_template_dict() for m in body.messages])
    fmt = ChatFormat(state.settings.model_name, body.include_usage)
    return await _generate(request, state, body, prompt_ids, fmt, "messages")


@router.post("/v1/completions", tags=["openai"], responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = server_state(request)
    state.check_model(body.model)
    prompt_ids = state.completion_prompt_ids(body.prompt)
    fmt = CompletionFormat(state.settings.model_name, body.include_usage)
    return await _generate(request, state, body, prompt_ids, fmt, "prompt")


async def _generate(
    request: Request, state: ServerState, body: GenerationFields, prompt_ids: list[int],
    fmt: ResponseFormat, prompt_param: str,
) -> Any:
    max_tokens = _max_tokens(body.requested_max_tokens(), len(prompt_ids), state.info().max_model_len, prompt_param)
    try:
        params = body.sampling_params(max_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc
    active = ActiveRequest.admit(state, fmt.id, len(prompt_ids))
    try:
        stream = state.engine.submit(
            GenerationRequest(fmt.id, prompt_ids, params, body.num_speculative_tokens, body.cache_salt)
        )
    except EngineDeadError as exc:
        active.close(None)
        raise APIError(503, f"the engine is not running: {exc}", code="engine_dead") from exc
    if body.stream:
        return _ClosingEventSource(
            _sse_events(active, stream, fmt), on_close=lambda: active.close("aborted"),
            ping=state.settings.ping_seconds, send_timeout=state.settings.send_timeout_seconds, sep="\n",
        )
    return await _collect(request, active, stream, fmt)


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


class ActiveRequest:
    """One admitted request: its slot, its engine id, its counters and latency metrics."""

    def __init__(self, state: ServerState, request_id: str, prompt_len: int) -> None:
        self.state, self.request_id = state, request_id
        self.usage = Usage(prompt_len)
        self.arrival = self.last_token_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.stats = AcceptanceStats()  # the engine's counts, from the finishing delta
        self.finish_reason: str | None = None
        self.closed = False

    @classmethod
    def admit(cls, state: ServerState, request_id: str, prompt_len: int) -> ActiveRequest:
        if not state.limiter.try_acquire():
            raise APIError(
                429, f"the server is already running its maximum of {state.settings.max_concurrent} "
                "concurrent requests; retry later", code="too_many_concurrent_requests",
                headers={"Retry-After": "1"},
            )
        state.metrics.prompt_tokens.inc(prompt_len)
        return cls(state, request_id, prompt_len)

    def on_delta(self, delta: StepDelta) -> None:
        now, num_tokens = time.perf_counter(), len(delta.token_ids)
        metrics = self.state.metrics
        if num_tokens:
            if self.first_token_at is None:
                self.first_token_at = now
                metrics.ttft.observe(now - self.arrival)
                metrics.generated_tokens.inc(num_tokens)
            else:
                metrics.observe_tokens(num_tokens, now - self.last_token_at)
            self.last_token_at = now
        self.usage.completion_tokens += num_tokens
        self.usage.cached_tokens = delta.num_cached_tokens
        if delta.stats is not None:
            self.stats = delta.stats
        if delta.finished:
            self.finish_reason = delta.finish_reason or "stop"

    def extension(self) -> dict[str, Any]:
        stats = self.stats
        return {"drafted": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens,
                "acceptance_rate": stats.acceptance_rate}

    def close(self, outcome: str | None) -> None:
        """Release the slot and, if the engine still runs this request, abort it; count the
        outcome (the finish reason if it finished; None: an error answer, counted by its handler).
        Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.finish_reason is None:
            self.state.engine.abort(self.request_id)
        self.state.limiter.release()
        if self.finish_reason or outcome:
            self.state.metrics.requests.labels(self.finish_reason or outcome).inc()


async def _sse_events(active: ActiveRequest, stream: RequestStream, fmt: ResponseFormat) -> AsyncIterator[Any]:
    try:
        for chunk in fmt.first_chunks():
            yield _data(chunk)
        async for delta in stream:
            active.on_delta(delta)
            if delta.token_ids or delta.text:
                yield _data(fmt.delta_chunk(delta))
        yield _data(fmt.finish_chunk(active.finish_reason or "stop"))
        if fmt.include_usage:
            yield _data(fmt.usage_chunk(active.usage))
        active.close("stop")
        yield "[DONE]"
    except (EngineDeadError, RequestFailedError, ValueError) as exc:
        active.close("invalid" if isinstance(exc, ValueError) else "error")
        error = _engine_error(exc)
        yield {"event": "error", "data": json.dumps(error_body(error.message, error.type, error.param, error.code))}
        yield "[DONE]"
    finally:  # cancelled by a disconnect, or closed mid-stream: abort at once
        active.close("aborted")


async def _collect(request: Request, active: ActiveRequest, stream: RequestStream, fmt: ResponseFormat) -> Any:
    texts: list[str] = []

    async def consume() -> None:
        async for delta in stream:
            active.on_delta(delta)
            texts.append(delta.text)

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
        return fmt.response("".join(texts), active.finish_reason or "stop", active.usage, active.extension())
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


def _data(chunk: dict[str, Any]) -> str:
    return json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))


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
