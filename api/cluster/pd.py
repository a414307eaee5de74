"""Prefill/decode disaggregation, the ingress's half: each request runs on a prefill replica, then
on a decode replica (`specdec serve --replicas N --prefill-replicas M`).

    ingress --generate(handoff)--> prefill replica (prefix router: the longest cached prefix)
            <-- first token(s) -----  streamed to the client at once
            <-- Handoff(ticket) ----  the prompt's full blocks of both caches, held under a lease
    ingress --generate(generated, ticket)--> decode replica (prefix router: blocks held, load)
                                               pulls the blocks it lacks from that prefill replica,
                                               resumes speculative decoding after the first token
            <-- the rest of the tokens

What can go wrong, and what happens:
- the prefill replica fails before any token: the decode replica does the whole request;
- it fails after the first token but before the ticket, or the pull fails (dead replica, expired
  lease, timeout): the decode replica recomputes the prompt and goes on after the tokens already
  streamed (`TransferCounters.recomputed`);
- the decode replica fails before streaming: once more on another decode replica; after: the
  stream ends with an error event (as without PD);
- the client leaves: both streams are cancelled and their requests aborted, and the prefill replica
  is asked to free the lease (by a call outside the client's request: Ray Serve cancels that
  request's calls); a lease nobody pulls or frees expires (`--kv-lease-timeout`).

Greedy outputs equal colocated serving's: the decode replica computes exactly the positions the
prefill replica did not (the prompt's partial last block and the first token), on the same kernels.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from dataclasses import replace
from typing import Any

from specdec.api.cluster.client import ReplicaEngine
from specdec.api.cluster.ledger import LEDGER, RoutingLedger
from specdec.api.cluster.replica import Handoff
from specdec.api.cluster.routing import RoutingHint
from specdec.api.engine_loop import GenerationRequest, RequestStream
from specdec.sequence import StepDelta

logger = logging.getLogger("specdec.api")


class PDReplicaEngine(ReplicaEngine):
    """`ReplicaEngine` over two deployments: prefill replicas (`prefill_handle`) and decode
    replicas (`handle`)."""

    def __init__(self, handle: Any, prefill_handle: Any, route_timeout_s: float = 120.0,
                 ledger: RoutingLedger = LEDGER) -> None:
        super().__init__(handle, route_timeout_s, ledger)
        self._prefill = prefill_handle
        self._releases: set[asyncio.Task] = set()

    async def _pump(self, requests: list[GenerationRequest], stream: RequestStream, hint: RoutingHint,
                    sink: Any = None) -> None:
        state = _Handover(requests)
        try:
            await self._prefill_then_decode(requests, stream, hint, state)
        except BaseException:  # the client left: free the leases nobody will pull, now
            self._release(state)
            raise

    async def _prefill_then_decode(self, requests: list[GenerationRequest], stream: RequestStream,
                                   hint: RoutingHint, state: _Handover) -> None:
        prefill_hint = state.prefill_hint = RoutingHint(hint.keys, policy=hint.policy)
        outcome = await self._attempt([replace(r, handoff=True) for r in requests], stream, prefill_hint,
                                      handle=self._prefill, sink=state.from_prefill)
        if outcome.refused:
            return
        if outcome.error is not None:
            logger.warning("prefill replica %s failed (%s); a decode replica goes on with %s",
                           prefill_hint.replica_id, type(outcome.error).__name__, requests[0].request_id)
        left = state.unfinished()
        if not left:
            return
        names = {r.request_id for r in left}
        resumed = [
            replace(r, generated=state.emitted[r.request_id] or None, handoff=False,
                    ticket=state.tickets.get(r.request_id), prefill_replica=state.holders.get(r.request_id),
                    share_prompt_with=r.share_prompt_with if r.share_prompt_with in names else None)
            for r in left
        ]
        decode_hint = RoutingHint(hint.keys, policy=hint.policy)
        await super()._pump(resumed, stream, decode_hint, sink=state.from_decode)

    def _release(self, state: _Handover) -> None:
        """Ask the prefill replica to free the requests' leases, those whose tickets are here and
        those still on their way (by request id); a lease already pulled is gone: a no-op there."""
        holder = state.prefill_hint.replica_id if state.prefill_hint is not None else None
        if holder is None:
            return  # no prefill replica took them
        loop = asyncio.get_running_loop()
        for request in state.requests:
            ticket = state.tickets.get(request.request_id)
            # Made from an empty context, the call belongs to no request: Ray Serve cancels the calls
            # a request makes when that request is cancelled, and the client leaving is exactly that
            # (made in the request's context, a release still being routed was cancelled with it and
            # the lease held its blocks until it expired). Awaited in the background, never dropped.
            release = _release_quietly(self._prefill.release.remote, request.request_id,
                                       ticket.lease_id if ticket else None, holder)
            task = contextvars.Context().run(loop.create_task, release)
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)


async def _release_quietly(release: Any, request_id: str, lease_id: str | None, holder: str) -> None:
    try:
        response = release(request_id, lease_id, routing=RoutingHint(pin=holder))
        if response is not None:
            await response
    except Exception as exc:  # noqa: BLE001 - a dead replica holds nothing
        logger.debug("releasing %s on %s: %s", request_id, holder, exc)


class _Handover:
    """What the prefill replica's stream left for the decode replica, per request."""

    def __init__(self, requests: list[GenerationRequest]) -> None:
        self.requests = requests
        self.emitted: dict[str, list[int]] = {r.request_id: [] for r in requests}
        self.tickets: dict[str, Any] = {}
        self.holders: dict[str, str] = {}  # request id -> the prefill replica holding its lease
        self.cached: dict[str, int] = {}  # prompt tokens the prefill replica found cached
        self.finished: set[str] = set()
        self.prefill_hint: RoutingHint | None = None  # names the prefill replica once one took them

    def from_prefill(self, item: Any) -> bool:
        """Keep tickets; stream deltas that carry tokens (a handoff after the draft's fill has none)."""
        if isinstance(item, Handoff):
            self.tickets[item.request_id] = item.ticket
            self.holders[item.request_id] = item.replica_id
            return False
        if not isinstance(item, StepDelta):
            return True
        self.emitted[item.request_id].extend(item.token_ids)
        self.cached.setdefault(item.request_id, item.num_cached_tokens)
        if item.finished:
            self.finished.add(item.request_id)
        return bool(item.token_ids) or item.finished or bool(item.text)

    def from_decode(self, item: Any) -> bool:
        """The usage's cached tokens are the prefill replica's prefix-cache hit, not the blocks the
        decode replica was handed."""
        if isinstance(item, StepDelta) and item.request_id in self.cached:
            item.num_cached_tokens = self.cached[item.request_id]
        return True

    def unfinished(self) -> list[GenerationRequest]:
        return [r for r in self.requests if r.request_id not in self.finished]
