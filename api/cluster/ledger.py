"""What the ingress process knows of its replicas, shared by the router (which Ray Serve runs in the
ingress's deployment handle, on its own event loop) and the ingress (metrics, /cluster, retries).

One ledger per process (`LEDGER`): an ingress holds one handle to the engine deployment, so one
router. Everything is guarded by one lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from specdec.api.cluster.routing import REASONS, ReplicaView


class RoutingLedger:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.views: dict[str, ReplicaView] = {}  # replica id -> view (the router's)
        self.policy: str | None = None  # the router's default policy, once it exists
        self.decisions: Counter[str] = Counter({reason: 0 for reason in REASONS})
        self.retries = 0  # requests sent again to another replica (no token had been streamed)
        self.stream_errors = 0  # streams cut by a replica failure after tokens were streamed
        self.requests: Counter[str] = Counter()  # per replica: requests it answered
        self.prompt_tokens: Counter[str] = Counter()  # per replica
        self.cached_tokens: Counter[str] = Counter()  # per replica: prompt tokens found in its cache
        self.active: dict[str, str] = {}  # request id -> the replica streaming it
        # each router's "apply the replicas' latest reports" (called with the lock held), so that
        # /cluster and /metrics are current between routed requests
        self.refreshers: list[Callable[[], None]] = []

    def view(self, replica_id: str) -> ReplicaView:
        """The replica's view, created on first sight (call with the lock held)."""
        view = self.views.get(replica_id)
        if view is None:
            view = self.views[replica_id] = ReplicaView(replica_id)
        return view

    def forget(self, replica_ids: Sequence[str]) -> None:
        with self.lock:
            for replica_id in replica_ids:
                self.views.pop(replica_id, None)

    def predict(self, replica_id: str, keys: Sequence[bytes], limit: int) -> None:
        with self.lock:
            if replica_id in self.views:
                self.views[replica_id].predict(keys, limit)

    def answered(self, replica_id: str, prompt_tokens: int, cached_tokens: int) -> None:
        with self.lock:
            self.requests[replica_id] += 1
            self.prompt_tokens[replica_id] += prompt_tokens
            self.cached_tokens[replica_id] += cached_tokens

    def status(self) -> dict[str, Any]:
        """GET /cluster: the router's view of every replica, and its counters."""
        with self.lock:
            for refresh in self.refreshers:
                refresh()
            replicas = []
            for replica_id, view in sorted(self.views.items()):
                stats = view.stats
                replicas.append({
                    "id": replica_id, "role": stats.get("role", "both"), "in_flight": view.in_flight,
                    "cached_blocks_reported": len(view.held), "blocks_predicted": len(view.predicted),
                    "requests": self.requests[replica_id], "prompt_tokens": self.prompt_tokens[replica_id],
                    "cached_tokens": self.cached_tokens[replica_id],
                    "running": stats.get("num_running", 0), "waiting": stats.get("num_waiting", 0),
                    "reported_at": stats.get("time"),  # the replica's clock when it reported
                    "nice": stats.get("nice"),  # its process's CPU niceness
                    "active_requests": sorted(r for r, rep in self.active.items() if rep == replica_id),
                    **({"kv_transfer": _transfer_status(stats)} if stats.get("role") in ("prefill", "decode") else {}),
                })
            return {"router": self.policy, "replicas": replicas, "decisions": dict(self.decisions),
                    "retries": self.retries, "stream_errors": self.stream_errors}


def _transfer_status(stats: dict) -> dict[str, Any]:
    """A PD replica's handoff counters, for /cluster."""
    return {**stats.get("transfers", {}), "leases_held": stats.get("leases_held", 0),
            "leases_expired": stats.get("leases_expired", 0), "imported_blocks": stats.get("kv_imported_blocks", 0)}


LEDGER = RoutingLedger()
