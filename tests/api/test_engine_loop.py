"""The engine loop: one thread owns the Engine, sleeps when idle, and delivers deltas in order."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from specdec.api.engine_loop import AsyncEngine, EngineDeadError, GenerationRequest
from specdec.sampling_params import SamplingParams

from .conftest import chat_body


class RecordingEngine:
    """Delegates to a real engine and records which threads call it, and how often."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.threads: set[int] = set()
        self.calls = 0

    def __getattr__(self, name):
        attr = getattr(self._engine, name)
        if not callable(attr):
            return attr

        def recorded(*args, **kwargs):
            self.threads.add(threading.get_ident())
            self.calls += 1
            return attr(*args, **kwargs)

        return recorded


def _request(rid: str, max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(rid, [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def test_deltas_arrive_in_order_and_idle_loop_sleeps(make_engine):
    recording = RecordingEngine(make_engine())

    async def scenario():
        engine = AsyncEngine(recording)
        engine.start()
        await asyncio.to_thread(engine.ready.wait, 10)
        streams = [engine.submit(_request(f"r{i}", 10 + i)) for i in range(3)]
        outputs = await asyncio.gather(*(_drain(s) for s in streams))
        await asyncio.sleep(0.05)
        calls_before_idle = recording.calls
        await asyncio.sleep(0.5)
        idle_calls = recording.calls - calls_before_idle
        engine.shutdown()
        return outputs, idle_calls, engine

    outputs, idle_calls, engine = asyncio.run(scenario())
    for i, deltas in enumerate(outputs):
        assert sum(len(d.token_ids) for d in deltas) == 10 + i
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert idle_calls == 0, "an idle engine loop must sleep, not poll the engine"
    assert recording.threads and threading.get_ident() not in recording.threads
    assert len(recording.threads) == 1, "only the engine thread touches the engine"
    assert engine.snapshot.kv_usage["target"]["used"] == 0


async def _drain(stream):
    return [delta async for delta in stream]


def test_bad_request_is_reported_on_its_stream(make_engine):
    async def scenario():
        engine = AsyncEngine(make_engine(max_model_len=16))
        engine.start()
        await asyncio.to_thread(engine.ready.wait, 10)
        stream = engine.submit(GenerationRequest("long", list(range(40)), SamplingParams()))
        try:
            await _drain(stream)
        except ValueError as exc:
            return exc
        finally:
            engine.shutdown()

    assert "prompt has 40 tokens" in str(asyncio.run(scenario()))


def test_shutdown_fails_pending_requests_and_later_submissions(make_engine):
    async def scenario():
        engine = AsyncEngine(make_engine())
        engine.start()
        await asyncio.to_thread(engine.ready.wait, 10)
        stream = engine.submit(_request("long", 400))
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        errors = []
        try:
            await _drain(stream)
        except EngineDeadError as exc:
            errors.append(exc)
        try:
            engine.submit(_request("late"))
        except EngineDeadError as exc:
            errors.append(exc)
        return errors

    assert len(asyncio.run(scenario())) == 2


def test_server_only_touches_the_engine_from_its_thread(serve, make_engine):
    recording = RecordingEngine(make_engine())
    with serve(recording) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            threads = [threading.Thread(target=client.post, args=("/v1/chat/completions",),
                                        kwargs={"json": chat_body(max_tokens=20, temperature=0)}) for _ in range(4)]
            for t in threads:
                t.start()
            with client.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=300, stream=True)) as r:
                next(r.iter_lines())
            for t in threads:
                t.join()
        time.sleep(0.1)
    assert len(recording.threads) == 1 and threading.get_ident() not in recording.threads


def test_submit_all_streams_siblings_together(make_engine):
    """The n choices of one request: one stream carries every sibling's deltas until all finished;
    a prompt the engine refuses fails that stream once."""
    async def scenario():
        engine = AsyncEngine(make_engine(max_model_len=16))
        engine.start()
        await asyncio.to_thread(engine.ready.wait, 10)
        siblings = [_request("lead", 6)] + [
            GenerationRequest(f"lead-{i}", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6 + i,
                              ignore_eos=True), share_prompt_with="lead") for i in (1, 2)]
        deltas = await _drain(engine.submit_all(siblings))
        too_long = [GenerationRequest(rid, list(range(40)), SamplingParams(), share_prompt_with=lead)
                    for rid, lead in (("big", None), ("big-1", "big"))]
        failed, error = engine.submit_all(too_long), None
        try:
            await _drain(failed)
        except ValueError as exc:
            error = exc
        engine.shutdown()
        return deltas, error, failed

    deltas, error, failed = asyncio.run(scenario())
    tokens = {rid: sum(len(d.token_ids) for d in deltas if d.request_id == rid) for rid in ("lead", "lead-1", "lead-2")}
    assert tokens == {"lead": 6, "lead-1": 7, "lead-2": 8}
    assert sum(d.finished for d in deltas) == 3
    assert isinstance(error, ValueError) and failed.finished
