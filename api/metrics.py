"""Prometheus metrics of one server: request outcomes and latencies, plus the engine's live state.

Each app owns its `CollectorRegistry` (two servers in one process never share counters). Request
metrics are updated by the handlers; engine metrics (acceptance per draft position, KV blocks per
pool, queue depth, running sequences) are read from the engine loop's latest snapshot at scrape
time, so they are never stale and the engine thread does no metrics work. The prefix-cache
counters export the engine's own cumulative totals (which only grow) as Prometheus counters.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from specdec.api.engine_loop import AsyncEngine

OUTCOMES = ("stop", "length", "aborted", "error", "invalid", "unauthorized", "rejected", "unavailable")
_STATUS_OUTCOMES = {401: "unauthorized", 429: "rejected", 503: "unavailable"}
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                    0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    """The server's metrics; `render()` is the body of GET /metrics."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "specdec_requests", "Generation requests by outcome: finish reason (stop, length), "
            "aborted by the client, engine error, or rejected (invalid, unauthorized, rejected = "
            "429 over --max-concurrent, unavailable = 503)", ["outcome"], registry=r,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.ttft = Histogram(
            "specdec_time_to_first_token_seconds", "From request arrival to its first generated token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.inter_token = Histogram(
            "specdec_inter_token_latency_seconds", "Time between a request's consecutive tokens "
            "(a step that emits n tokens after t seconds counts n observations of t/n)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter(
            "specdec_generation_tokens", "Tokens generated for clients (EOS not counted)", registry=r)
        r.register(_EngineCollector(engine))

    def record_status(self, status: int, path: str) -> None:
        """Count a generation request (a /v1/ path) answered with an error status."""
        if not path.startswith("/v1/"):
            return
        if status >= 500 and status != 503:
            self.requests.labels("error").inc()
        else:
            self.requests.labels(_STATUS_OUTCOMES.get(status, "invalid")).inc()

    def observe_tokens(self, num_tokens: int, seconds_since_last: float) -> None:
        self.generated_tokens.inc(num_tokens)
        per_token = seconds_since_last / num_tokens
        for _ in range(num_tokens):
            self.inter_token.observe(per_token)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine gauges and counters, built at scrape time from `AsyncEngine.snapshot`."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        engine, snap = self.engine, self.engine.snapshot
        yield GaugeMetricFamily("specdec_engine_up", "1 when the model is loaded and the engine loop runs",
                                value=1.0 if engine.alive else 0.0)
        yield GaugeMetricFamily("specdec_queue_depth", "Requests waiting to be admitted by the engine",
                                value=engine.queue_depth)
        yield GaugeMetricFamily("specdec_running_sequences", "Sequences the engine is decoding",
                                value=snap.num_running)
        blocks = GaugeMetricFamily(
            "specdec_kv_blocks", "KV cache blocks per pool (target, draft) and state: used (held by "
            "requests), free (allocatable), cached (free blocks keeping a reusable prefix; part of free)",
            labels=["pool", "state"])
        for pool, usage in snap.kv_usage.items():
            for state in ("used", "free", "cached"):
                blocks.add_metric([pool, state], usage.get(state, 0))
        yield blocks
        yield from self._prefix_cache(snap.prefix_cache)
        yield from self._acceptance(snap.acceptance, snap.drafted_per_position)
        if snap.experts:
            yield from self._experts(snap.experts)
        extra = getattr(engine, "extra_metrics", None)  # engine replicas: routing and per-replica hits
        if extra is not None:
            yield from extra()

    @staticmethod
    def _prefix_cache(stats: dict[str, dict[str, int]]) -> Iterator[Metric]:
        queried = CounterMetricFamily(
            "specdec_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache, per pool",
            labels=["pool"])
        hits = CounterMetricFamily(
            "specdec_prefix_cache_hit_tokens", "Prompt tokens whose KV was found in the prefix cache, per pool",
            labels=["pool"])
        for pool, counts in stats.items():
            queried.add_metric([pool], counts["queried_tokens"])
            hits.add_metric([pool], counts["hit_tokens"])
        yield queried
        yield hits

    @staticmethod
    def _experts(experts: dict) -> Iterator[Metric]:
        """An MoE target: the experts its verify windows read (distinct, a layer, averaged over layers)."""
        yield CounterMetricFamily("specdec_moe_verify_windows", "Decoding windows an MoE target verified",
                                  value=experts["num_windows"])
        yield GaugeMetricFamily("specdec_moe_experts_per_window",
                                "Distinct experts a layer read per verify window since start", value=experts["experts_per_window"])
        yield GaugeMetricFamily("specdec_moe_experts_per_row",
                                "Distinct experts a layer read per verified row since start (one-row windows: top k)",
                                value=experts["experts_per_row"])
        yield GaugeMetricFamily("specdec_moe_experts_per_forward",
                                "Distinct experts a layer read per verify forward (all windows of a step)",
                                value=experts["experts_per_forward"])
        by_rows = GaugeMetricFamily("specdec_moe_experts_by_window_rows",
                                    "Distinct experts a layer read per verify window, by the window's rows", labels=["rows"])
        for rows, value in experts["experts_by_window_rows"].items():
            by_rows.add_metric([str(rows)], value)
        yield by_rows

    @staticmethod
    def _acceptance(acceptance: dict, drafted: tuple[int, ...]) -> Iterator[Metric]:
        drafted_family = CounterMetricFamily(
            "specdec_draft_tokens", "Draft tokens proposed, by draft position (1 = first)", labels=["position"])
        accepted_family = CounterMetricFamily(
            "specdec_accepted_tokens", "Draft tokens accepted by the target, by draft position",
            labels=["position"])
        accepted = acceptance.get("accepted_per_position", [])
        for i, count in enumerate(drafted):
            drafted_family.add_metric([str(i + 1)], count)
            accepted_family.add_metric([str(i + 1)], accepted[i] if i < len(accepted) else 0)
        yield drafted_family
        yield accepted_family
        yield GaugeMetricFamily("specdec_acceptance_rate", "Accepted / proposed draft tokens since start",
                                value=acceptance.get("acceptance_rate", 0.0))
        yield GaugeMetricFamily(
            "specdec_mean_accepted_length", "Tokens emitted per target verify pass (accepted + 1) since start",
            value=acceptance.get("mean_accepted_length", 0.0))
