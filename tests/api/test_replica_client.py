"""The ingress's side of the replicas (`ReplicaEngine`) over a fake deployment handle, without Ray:
retry once before any token, an error (never a hang) after one, a routing timeout, abort."""

from __future__ import annotations

import asyncio

import pytest

from specdec.api.cluster.client import ReplicaEngine
from specdec.api.cluster.ledger import RoutingLedger
from specdec.api.cluster.replica import Accepted, ReplicaFacts, TransferCounters
from specdec.api.engine_loop import EngineDeadError, GenerationRequest, RequestFailedError
from specdec.cache.block_pool import prefix_block_keys
from specdec.sampling_params import SamplingParams
from specdec.sequence import StepDelta


class ReplicaDied(Exception):
    """Stands for Ray's ActorDiedError."""


def delta(rid: str, tokens: list[int], finished: bool = False, cached: int = 0) -> StepDelta:
    return StepDelta(rid, tokens, [], "x" * len(tokens), 0, 0, finished, "length" if finished else None,
                     num_cached_tokens=cached)


class FakeResponse:
    def __init__(self, script: list, hint) -> None:
        self.script, self.hint, self.cancelled = list(script), hint, False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for step in self.script:
            if isinstance(step, float):
                await asyncio.sleep(step)
            elif isinstance(step, BaseException):
                raise step
            else:
                if any(isinstance(i, Accepted) for i in step):
                    self.hint.replica_id = step[0].replica_id  # as the router's on_request_routed does
                yield step

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """`handle.options(stream=True).generate.remote(requests, routing=hint)` plays one script per call."""

    def __init__(self, *scripts: list) -> None:
        self.scripts = list(scripts)
        self.hints, self.responses = [], []
        self.generate = self
        self.describe = self

    def options(self, stream: bool):
        return self

    def remote(self, requests=None, routing=None):
        if requests is None:  # describe
            async def facts():
                return ReplicaFacts(max_model_len=64, vocab_size=100, block_size=4, tokenizer=None,
                                    eos_token_ids=(1,), speculative=True, num_speculative_tokens=3)
            return facts()
        self.hints.append(routing)
        response = FakeResponse(self.scripts.pop(0), routing)
        self.responses.append(response)
        return response


def request(rid: str = "r") -> GenerationRequest:
    return GenerationRequest(rid, list(range(10)), SamplingParams(max_tokens=4))


async def started(handle: FakeHandle, **kwargs) -> ReplicaEngine:
    engine = ReplicaEngine(handle, ledger=RoutingLedger(), **kwargs)
    engine.start()
    await engine._describe_task
    return engine


async def drain(stream) -> tuple[list[StepDelta], BaseException | None]:
    out = []
    try:
        async for d in stream:
            out.append(d)
    except Exception as exc:  # noqa: BLE001
        return out, exc
    return out, None


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_request_streams_and_is_counted_per_replica():
    async def go():
        handle = FakeHandle([[Accepted("a")], [delta("r", [5, 6])], [delta("r", [7], True, cached=8)]])
        engine = await started(handle)
        deltas, error = await drain(engine.submit_all([request()]))
        assert error is None and [d.token_ids for d in deltas] == [[5, 6], [7]]
        assert handle.hints[0].keys and len(handle.hints[0].keys) == 2  # 10 prompt tokens, blocks of 4
        status = engine.ledger.status()
        assert status["retries"] == 0
        return engine

    engine = run(go())
    assert engine.ledger.cached_tokens["a"] == 8 and engine.ledger.requests["a"] == 1


def test_a_replica_dying_before_the_first_token_is_retried_once_elsewhere():
    async def go():
        handle = FakeHandle([[Accepted("a")], ReplicaDied("actor died")],
                            [[Accepted("b")], [delta("r", [5], True)]])
        engine = await started(handle)
        deltas, error = await drain(engine.submit_all([request()]))
        assert error is None and deltas[-1].finished
        assert handle.hints[1].avoid == "a"
        assert engine.ledger.retries == 1

    run(go())


def test_only_one_retry():
    async def go():
        handle = FakeHandle([[Accepted("a")], ReplicaDied("one")], [[Accepted("b")], ReplicaDied("two")])
        engine = await started(handle)
        deltas, error = await drain(engine.submit_all([request()]))
        assert deltas == [] and isinstance(error, RequestFailedError) and "2 replicas" in str(error)

    run(go())


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error():
    async def go():
        handle = FakeHandle([[Accepted("a")], [delta("r", [5])], ReplicaDied("actor died")])
        engine = await started(handle)
        deltas, error = await drain(engine.submit_all([request()]))
        assert len(deltas) == 1 and isinstance(error, RequestFailedError) and "while streaming" in str(error)
        assert engine.ledger.stream_errors == 1 and engine.ledger.retries == 0
        assert len(handle.responses) == 1  # not sent again: the client has tokens already

    run(go())


