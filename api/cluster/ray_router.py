"""The adapter between Ray Serve's request-router API (alpha in Ray 2.60: `ray.serve.request_router`)
and our scoring (`routing.PrefixPolicy`). Everything Ray-specific about routing is here.

Ray Serve builds one `SpecdecRouter` inside each deployment handle (so in the ingress process) and
calls `choose_replicas` for every request sent through the handle; the keyword argument `routing`
of `EngineReplica.generate` carries the `RoutingHint` (the prompt's block keys). Each replica's
`record_routing_stats()` report arrives as `RunningReplica.routing_stats`.

Ray pickles this module *by value* to ship the router class, so it holds no state of its own at
module level: the shared state is `ledger.LEDGER`, reached through the module (pickled by name).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from specdec.api.cluster import ledger
from specdec.api.cluster.routing import PrefixPolicy, PrefixPolicyConfig, RoutingHint


class SpecdecRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "prefix", **config: Any) -> None:
        """`config`: `PrefixPolicyConfig`'s fields (balance_abs, balance_rel, min_match)."""
        self._policy = PrefixPolicy(policy, PrefixPolicyConfig(**config))
        self._seen_reports: dict[str, Any] = {}
        self._mine: set[str] = set()  # this deployment's replicas (the ledger may hold another's too)
        self._running: list[RunningReplica] = []  # (RequestRouter owns `_replicas`)
        ledger.LEDGER.refreshers.append(lambda: self._refresh(self._running))
        self._routed: dict[str, str] = {}  # Ray's internal request id -> replica id
        ledger.LEDGER.policy = policy

    def _refresh(self, replicas: list[RunningReplica]) -> list:
        """The ledger's views of `replicas`, with any new report applied (call with the lock held)."""
        views = []
        for replica in replicas:
            replica_id = replica.replica_id.unique_id
            view = ledger.LEDGER.view(replica_id)
            stats = replica.routing_stats or {}
            report = (stats.get("replica_id"), stats.get("report"))
            if stats.get("keys") is not None and self._seen_reports.get(replica_id) != report:
                self._seen_reports[replica_id] = report
                view.report(stats["keys"], stats)
            views.append(view)
        return views

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hint = _hint(pending_request)
        with ledger.LEDGER.lock:
            views = self._refresh(candidate_replicas)
            decision = self._policy.choose(views, hint)
        hint.reason, hint.matched_blocks = decision.reason, decision.matched_blocks
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = [by_id[replica_id] for replica_id in decision.ranked]
        return [ranked[:1], ranked[1:]] if len(ranked) > 1 else [ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        hint = _hint(pending_request)
        rid = replica_id.unique_id
        hint.replica_id = rid
        with ledger.LEDGER.lock:
            view = ledger.LEDGER.view(rid)
            view.in_flight += 1
            view.predict(hint.keys, self._policy.config.max_predicted)
            if hint.reason not in (None, "pinned") and _is_generation(pending_request):  # not describe, pulls
                ledger.LEDGER.decisions[hint.reason] += 1
        self._routed[pending_request.metadata.internal_request_id] = rid

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._routed.pop(internal_request_id, None)
        if rid is None:
            return
        with ledger.LEDGER.lock:
            view = ledger.LEDGER.views.get(rid)
            if view is not None and view.in_flight > 0:
                view.in_flight -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        ledger.LEDGER.forget([replica_id.unique_id])

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._running = list(replicas)
        alive = {r.replica_id.unique_id for r in replicas}
        with ledger.LEDGER.lock:
            gone = [rid for rid in self._mine if rid not in alive]
            self._mine = set(alive)
            for rid in alive:  # /cluster lists every running replica, routed to yet or not
                ledger.LEDGER.view(rid)
        ledger.LEDGER.forget(gone)


def _is_generation(pending_request: PendingRequest | None) -> bool:
    return pending_request is not None and isinstance(pending_request.kwargs.get("routing"), RoutingHint)


def _hint(pending_request: PendingRequest | None) -> RoutingHint:
    hint = pending_request.kwargs.get("routing") if pending_request is not None else None
    return hint if isinstance(hint, RoutingHint) else RoutingHint()
