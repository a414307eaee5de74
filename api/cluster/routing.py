"""Which replica serves a request: scoring by the prefix cache each replica holds, without Ray.

A request arrives with the keys of its prompt's full blocks (`cache.block_pool.prefix_block_keys`,
salted as the engine salts them), so a match here is exactly a hit in that replica's prefix cache,
not a guess from characters. Each replica's `ReplicaView` knows

- `held`: the keys the replica itself reported (its engine's cached blocks, evictions included),
  refreshed every few seconds by Ray Serve's routing-stats call;
- `predicted`: the keys of prompts routed to it (and of answers it streamed) since, which it will
  hold once they are prefilled; they expire after `predict_ttl_s` unless a report confirms them.

`choose` (SGLang's cache-aware policy, on block keys):

1. queues unbalanced — the longest queue exceeds the shortest by more than `balance_abs` *and* by
   more than `balance_rel` times — power of two choices by queue length (`imbalanced`);
2. otherwise the replica whose cache holds the longest prefix of the prompt, shortest queue first
   among equals (`prefix_hit`), when that prefix covers at least `min_match` of the prompt's
   blocks (half, as SGLang's `cache_threshold`: a system prompt every conversation starts with is
   not a reason to send them all to one replica);
3. otherwise the shortest queue; among equals the longer prefix, then the fewest blocks held
   (`least_loaded`).

The other policies, for comparison: `pow2` (two random replicas, shorter queue first),
`round-robin`, and `one` (every request to the same replica, as if there were only one). A retry
avoids the replica that failed (`avoid`) when another one is left; a KV pull goes to the prefill
replica holding the lease (`pin`).
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

POLICIES = ("prefix", "pow2", "round-robin", "one")
ROUTER_HEADER = "x-specdec-router"  # a request's own policy (benchmarks compare policies on one cluster)
REASONS = ("prefix_hit", "least_loaded", "imbalanced", "pow2", "round_robin", "one")


@dataclass
class RoutingHint:
    """What the ingress tells the router about one request (sent with it as a keyword argument)."""

    keys: list[bytes] = field(default_factory=list)  # the prompt's full-block keys, in order
    policy: str | None = None  # a per-request override of the router's policy (benchmarks)
    avoid: str | None = None  # a replica id not to use (it failed this request before)
    pin: str | None = None  # this replica and no other (a KV pull from the prefill replica holding it)
    reason: str | None = None  # set by the router: why it chose the replica
    matched_blocks: int = 0  # set by the router: the prompt blocks the chosen replica holds
    replica_id: str | None = None  # set by the router: the replica it sent the request to


@dataclass
class PrefixPolicyConfig:
    """SGLang's knobs: `balance_abs` and `balance_rel` (queues are unbalanced when both are
    exceeded), `min_match` (the least fraction of the prompt's blocks a prefix hit must cover)."""

    balance_abs: int = 8
    balance_rel: float = 1.5
    min_match: float = 0.5  # SGLang's cache_threshold: a shared system prompt alone is not a hit
    predict_ttl_s: float = 60.0
    max_predicted: int = 200_000  # keys remembered per replica before the oldest are dropped

    def __post_init__(self) -> None:
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError(f"balance_abs must be >= 0 and balance_rel >= 1, got {self.balance_abs}, "
                             f"{self.balance_rel}")
        if not 0.0 <= self.min_match <= 1.0:
            raise ValueError(f"min_match must be in [0, 1], got {self.min_match}")


class ReplicaView:
    """What the router knows of one replica's prefix cache and load."""

    def __init__(self, replica_id: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.replica_id = replica_id
        self.held: frozenset[bytes] = frozenset()
        self.predicted: OrderedDict[bytes, float] = OrderedDict()  # key -> when it was predicted
        self.in_flight = 0  # requests this router sent that have not completed
        self.stats: dict = {}  # the replica's latest report (snapshot counters for /metrics)
        self._clock = clock

    def report(self, keys: Sequence[bytes], stats: dict | None = None) -> None:
        """The replica's own account of its cache: it replaces `held`, and confirms (drops) the
        predicted keys it contains."""
        self.held = frozenset(keys)
        for key in [k for k in self.predicted if k in self.held]:
            del self.predicted[key]
        if stats is not None:
            self.stats = stats

    def predict(self, keys: Sequence[bytes], limit: int) -> None:
        now = self._clock()
        for key in keys:
            if key not in self.held:
                self.predicted[key] = now
                self.predicted.move_to_end(key)
        while len(self.predicted) > limit:
            self.predicted.popitem(last=False)

    def matched_blocks(self, keys: Sequence[bytes], ttl_s: float) -> int:
        """How many leading blocks of `keys` this replica holds (chained keys: a prefix)."""
        now = self._clock()
        for i, key in enumerate(keys):
            if key in self.held:
                continue
            when = self.predicted.get(key)
            if when is None or now - when > ttl_s:
                return i
        return len(keys)

    @property
    def num_blocks(self) -> int:
        return len(self.held) + len(self.predicted)


@dataclass
class Decision:
    ranked: list[str]  # replica ids, most preferred first
    reason: str
    matched_blocks: int = 0


class PrefixPolicy:
    """The routing decisions (pure: replicas are `ReplicaView`s; randomness and clock injectable)."""

    def __init__(self, policy: str = "prefix", config: PrefixPolicyConfig | None = None,
                 rng: random.Random | None = None) -> None:
        check_policy(policy)
        self.policy = policy
        self.config = config or PrefixPolicyConfig()
        self._rng = rng or random.Random()
        self._turn = 0  # round-robin position

    def choose(self, replicas: Sequence[ReplicaView], hint: RoutingHint) -> Decision:
        if not replicas:
            raise ValueError("no replica to route to")
        candidates = sorted(replicas, key=lambda r: r.replica_id)
        if hint.pin is not None:  # gone: any other answers that it holds no such lease, at once
            pinned = [r for r in candidates if r.replica_id == hint.pin]
            return Decision([r.replica_id for r in pinned or candidates], "pinned")
        if hint.avoid is not None and len(candidates) > 1:
            candidates = [r for r in candidates if r.replica_id != hint.avoid] or candidates
        policy = hint.policy or self.policy
        check_policy(policy)
        if policy == "one":
            return Decision([candidates[0].replica_id], "one")
        if policy == "round-robin":
            self._turn += 1
            start = self._turn % len(candidates)
            return Decision([r.replica_id for r in candidates[start:] + candidates[:start]], "round_robin")
        if policy == "pow2":
            return self._pow2(candidates, "pow2")
        return self._prefix(candidates, hint.keys)

    def _pow2(self, candidates: list[ReplicaView], reason: str) -> Decision:
        two = self._rng.sample(candidates, min(2, len(candidates)))
        two.sort(key=lambda r: r.in_flight)
        rest = [r for r in candidates if r not in two]
        return Decision([r.replica_id for r in two + rest], reason)

    def _prefix(self, candidates: list[ReplicaView], keys: list[bytes]) -> Decision:
        cfg = self.config
        loads = [r.in_flight for r in candidates]
        if max(loads) - min(loads) > cfg.balance_abs and max(loads) > cfg.balance_rel * min(loads):
            return self._pow2(candidates, "imbalanced")
        matched = {r.replica_id: r.matched_blocks(keys, cfg.predict_ttl_s) for r in candidates}
        best = max(matched.values())
        if best > 0 and best >= cfg.min_match * len(keys):
            ranked = sorted(candidates, key=lambda r: (-matched[r.replica_id], r.in_flight))
            return Decision([r.replica_id for r in ranked], "prefix_hit", best)
        ranked = sorted(candidates, key=lambda r: (r.in_flight, -matched[r.replica_id], r.num_blocks,
                                                   self._rng.random()))
        return Decision([r.replica_id for r in ranked], "least_loaded", matched[ranked[0].replica_id])


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown router {policy!r}; choose one of {', '.join(POLICIES)}")
