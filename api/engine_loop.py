"""The engine loop: one thread owns the (not thread-safe) Engine; asyncio code talks to it by messages.

    event loop                          engine thread
    ----------                          -------------
    submit(requests) -> RequestStream   builds the Engine (model loading happens here)
      inbox.append(("add", ...)) ---->  add_request / abort, in arrival order
    abort(id)                           step() -> [StepDelta]
      inbox.append(("abort", id)) --->  release finished requests, publish a snapshot
    stream.queue  <------------------   loop.call_soon_threadsafe(put deltas)

Only the engine thread calls the Engine. When idle it sleeps on a condition (no busy spin). A step
that fails (`StepError`) has released the requests it ran: each of their streams receives a
`RequestFailedError` and the loop serves the others on. After `MAX_STEP_FAILURES` failed steps in a
row (the device is gone, not one request's bad luck), or on any other exception, the loop dies:
every in-flight request receives an `EngineDeadError`, `/health` answers 503 and later
submissions fail at once.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.engine import StepError
from specdec.sampling_params import SamplingParams
from specdec.sequence import StepDelta

logger = logging.getLogger("specdec.api")

STEP_LOG_ENV = "SPECDEC_STEP_LOG"
_STALL_WAIT_S = 0.02  # work exists but nothing could be scheduled this step: wait, don't spin
MAX_STEP_FAILURES = 3  # failed steps in a row (none succeeding between) that kill the loop


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (model loading or a step failed, or the server is shutting down)."""


class RequestFailedError(RuntimeError):
    """A step this request ran in failed; the engine released it and serves the others on."""


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    num_speculative_tokens: int | None = None
    cache_salt: str | None = None  # requests with different salts share no cached prefix
    # n > 1: the id of the first of the parallel samples of this prompt; this one starts on its
    # cached prompt blocks once they are prefilled (`Engine.add_request(share_prompt_with=)`)
    share_prompt_with: str | None = None
    # Prefill/decode disaggregation (`specdec.handoff`): a prefill replica's copy ends after its
    # first token with a ticket (`handoff`); a decode replica's resumes after the tokens another
    # replica emitted (`generated`), on the blocks of `ticket` pulled from `prefill_replica`
    # (`payload`, imported just before the request is added).
    handoff: bool = False
    generated: list[int] | None = None
    ticket: Any = None
    prefill_replica: str | None = None
    payload: Any = None


@dataclass(frozen=True)
class EngineInfo:
    """Immutable facts about the loaded engine, safe to read from any thread."""

    max_model_len: int
    vocab_size: int
    tokenizer: Any  # the engine thread's: it detokenizes
    # The API's copy, for the event-loop thread (a fast tokenizer must not be used from two threads
    # at once). Copied while loading: on the first request it cost ~1.5 s (151k-token vocabulary).
    api_tokenizer: Any
    speculative: bool
    num_speculative_tokens: int
    # The engine's grammar compiler (structured output), for checking a schema before it is queued;
    # its caches are safe to share (llguidance's objects are thread-safe). None without a tokenizer.
    grammars: Any = None
    block_size: int = 16  # tokens per block of the target's prefix cache
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after the latest step, published by the engine thread for /metrics."""

    kv_usage: dict[str, dict[str, int]] = field(default_factory=dict)
    # per pool: prompt tokens looked up in / found in the prefix cache since start (cumulative)
    prefix_cache: dict[str, dict[str, int]] = field(default_factory=dict)
    num_waiting: int = 0
    num_running: int = 0
    acceptance: dict[str, Any] = field(default_factory=dict)
    drafted_per_position: tuple[int, ...] = ()
    experts: dict[str, Any] = field(default_factory=dict)  # an MoE target's `ExpertStats.as_dict()`
    # the keys of the blocks the target's prefix cache holds (only with `AsyncEngine.publish_keys`:
    # a replica reports them to the router)
    cached_keys: tuple[bytes, ...] = ()


class RequestStream:
    """The consumer side of one or more requests submitted together (the n choices of one HTTP
    request): their deltas arrive on one asyncio queue, each request's in order, interleaved. It
    ends once every one of them has finished, or at the first error."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = list(request_ids)
        self.queue: asyncio.Queue[StepDelta | BaseException] = asyncio.Queue()
        self._unfinished = set(request_ids)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepDelta:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item


