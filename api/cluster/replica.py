"""One engine replica: the body of the Ray Serve deployment that holds an Engine.

It runs the same engine loop as a single server (`AsyncEngine`: one thread owns the Engine), and
speaks to the ingress in plain picklable items:

- `generate(requests)` streams lists of items: first `Accepted(replica_id)` (the request reached
  this replica), then `StepDelta`s as steps make them, or one exception (`ValueError` for a request
  the engine refused, `RequestFailedError`, `EngineDeadError`) that ends the stream. Cancelling the
  stream (the client went away) aborts the requests and frees their blocks.
- `record_routing_stats()` (called by Ray Serve every `request_routing_stats_period_s`) reports
  the keys of the blocks the target's prefix cache holds, so the router learns what each replica
  holds (evictions included) from the replica itself, plus counters for /metrics.
- `check_health()` (called by Ray Serve) fails when the engine loop died or one step has run
  longer than `stall_timeout_s`: Ray then replaces the replica.

Prefill/decode disaggregation (`role`): a prefill replica's requests end after their first token
with a `Handoff` item (the lease's ticket), and `pull(lease_id, wanted)` hands the leased blocks'
bytes over once (then frees them). A decode replica, given a request with a ticket, pulls the
blocks its pools lack from the prefill replica that holds them (through `prefill_handle`, pinned
to that replica) and resumes the request on them; a pull that fails or times out costs a
recompute of the prompt, never the request. `pd.py` is the ingress's half.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.api.engine_loop import AsyncEngine, EngineDeadError, GenerationRequest, RequestFailedError
from specdec.handoff import HandoffTicket, KVPayload, compat_digest, compat_mismatch

logger = logging.getLogger("specdec.api")

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class Accepted:
    """The first item of every stream: which replica took the request."""

    replica_id: str


@dataclass(frozen=True)
class Handoff:
    """A prefill replica's last item for a request: where its KV waits to be pulled."""

    request_id: str
    replica_id: str
    ticket: HandoffTicket


@dataclass
class TransferCounters:
    """What a replica moved: pulls made (decode side) and served (prefill side)."""

    pulls: int = 0  # decode: pulls that returned blocks
    blocks: int = 0  # decode: blocks received
    bytes: int = 0  # decode: bytes received
    seconds: float = 0.0  # decode: wall time of the pulls (request sent -> bytes here)
    recomputed: int = 0  # decode: handed-over requests whose pull failed (the prompt is recomputed)
    skipped_blocks: int = 0  # decode: ticket blocks not pulled, the pools held them already
    served: int = 0  # prefill: pulls answered
    bytes_sent: int = 0  # prefill
    leases_granted: int = 0  # prefill
    errors: dict[str, int] = field(default_factory=dict)  # decode: why pulls failed

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ReplicaFacts:
    """What the ingress needs to know of the engine behind the replicas (all replicas are alike)."""

    max_model_len: int
    vocab_size: int
    block_size: int
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    speculative: bool
    num_speculative_tokens: int
    role: str = "both"
    compat: dict[str, str] = field(default_factory=dict)  # `handoff.compat_fields` of its engine


