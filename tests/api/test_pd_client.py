"""The ingress's half of prefill/decode disaggregation (`PDReplicaEngine`) and the decode replica's
pull, over fake handles, without Ray: the first token streams from the prefill replica and the
decode replica resumes after it with the ticket; a prefill replica that fails before a token leaves
the whole request to a decode replica, one that fails after it a resume without a ticket; a pull
that fails costs a recompute; replicas that differ refuse to start, naming the field."""

from __future__ import annotations

import asyncio

import pytest

from specdec.api.cluster.ledger import RoutingLedger
from specdec.api.cluster.pd import PDReplicaEngine
from specdec.api.cluster.replica import Accepted, Handoff, ReplicaFacts, TransferCounters
from specdec.handoff import HandoffTicket

from .test_replica_client import FakeHandle, ReplicaDied, delta, drain, request, run

TICKET = HandoffTicket("lease-1", 10, {"target": (b"k" * 16,), "draft": (b"k" * 16,)}, "c")


class RecordingHandle(FakeHandle):
    """Also keeps the requests each call sent, and the releases (with the client request they were
    made in: Ray Serve cancels the calls a request makes when the request is cancelled)."""

    def __init__(self, *scripts: list) -> None:
        super().__init__(*scripts)
        self.sent: list[list] = []
        self.released: list[tuple] = []
        self.release = self

    def remote(self, requests=None, *lease, routing=None):
        if isinstance(requests, str):  # release(request_id, lease_id, routing=pin)
            self.released.append((requests, *lease, routing.pin, _client_request()))
            return None
        if requests is not None:
            self.sent.append(requests)
        return super().remote(requests, routing)


def _client_request() -> str | None:
    """The Ray Serve request a call is made in (its child: cancelled with it); None: none."""
    try:
        from ray.serve.context import _serve_request_context
    except ImportError:
        return None
    context = _serve_request_context.get()
    return context._internal_request_id or None if context is not None else None


async def started(decode: FakeHandle, prefill: FakeHandle) -> PDReplicaEngine:
    engine = PDReplicaEngine(decode, prefill, ledger=RoutingLedger())
    engine.start()
    await engine._describe_task
    return engine


async def released(engine: PDReplicaEngine) -> None:
    """Wait for the releases the engine sent in the background."""
    if engine._releases:
        await asyncio.wait(set(engine._releases), timeout=5)


def test_the_first_token_streams_from_prefill_and_decode_resumes_with_the_ticket():
    async def go():
        prefill = RecordingHandle([[Accepted("p")], [delta("r", [5]), Handoff("r", "p", TICKET)]])
        decode = RecordingHandle([[Accepted("d")], [delta("r", [6, 7]), delta("r", [8], True)]])
        engine = await started(decode, prefill)
        deltas, error = await drain(engine.submit_all([request()]))
        assert error is None and [d.token_ids for d in deltas] == [[5], [6, 7], [8]]
        assert prefill.sent[0][0].handoff and not decode.sent[0][0].handoff
        resumed = decode.sent[0][0]
        assert resumed.generated == [5] and resumed.ticket == TICKET and resumed.prefill_replica == "p"

    run(go())


def test_a_client_leaving_while_ray_cancels_the_prefill_call_frees_the_lease_and_decodes_nothing():
    """Ray Serve cancels a request's calls when the client leaves: the prefill stream then raises
    RequestCancelledError (also when our own task cancel lands while it is awaited). That is the
    client leaving, not a failed prefill replica: the pump ends, the lease is released on the
    replica that holds it, and no decode replica is asked (CI once saw the lease expire instead)."""
    RequestCancelledError = pytest.importorskip("ray.serve.exceptions").RequestCancelledError

    async def go():
        prefill = RecordingHandle([[Accepted("p")], [delta("r", [5]), Handoff("r", "p", TICKET)], 0.05,
                                   RequestCancelledError("r")])
        decode = RecordingHandle([[Accepted("d")], [delta("r", [6], True)]])
        engine = await started(decode, prefill)
        stream = engine.submit_all([request()])
        first = await stream.__anext__()
        assert first.token_ids == [5]
        task = engine._tasks["r"]
        await asyncio.wait([task], timeout=5)
        assert task.cancelled()
        assert decode.sent == []  # no decode replica was asked
        await released(engine)
        assert prefill.released == [("r", TICKET.lease_id, "p", None)]  # on the replica holding the lease

    run(go())


def test_a_client_leaving_while_the_decode_replica_waits_releases_the_lease_outside_the_clients_request():
    """The client leaves after the first token, while the decode replica waits to pull: the
    release goes to the prefill replica holding the lease, made outside the client's request (in
    it, Ray Serve cancelled the release with the request, and CI saw the lease expire instead)."""
    context = pytest.importorskip("ray.serve.context")

    async def go():
        prefill = RecordingHandle([[Accepted("p")], [delta("r", [5]), Handoff("r", "p", TICKET)]])
        decode = RecordingHandle([[Accepted("d")], 30.0, [delta("r", [6], True)]])
        engine = await started(decode, prefill)
        # as on the ingress replica: the calls made while serving the client's request are its children
        context._serve_request_context.set(context._RequestContext(_internal_request_id="client-request"))
        stream = engine.submit_all([request()])
        first = await stream.__anext__()
        assert first.token_ids == [5]
        await asyncio.sleep(0.05)  # the decode replica has it and waits
        assert decode.sent[0][0].ticket == TICKET
        task = engine._tasks["r"]
        engine.abort("r")
        await asyncio.wait([task], timeout=5)
        assert task.cancelled() and decode.responses[0].cancelled
        await released(engine)
        assert prefill.released == [("r", TICKET.lease_id, "p", None)]

    run(go())