class AsyncEngine:
    """Runs an Engine on its own thread and exposes it to asyncio code.

    `engine` is an Engine or a zero-argument factory that builds one (called on the engine thread,
    so a slow model load does not block the server). Call `start()` from the event loop.
    """

    def __init__(
        self, engine: Any | Callable[[], Any], on_load_error: Callable[[str], None] | None = None,
        warmup: Callable[[Any], Any] | None = None,
    ) -> None:
        self._factory = engine if callable(engine) and not hasattr(engine, "step") else (lambda: engine)
        self._on_load_error = on_load_error
        self._warmup = warmup  # run on the loaded engine before it is ready (specdec.warmup.warm_up)
        self.phase = "loading"  # what /health reports until ready: loading, then warming up
        self._cond = threading.Condition()
        self._inbox: deque[tuple] = deque()  # guarded by _cond
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._drafted_per_position: list[int] = []  # engine thread only
        self._failures = 0  # failed steps in a row; engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.info: EngineInfo | None = None
        self.error: str | None = None
        self.snapshot = EngineSnapshot()
        self.ready = threading.Event()
        self.publish_keys = False  # put the prefix cache's block keys in every snapshot
        self._step_started: float | None = None  # monotonic time the running step began
        self.engine: Any = None  # once loaded; other threads may only read what is safe (export_kv)

    # ---- event-loop side -----------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.ready.is_set() and self.error is None

    @property
    def kv_imported_blocks(self) -> int:
        """Blocks of handed-over requests written into the pools (prefill/decode disaggregation)."""
        return self.engine.kv_imported_blocks if self.engine is not None else 0

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot: not yet admitted by the engine, or still in the inbox."""
        with self._cond:
            pending = sum(1 for cmd in self._inbox if cmd[0] == "add")
        return self.snapshot.num_waiting + pending

    def step_seconds(self) -> float:
        """How long the step running now has run (0 between steps): a health check's stall gauge."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; its deltas arrive on the returned stream. Raises EngineDeadError."""
        return self.submit_all([request])

    def submit_all(self, requests: list[GenerationRequest]) -> RequestStream:
        """Queue requests together (in this order, with nothing between them, so a sibling's
        `share_prompt_with` names one the engine already holds); all their deltas arrive on the
        one returned stream. Raises EngineDeadError."""
        stream = RequestStream([r.request_id for r in requests])
        with self._cond:
            if self.error is not None or self._stopping:
                raise EngineDeadError(self.error or "the server is shutting down")
            self._inbox.extend(("add", request, stream) for request in requests)
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (on the engine thread, at its next iteration)."""
        with self._cond:
            self._inbox.append(("abort", request_id))
            self._cond.notify()

    def release_lease(self, lease_id: str) -> None:
        """Free a handoff lease's blocks (on the engine thread, at its next iteration)."""
        with self._cond:
            self._inbox.append(("unlease", lease_id))
            self._cond.notify()

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._factory()
            if self._warmup is not None:
                self.phase = "warming up"
                report = self._warmup(engine)
                logger.info("warmed up in %.1fs (%d tokens in %d short requests)",
                            report.seconds, report.num_tokens, report.num_passes)
        except BaseException as exc:  # noqa: BLE001 - any load failure must reach /health
            logger.exception("loading the engine failed")
            self._die(f"model {self.phase} failed: {exc}")
            if self._on_load_error is not None:
                self._on_load_error(self.error)
            return
        self.info = _engine_info(engine)
        self.engine = engine
        gc.collect()  # what loading left, then everything loaded out of every later collection: a
        gc.freeze()   # full collection scanned it all (0.2 s once under load here, a stream's gap)
        self._publish(engine)
        self.ready.set()
        try:
            self._serve(engine)
        except BaseException as exc:  # noqa: BLE001 - a dead loop must fail its requests, not hang them
            logger.exception("the engine loop died")
            self._die(f"engine failure: {type(exc).__name__}: {exc}")
            return
        self._die("the server is shutting down")

    def _serve(self, engine: Any) -> None:
        stalled = False
        log = StepLog.from_env()
        while True:
            commands = self._next_commands(engine, stalled)
            if commands is None:
                return
            started = time.perf_counter()
            for command in commands:
                self._apply(engine, command)
            engine.expire_leases()
            applied = time.perf_counter()
            deltas = self._step(engine) if engine.has_unfinished() else []
            stepped = time.perf_counter()
            stalled = engine.has_unfinished() and not getattr(engine, "num_scheduled", deltas)
            self._dispatch(engine, deltas)
            self._publish(engine)
            if log is not None:
                log.write(engine, deltas, len(commands), applied - started, stepped - applied, time.perf_counter() - stepped)

    def _step(self, engine: Any) -> list[StepDelta]:
        """One engine step; a failed one fails its requests, unless steps keep failing."""
        self._step_started = time.monotonic()
        try:
            deltas = engine.step()
        except StepError as exc:
            self._failures += 1
            if self._failures >= MAX_STEP_FAILURES or getattr(exc.__cause__, "fatal", False):
                raise  # a parallel target's rank is gone (`RankFailure.fatal`): no later step can run
            self._fail_requests(exc)
            return []
        finally:
            self._step_started = None
        self._failures = 0
        return deltas

    def _fail_requests(self, exc: StepError) -> None:
        """The engine released these requests; tell their consumers."""
        logger.error("a step failed; failing its %d request(s)", len(exc.request_ids), exc_info=exc)
        cause = exc.__cause__ or exc
        error = f"{type(cause).__name__}: {cause}"
        streams = _unique(self._streams.pop(rid, None) for rid in exc.request_ids)
        self._deliver([(stream, RequestFailedError(error)) for stream in streams])

    def _next_commands(self, engine: Any, stalled: bool) -> list[tuple] | None:
        """Wait until there is something to do; None when shutting down."""
        with self._cond:
            if stalled and not self._inbox and not self._stopping:
                self._cond.wait(_STALL_WAIT_S)
            while not (self._inbox or self._stopping or engine.has_unfinished()):
                deadline = engine.leases.next_deadline()
                if deadline is not None and deadline <= time.monotonic():
                    break  # a lease to expire
                self._cond.wait(None if deadline is None else deadline - time.monotonic())
            if self._stopping:
                return None
            commands = list(self._inbox)
            self._inbox.clear()
            return commands

    def _apply(self, engine: Any, command: tuple) -> None:
        if command[0] == "abort":
            self._streams.pop(command[1], None)
            engine.abort(command[1])
            return
        if command[0] == "unlease":
            engine.release_lease(command[1])
            return
        _, request, stream = command
        try:
            engine.add_request(  # a payload is written just before its request: nothing evicts it between
                request.prompt_ids, request.params, request.request_id, request.num_speculative_tokens,
                cache_salt=request.cache_salt, share_prompt_with=request.share_prompt_with,
                handoff=request.handoff, generated=request.generated, payload=request.payload,
            )
        except ValueError as exc:
            self._deliver([(stream, exc)])
            return
        self._streams[request.request_id] = stream

    def _dispatch(self, engine: Any, deltas: list[StepDelta]) -> None:
        items = []
        for delta in deltas:
            if delta.num_drafted > len(self._drafted_per_position):
                self._drafted_per_position.extend([0] * (delta.num_drafted - len(self._drafted_per_position)))
            for position in range(delta.num_drafted):
                self._drafted_per_position[position] += 1
            stream = self._streams.get(delta.request_id)
            if delta.finished:
                engine.release(delta.request_id)
                self._streams.pop(delta.request_id, None)
            if stream is not None:
                items.append((stream, delta))
        self._deliver(items)

    def _deliver(self, items: list[tuple[RequestStream, Any]]) -> None:
        if not items or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _publish(self, engine: Any) -> None:
        scheduler = engine.scheduler
        self.snapshot = EngineSnapshot(
            kv_usage=engine.kv_usage(),
            prefix_cache=engine.prefix_cache_stats(),
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            acceptance=engine.stats.as_dict(),
            drafted_per_position=tuple(self._drafted_per_position),
            experts={} if engine.expert_stats is None else engine.expert_stats.as_dict(),
            cached_keys=engine.cached_block_keys() if self.publish_keys else (),
        )

    def _die(self, message: str) -> None:
        with self._cond:
            self.error = message
            pending = [cmd[2] for cmd in self._inbox if cmd[0] == "add"]
            self._inbox.clear()
        streams = _unique(pending + list(self._streams.values()))
        self._streams.clear()
        self._deliver([(stream, EngineDeadError(message)) for stream in streams])
        self.ready.set()