def test_a_dead_engine_before_any_token_is_retried_and_a_refusal_is_not():
    async def go():
        handle = FakeHandle([[Accepted("a")], [EngineDeadError("gone")]], [[Accepted("b")], [delta("r", [1], True)]],
                            [[Accepted("a")], [ValueError("prompt too long")]])
        engine = await started(handle)
        _, error = await drain(engine.submit_all([request()]))
        assert error is None
        _, error = await drain(engine.submit_all([request("s")]))
        assert isinstance(error, ValueError) and len(handle.responses) == 3

    run(go())


def test_no_replica_taking_the_request_times_out():
    async def go():
        handle = FakeHandle([60.0])
        engine = await started(handle, route_timeout_s=0.2)
        _, error = await drain(engine.submit_all([request()]))
        assert isinstance(error, EngineDeadError) and "within" in str(error)
        assert handle.responses[0].cancelled and engine.queue_depth == 0

    run(go())


def test_abort_cancels_the_replica_stream():
    async def go():
        handle = FakeHandle([[Accepted("a")], [delta("r", [5])], 60.0])
        engine = await started(handle)
        stream = engine.submit_all([request()])
        await stream.__anext__()
        engine.abort("r")
        await asyncio.sleep(0.05)
        assert handle.responses[0].cancelled and engine.ledger.active == {}

    run(go())


def test_not_ready_is_refused_at_once():
    engine = ReplicaEngine(FakeHandle(), ledger=RoutingLedger())
    with pytest.raises(EngineDeadError, match="ready"):
        engine.submit_all([request()])


class StallingEngine:
    def __init__(self, error=None, step_seconds=0.0) -> None:
        self.error, self._step = error, step_seconds

    def step_seconds(self) -> float:
        return self._step

    def shutdown(self, timeout: float = 1.0) -> None:
        pass


def bare_replica(engine, stall_timeout_s: float = 300.0):
    """An EngineReplica without Ray (its constructor is Ray Serve's async one)."""
    from specdec.api.cluster.replica import EngineReplica

    replica = object.__new__(EngineReplica)
    replica.engine, replica.stall_timeout_s, replica.replica_id, replica._reports = engine, stall_timeout_s, "x", 0
    replica.role, replica.transfers, replica._prefill = "both", TransferCounters(), None
    return replica


def test_the_health_check_fails_on_a_dead_loop_or_a_stalled_step():
    bare_replica(StallingEngine(step_seconds=5.0), stall_timeout_s=10.0).check_health()
    with pytest.raises(RuntimeError, match="has run for 12s"):
        bare_replica(StallingEngine(step_seconds=12.0), stall_timeout_s=10.0).check_health()
    with pytest.raises(RuntimeError, match="died"):
        bare_replica(StallingEngine(error="boom")).check_health()


def test_a_replica_streams_accepted_then_deltas_and_frees_blocks_when_cancelled():
    from specdec.api.engine_loop import AsyncEngine
    from specdec.testing import tiny_serving_engine

    async def go():
        engine = AsyncEngine(tiny_serving_engine())
        engine.publish_keys = True
        engine.start()
        await asyncio.to_thread(engine.ready.wait)
        replica = bare_replica(engine)
        prompt = list(range(3, 40))
        full = [item async for batch in replica.generate(
            [GenerationRequest("a", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))])
            for item in batch]
        assert full[0] == Accepted("x") and sum(len(d.token_ids) for d in full[1:]) == 5 and full[-1].finished
        stats = replica.record_routing_stats()
        assert stats["replica_id"] == "x" and set(prefix_block_keys(prompt, 8)) <= set(stats["keys"])
        # a stream dropped mid-way (the client left): its blocks come back
        long = replica.generate([GenerationRequest("b", prompt, SamplingParams(max_tokens=200, ignore_eos=True))])
        assert isinstance((await long.__anext__())[0], Accepted)
        await long.__anext__()
        await long.aclose()
        for _ in range(50):  # far less than 200 tokens take
            if engine.snapshot.kv_usage["target"]["used"] == 0 and engine.snapshot.num_running == 0:
                break
            await asyncio.sleep(0.002)
        assert engine.snapshot.kv_usage["target"]["used"] == 0
        engine.shutdown()

    run(go())