def test_a_prefill_replica_failing_before_a_token_leaves_the_request_to_a_decode_replica():
    async def go():
        prefill = RecordingHandle([[Accepted("p")], ReplicaDied("gone")])
        decode = RecordingHandle([[Accepted("d")], [delta("r", [5, 6]), delta("r", [7], True)]])
        engine = await started(decode, prefill)
        deltas, error = await drain(engine.submit_all([request()]))
        assert error is None and [t for d in deltas for t in d.token_ids] == [5, 6, 7]
        assert decode.sent[0][0].generated is None and decode.sent[0][0].ticket is None

    run(go())


def test_a_prefill_replica_failing_after_the_first_token_is_resumed_without_a_ticket():
    async def go():
        prefill = RecordingHandle([[Accepted("p")], [delta("r", [5])], ReplicaDied("gone")])
        decode = RecordingHandle([[Accepted("d")], [delta("r", [6], True)]])
        engine = await started(decode, prefill)
        deltas, error = await drain(engine.submit_all([request()]))
        assert error is None and [t for d in deltas for t in d.token_ids] == [5, 6]
        assert decode.sent[0][0].generated == [5] and decode.sent[0][0].ticket is None

    run(go())


def test_an_answer_finished_on_the_prefill_replica_never_reaches_a_decode_replica():
    async def go():
        prefill = RecordingHandle([[Accepted("p")], [delta("r", [5], True)]])
        decode = RecordingHandle()
        engine = await started(decode, prefill)
        deltas, error = await drain(engine.submit_all([request()]))
        assert error is None and deltas[-1].finished and decode.sent == []

    run(go())


class FailingPrefill:
    """A prefill handle whose pulls fail as a dead replica's would."""

    def __init__(self) -> None:
        self.pull = self

    def remote(self, *args, **kwargs):
        async def fail():
            raise ReplicaDied("the prefill replica died")
        return fail()


def decode_replica(engine, prefill) -> object:
    from specdec.api.cluster.replica import EngineReplica
    from specdec.handoff import compat_digest

    replica = object.__new__(EngineReplica)
    replica.engine, replica.replica_id, replica._reports, replica.role = engine, "d", 0, "decode"
    replica._prefill, replica.transfers, replica.pull_timeout_s, replica.pull_delay_s = prefill, TransferCounters(), 5, 0
    replica.compat = engine.engine.compat
    replica._compat_digest = compat_digest(replica.compat)
    return replica


def test_a_failed_pull_recomputes_the_prompt_and_answers_the_same():
    from specdec.api.engine_loop import AsyncEngine, GenerationRequest
    from specdec.handoff import compat_digest
    from specdec.sampling_params import SamplingParams
    from specdec.testing import tiny_serving_engine

    reference = tiny_serving_engine(adaptive_k=False)
    prompt = list(range(3, 43))
    params = SamplingParams(max_tokens=10, temperature=0.0)
    expected = reference.generate([prompt], params)[0].token_ids

    async def go():
        engine = AsyncEngine(tiny_serving_engine(adaptive_k=False))
        engine.start()
        await asyncio.to_thread(engine.ready.wait)
        replica = decode_replica(engine, FailingPrefill())
        ticket = HandoffTicket("lease", len(prompt), {"target": (b"k" * 16,)}, compat_digest(replica.compat))
        items = [item async for batch in replica.generate([GenerationRequest(
            "r", prompt, params, generated=expected[:1], ticket=ticket, prefill_replica="p")]) for item in batch]
        assert [t for d in items[1:] for t in d.token_ids] == expected[1:]
        assert replica.transfers.recomputed == 1 and replica.transfers.errors == {"ReplicaDied": 1}
        engine.shutdown()

    run(go())


def test_replicas_that_differ_refuse_to_start_naming_the_field():
    from specdec.api.engine_loop import AsyncEngine
    from specdec.testing import tiny_serving_engine

    class Describe:
        def __init__(self, compat: dict) -> None:
            self.describe, self.compat = self, compat

        def remote(self):
            async def facts():
                return ReplicaFacts(64, 100, 8, None, (1,), True, 4, "prefill", self.compat)
            return facts()

    async def go():
        engine = AsyncEngine(tiny_serving_engine())
        engine.start()
        await asyncio.to_thread(engine.ready.wait)
        other = tiny_serving_engine(block_size=16).compat
        replica = decode_replica(engine, Describe(other))
        with pytest.raises(RuntimeError, match="differ in block_size: 8 vs 16"):
            await replica._check_prefill_compat()
        replica._prefill = Describe(dict(engine.engine.compat))
        await replica._check_prefill_compat()
        engine.shutdown()

    run(go())