class EngineReplica:
    """Builds its engine with `engine_factory` (a picklable zero-argument callable returning an
    Engine) on the engine thread, and is ready once the engine is loaded (and warmed up).

    A decode replica (`role="decode"`, with `prefill_handle`) refuses to start when the prefill
    replicas' engine differs from its own in anything a handoff depends on (the field is named)."""

    async def __init__(self, engine_factory: Callable[[], Any], warmup: bool = False,
                       stall_timeout_s: float = 300.0, step_delay_s: float = 0.0, role: str = "both",
                       prefill_handle: Any = None, lease_timeout_s: float = 30.0,
                       pull_timeout_s: float = 30.0, pull_delay_s: float = 0.0, nice: int = 0) -> None:
        from specdec.warmup import warm_up

        if role not in ROLES:
            raise ValueError(f"unknown replica role {role!r}; choose one of {', '.join(ROLES)}")

        if nice:  # a prefill replica yields the cores to the decode replicas' steps where they compete
            os.nice(nice)
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit():  # set per replica by `build_app`; torch reads it only at import
            import torch

            torch.set_num_threads(int(threads))
        if step_delay_s > 0:  # slow steps on purpose: fault tests and demos kill a replica mid-request
            engine_factory = _paced(engine_factory, step_delay_s)
        self.replica_id = _replica_id()
        self.stall_timeout_s = stall_timeout_s
        self.role, self.pull_timeout_s = role, pull_timeout_s
        self.pull_delay_s = pull_delay_s  # wait before each pull (fault drills: kill the prefill replica meanwhile)
        self._prefill = prefill_handle
        self.transfers = TransferCounters()
        self.engine = AsyncEngine(engine_factory, warmup=warm_up if warmup else None)
        self.engine.publish_keys = True
        self.engine.start()
        await asyncio.to_thread(self.engine.ready.wait)
        if self.engine.error is not None:
            raise RuntimeError(f"replica {self.replica_id}: {self.engine.error}")
        self.engine.engine.leases.timeout_s = lease_timeout_s
        self.compat = self.engine.engine.compat
        self._compat_digest = compat_digest(self.compat)
        self._reports = 0
        if prefill_handle is not None:
            await self._check_prefill_compat()

    async def _check_prefill_compat(self) -> None:
        facts = await self._prefill.describe.remote()
        mismatch = compat_mismatch(self.compat, facts.compat)
        if mismatch is not None:
            raise RuntimeError(f"the prefill and decode replicas cannot hand KV over: they differ in {mismatch}")

    async def describe(self) -> ReplicaFacts:
        info = self.engine.info
        return ReplicaFacts(
            max_model_len=info.max_model_len, vocab_size=info.vocab_size, block_size=info.block_size,
            tokenizer=info.tokenizer, eos_token_ids=info.eos_token_ids,
            speculative=info.speculative, num_speculative_tokens=info.num_speculative_tokens,
            role=self.role, compat=self.compat,
        )

    async def generate(self, requests: list[GenerationRequest], routing: Any = None) -> AsyncIterator[list]:
        """Stream the requests' deltas in batches (everything queued since the last batch);
        `routing` is the router's hint (unused here). Handed-over requests (with a ticket) first
        pull the blocks they need; a handoff request's last delta becomes a `Handoff` item."""
        if self.engine.error is not None:
            yield [EngineDeadError(self.engine.error)]
            return
        yield [Accepted(self.replica_id)]
        if any(r.ticket is not None for r in requests):
            pulled: dict[str, set[bytes]] = {}  # per pool (n > 1: the choices share their prompt's blocks)
            requests = [await self._pulled(r, pulled) if r.ticket is not None else r for r in requests]
        try:
            stream = self.engine.submit_all(requests)
        except EngineDeadError as exc:
            yield [exc]
            return
        leases: list[str] = []  # granted in this stream
        delivered = False
        try:
            while not stream.finished:
                batch = [await stream.__anext__()]
                while not stream.finished and not stream.queue.empty():
                    batch.append(await stream.__anext__())
                items = [item for delta in batch for item in self._handoff_items(delta)]
                leases += [item.ticket.lease_id for item in items if isinstance(item, Handoff)]
                yield items
            delivered = True
        except (EngineDeadError, RequestFailedError, ValueError) as exc:
            yield [exc]
        finally:  # cancelled (the client left) or failed: free the blocks at once
            if not stream.finished:
                for request in requests:
                    self.engine.abort(request.request_id)
            if not delivered:  # nobody will pull these
                for lease_id in leases:
                    self.engine.release_lease(lease_id)

    async def release(self, request_id: str, lease_id: str | None = None, routing: Any = None) -> None:
        """Free what a request handed over (its lease) or is still prefilling: its client left.
        `routing` pins the call to this replica."""
        if lease_id is not None:
            self.engine.release_lease(lease_id)
        self.engine.abort(request_id)  # a lease whose ticket never left here is freed by its request id

    def _handoff_items(self, delta: Any) -> list:
        """A delta; a handoff's last delta -> the delta (not finished: a decode replica goes on)
        and the `Handoff`."""
        if delta.finish_reason != "handoff":
            return [delta]
        self.transfers.leases_granted += 1
        ticket = delta.handoff
        delta.finished, delta.finish_reason, delta.handoff, delta.stats = False, None, None, None
        return [delta, Handoff(delta.request_id, self.replica_id, ticket)]

    async def pull(self, lease_id: str, wanted: dict[str, list[bytes]] | None = None, routing: Any = None) -> KVPayload:
        """A prefill replica's leased blocks (the `wanted` keys per pool; None: all), once: the
        lease is freed after. `routing` pins the call to this replica (`RoutingHint.pin`).
        UnknownLeaseError when it is not here (never granted, already pulled, expired)."""
        engine = self.engine.engine
        try:
            payload = await asyncio.to_thread(engine.export_kv, lease_id, wanted)
        finally:
            self.engine.release_lease(lease_id)
        self.transfers.served += 1
        self.transfers.bytes_sent += payload.nbytes
        return payload

    async def _pulled(self, request: GenerationRequest, pulled: dict[str, set[bytes]]) -> GenerationRequest:
        """The request with the blocks it lacks pulled from its prefill replica (`payload`);
        without them (the pull failed: the prompt is recomputed here) when that fails."""
        from specdec.api.cluster.routing import RoutingHint

        ticket: HandoffTicket = request.ticket
        request.ticket = None
        try:
            if self._prefill is None:
                raise RuntimeError("this replica has no prefill replicas to pull from")
            if ticket.compat != self._compat_digest:
                raise RuntimeError("the ticket comes from an engine that differs from this one")
            wanted = {pool: [k for k in keys if k not in pulled.get(pool, ())]
                      for pool, keys in self.engine.engine.missing_keys(ticket).items()}
            have = sum(len(keys) for keys in ticket.keys.values()) - sum(len(keys) for keys in wanted.values())
            self.transfers.skipped_blocks += have
            if self.pull_delay_s > 0:
                await asyncio.sleep(self.pull_delay_s)
            started = time.perf_counter()
            hint = RoutingHint(pin=request.prefill_replica)
            payload = await asyncio.wait_for(self._prefill.pull.remote(ticket.lease_id, wanted, routing=hint),
                                             self.pull_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a dead or slow prefill replica, an expired lease
            kind = type(exc).__name__
            self.transfers.recomputed += 1
            self.transfers.errors[kind] = self.transfers.errors.get(kind, 0) + 1
            logger.warning("pulling %s's KV from %s failed (%s: %s); recomputing its prompt here",
                           request.request_id, request.prefill_replica, kind, str(exc).splitlines()[0] if str(exc) else "")
            return request
        self.transfers.pulls += 1
        self.transfers.seconds += time.perf_counter() - started
        self.transfers.blocks += payload.num_blocks
        self.transfers.bytes += payload.nbytes
        for pool, (keys, _) in payload.blocks.items():
            pulled.setdefault(pool, set()).update(keys)
        request.payload = payload
        return request

    def record_routing_stats(self) -> dict[str, Any]:
        snap = self.engine.snapshot
        self._reports += 1
        return {
            "replica_id": self.replica_id, "report": self._reports, "time": time.time(),
            "keys": snap.cached_keys, "kv_usage": snap.kv_usage, "prefix_cache": snap.prefix_cache,
            "num_waiting": snap.num_waiting, "num_running": snap.num_running, "acceptance": snap.acceptance,
            "role": self.role, "transfers": self.transfers.as_dict(),
            "leases_held": len(self.engine.engine.leases), "leases_expired": self.engine.engine.leases.num_expired,
            "kv_imported_blocks": self.engine.kv_imported_blocks, "nice": os.getpriority(os.PRIO_PROCESS, 0),
        }

    def check_health(self) -> None:
        if self.engine.error is not None:
            raise RuntimeError(f"the engine loop died: {self.engine.error}")
        stalled = self.engine.step_seconds()
        if stalled > self.stall_timeout_s:
            raise RuntimeError(f"one engine step has run for {stalled:.0f}s (> {self.stall_timeout_s:.0f}s)")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=1.0)


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Ray Serve (unit use): a random id
        import secrets

        return secrets.token_hex(4)


def _paced(factory: Callable[[], Any], delay_s: float) -> Callable[[], Any]:
    from specdec.testing import pace_steps

    return lambda: pace_steps(factory(), delay_s)