def _unique(streams: Any) -> list[RequestStream]:
    """The streams, each once (the choices of one request share theirs), Nones dropped."""
    return list({id(s): s for s in streams if s is not None}.values())


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _engine_info(engine: Any) -> EngineInfo:
    return EngineInfo(
        max_model_len=engine.max_model_len,
        vocab_size=engine.target.model.config.vocab_size,
        tokenizer=engine.tokenizer,
        api_tokenizer=_thread_copy(engine.tokenizer),
        speculative=engine.proposer is not None,
        num_speculative_tokens=engine.config.num_speculative_tokens if engine.proposer is not None else 0,
        grammars=engine.grammars if engine.tokenizer is not None else None,
        block_size=engine.block_size,
        eos_token_ids=tuple(sorted(engine.eos_token_ids)),
    )


def _thread_copy(tokenizer: Any) -> Any:
    """A copy of `tokenizer` for another thread; the tokenizer itself if it cannot be copied."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - an uncopyable tokenizer is still usable
        return tokenizer


class StepLog:
    """`SPECDEC_STEP_LOG=PREFIX`: every engine loop iteration as one JSON line in
    `PREFIX.<pid>.jsonl` (a replica each): wall time, the seconds spent applying queued commands
    (new requests, imported KV), stepping and handing the deltas out, the rows stepped, each
    sequence's tokens, the timed forwards (draft and verify: rows, seconds) and the Python garbage
    collector's pauses since the last line. What
    `git show 7336cd4c7a51:docs/results/issue36/steps.py` reads to tell slow steps from stalls around them."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)
        self._gc: list[tuple[int, float]] = []
        self._gc_started = 0.0

        def pause(phase: str, info: dict) -> None:
            if phase == "start":
                self._gc_started = time.perf_counter()
            else:
                self._gc.append((info["generation"], time.perf_counter() - self._gc_started))

        gc.callbacks.append(pause)

    @classmethod
    def from_env(cls) -> StepLog | None:
        import os

        prefix = os.environ.get(STEP_LOG_ENV)
        return cls(f"{prefix}.{os.getpid()}.jsonl") if prefix else None

    def write(self, engine: Any, deltas: list, commands: int, apply_s: float, step_s: float, rest_s: float) -> None:
        import json

        gc_pauses, self._gc = self._gc, []
        timings = getattr(engine, "timings", None)
        forwards = {} if timings is None or not timings.enabled else {
            "draft": [[rows, round(s, 4)] for rows, s in timings.draft], "verify": [[rows, round(s, 4)] for rows, s in timings.verify]}
        self._file.write(json.dumps({**forwards,
            "t": round(time.time(), 4), "commands": commands, "apply_s": round(apply_s, 4), "step_s": round(step_s, 4),
            "rest_s": round(rest_s, 4), "rows": getattr(engine, "num_scheduled", None),
            "tokens": [len(d.token_ids) for d in deltas], "gc": [[g, round(s, 4)] for g, s in gc_pauses],
        }) + "\n")
