"""The ingress's engine: the same face as `AsyncEngine` (what the FastAPI app calls), but each
request goes through a Ray Serve handle to one of the engine replicas, chosen by the router.

    submit_all(requests) -> RequestStream       (the app's side, unchanged)
      task: handle.generate(requests, routing=RoutingHint(prompt block keys))
              first item: Accepted(replica)  -- the request reached a replica
              then StepDelta batches         -- put on the stream as they come
            a replica that dies before any delta was streamed: sent again once, to another replica
            dies after: the stream ends with RequestFailedError (an SSE error event), never a hang
            no replica takes it within `route_timeout_s`: EngineDeadError
    abort(request_id)                         -- cancels the task; the replica aborts the request

What it learns on the way goes to the ledger (`ledger.LEDGER`): per-replica answers and cache hits,
retries, and the keys of each finished conversation's blocks (predicted held by that replica until
its next report confirms them).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from specdec.api.cluster.ledger import LEDGER, RoutingLedger
from specdec.api.cluster.replica import Accepted
from specdec.api.cluster.routing import PrefixPolicyConfig, RoutingHint
from specdec.api.engine_loop import (
    EngineDeadError, EngineInfo, EngineSnapshot, GenerationRequest, RequestFailedError, RequestStream, _thread_copy,
)
from specdec.cache.block_pool import prefix_block_keys
from specdec.sequence import StepDelta

logger = logging.getLogger("specdec.api")

try:  # Ray Serve raises it from a call it cancelled with the request that made it (the client left)
    from ray.serve.exceptions import RequestCancelledError
except ImportError:  # the client's logic runs without Ray too (tests with fake handles)
    class RequestCancelledError(Exception):  # type: ignore[no-redef]
        pass

# A per-request router override (the `x-specdec-router` header; benchmarks compare policies).
REQUEST_POLICY: contextvars.ContextVar[str | None] = contextvars.ContextVar("specdec_router", default=None)
MAX_ATTEMPTS = 2  # the first try and one retry on another replica


@dataclass
class Attempt:
    """How one try on a replica went."""

    ended: bool = False  # the stream got its end: answered, or refused (an error already on it)
    refused: bool = False  # the engine refused it or no replica took it (the error is on the stream)
    delivered: bool = False  # deltas reached the stream
    error: BaseException | None = None  # the replica's failure (not ended)


class ReplicaEngine:
    def __init__(self, handle: Any, route_timeout_s: float = 120.0, ledger: RoutingLedger = LEDGER) -> None:
        self._handle = handle
        self.route_timeout_s = route_timeout_s
        self.ledger = ledger
        self.phase = "loading"
        self.info: EngineInfo | None = None
        self.error: str | None = None
        self.ready = threading.Event()
        self._tasks: dict[str, asyncio.Task] = {}
        self._routing = 0  # requests sent that no replica has accepted yet
        self._describe_task: asyncio.Task | None = None

    # ---- the AsyncEngine face ----------------------------------------------------------------

    def start(self) -> None:
        self._describe_task = asyncio.get_running_loop().create_task(self._describe())

    def shutdown(self, timeout: float = 5.0) -> None:
        for task in list(self._tasks.values()):
            task.get_loop().call_soon_threadsafe(task.cancel)
        if self._describe_task is not None:
            self._describe_task.get_loop().call_soon_threadsafe(self._describe_task.cancel)

    @property
    def alive(self) -> bool:
        return self.info is not None and self.error is None

    @property
    def queue_depth(self) -> int:
        with self.ledger.lock:
            waiting = sum(v.stats.get("num_waiting", 0) for v in self.ledger.views.values())
        return waiting + self._routing

    @property
    def snapshot(self) -> EngineSnapshot:
        """The replicas' latest reports, summed (acceptance: the counters summed, the rates recomputed)."""
        with self.ledger.lock:
            reports = [v.stats for v in self.ledger.views.values() if v.stats]
        kv: dict[str, dict[str, int]] = {}
        prefix: dict[str, dict[str, int]] = {}
        for report in reports:
            _add_nested(kv, report.get("kv_usage", {}))
            _add_nested(prefix, report.get("prefix_cache", {}))
        acceptance = _merged_acceptance([r.get("acceptance") or {} for r in reports])
        return EngineSnapshot(
            kv_usage=kv, prefix_cache=prefix, num_waiting=sum(r.get("num_waiting", 0) for r in reports),
            num_running=sum(r.get("num_running", 0) for r in reports), acceptance=acceptance,
        )

    def submit(self, request: GenerationRequest) -> RequestStream:
        return self.submit_all([request])

    def submit_all(self, requests: list[GenerationRequest]) -> RequestStream:
        if self.error is not None:
            raise EngineDeadError(self.error)
        if self.info is None:
            raise EngineDeadError("no replica is ready yet")
        stream = RequestStream([r.request_id for r in requests])
        first = requests[0]
        hint = RoutingHint(prefix_block_keys(first.prompt_ids, self.info.block_size, first.cache_salt),
                           policy=REQUEST_POLICY.get())
        task = asyncio.get_running_loop().create_task(self._pump(requests, stream, hint))
        for request in requests:
            self._tasks[request.request_id] = task
        task.add_done_callback(lambda _: [self._tasks.pop(r.request_id, None) for r in requests])
        return stream

    def abort(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    # ---- the ingress side ----------------------------------------------------------------------

    async def _describe(self) -> None:
        """Wait for a replica to be ready and learn the engine's facts from it."""
        from specdec.structured import GrammarCompiler

        while True:
            try:
                facts = await self._handle.describe.remote()
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - replicas still starting: try again
                logger.warning("waiting for an engine replica: %s", exc)
                await asyncio.sleep(1.0)
        tokenizer = facts.tokenizer  # the grammar compiler's (it may build its token table off the loop);
        # the event loop gets its own copy (~1.5 s for a 151k vocabulary: made off the loop)
        grammars = GrammarCompiler(tokenizer, facts.vocab_size, facts.eos_token_ids) if tokenizer is not None else None
        self.info = EngineInfo(
            max_model_len=facts.max_model_len, vocab_size=facts.vocab_size, tokenizer=tokenizer,
            api_tokenizer=await asyncio.to_thread(_thread_copy, tokenizer), speculative=facts.speculative,
            num_speculative_tokens=facts.num_speculative_tokens, grammars=grammars,
            block_size=facts.block_size, eos_token_ids=facts.eos_token_ids,
        )
        self.ready.set()

    async def _pump(self, requests: list[GenerationRequest], stream: RequestStream, hint: RoutingHint,
                    sink: Callable[[Any], bool] | None = None) -> None:
        """Send the requests to a replica and put what it streams on `stream`; see the module doc."""
        last_error: BaseException | None = None
        for attempt in range(MAX_ATTEMPTS):
            if attempt:
                hint = RoutingHint(hint.keys, policy=hint.policy, avoid=hint.replica_id)
                with self.ledger.lock:
                    self.ledger.retries += 1
                logger.warning("replica %s failed before streaming (%s); sending %s to another replica",
                               hint.avoid, last_error, requests[0].request_id)
            outcome = await self._attempt(requests, stream, hint, sink=sink)
            if outcome.ended:
                return
            last_error = outcome.error
            if outcome.delivered:
                with self.ledger.lock:
                    self.ledger.stream_errors += 1
                stream.queue.put_nowait(RequestFailedError(
                    f"replica {hint.replica_id} failed while streaming: {_describe_error(last_error)}"))
                return
        stream.queue.put_nowait(RequestFailedError(
            f"the request failed on {MAX_ATTEMPTS} replicas: {_describe_error(last_error)}"))

    async def _attempt(self, requests: list[GenerationRequest], stream: RequestStream, hint: RoutingHint,
                       handle: Any = None, sink: Callable[[Any], bool] | None = None) -> Attempt:
        """One try on `handle` (default: the engine replicas). `sink` sees every item that is not
        an error first, and says whether it goes on `stream`."""
        ids = [r.request_id for r in requests]
        response = (handle or self._handle).options(stream=True).generate.remote(requests, routing=hint)
        delivered = False
        last: dict[str, StepDelta] = {}
        answer: list[int] = list(requests[0].generated or [])  # the first choice's tokens
        self._routing += 1
        routing = True
        try:
            batches = response.__aiter__()
            first = await asyncio.wait_for(batches.__anext__(), self.route_timeout_s)
            self._routing -= 1
            routing = False
            async for batch in _with_first(first, batches):
                for item in batch:
                    if isinstance(item, Accepted):
                        hint.replica_id = item.replica_id
                        with self.ledger.lock:
                            self.ledger.active.update(dict.fromkeys(ids, item.replica_id))
                    elif isinstance(item, ValueError):  # the engine refused the request: the client's fault
                        stream.queue.put_nowait(item)
                        return Attempt(ended=True, refused=True)
                    elif isinstance(item, BaseException):  # the replica's engine failed it
                        return Attempt(delivered=delivered, error=item)
                    elif sink is None or sink(item):
                        stream.queue.put_nowait(item)
                        delivered = True
                        last[item.request_id] = item
                        if item.request_id == ids[0]:
                            answer.extend(item.token_ids)
            self._answered(hint.replica_id, requests[0], last.get(ids[0]), answer)
            return Attempt(ended=True, delivered=delivered)
        except asyncio.CancelledError:
            response.cancel()
            raise
        except RequestCancelledError:
            # Ray cancels a request's calls when the request is cancelled, and a task cancel that
            # lands while the call is awaited comes out as this: either way the client left, so
            # the pump ends here as cancelled (not "the replica failed": PD would go on to a
            # decode replica nobody listens to while the prefill replica's lease expires)
            raise asyncio.CancelledError from None
        except asyncio.TimeoutError:
            response.cancel()
            stream.queue.put_nowait(EngineDeadError(
                f"no engine replica took the request within {self.route_timeout_s:.0f}s"))
            return Attempt(ended=True, refused=True)
        except Exception as exc:  # noqa: BLE001 - a Ray error: the replica died or was unreachable
            return Attempt(delivered=delivered, error=exc)
        finally:
            if routing:
                self._routing -= 1
            with self.ledger.lock:
                for rid in ids:
                    self.ledger.active.pop(rid, None)

    def _answered(self, replica: str | None, request: GenerationRequest, delta: StepDelta | None,
                  answer: list[int]) -> None:
        """Count the answer, and predict that its replica now holds the blocks of the first
        choice's whole conversation (prompt and answer, less the last token, whose KV is never
        computed): the next turn's prompt starts with them."""
        if replica is None or self.info is None:
            return
        self.ledger.answered(replica, len(request.prompt_ids), delta.num_cached_tokens if delta else 0)
        tokens = request.prompt_ids + answer[:-1]
        self.ledger.predict(replica, prefix_block_keys(tokens, self.info.block_size, request.cache_salt),
                            limit=PrefixPolicyConfig.max_predicted)

    def cluster_status(self) -> dict[str, Any]:
        return self.ledger.status()

    def extra_metrics(self) -> list[Metric]:
        """Routing metrics for /metrics: decisions by reason, retries, cut streams, per-replica hits."""
        status = self.ledger.status()
        decisions = CounterMetricFamily("specdec_router_decisions", "Requests routed, by why the router "
                                        "chose the replica", labels=["reason"])
        for reason, count in status["decisions"].items():
            decisions.add_metric([reason], count)
        retries = CounterMetricFamily("specdec_router_retries", "Requests sent again to another replica "
                                      "after one failed before streaming a token", value=status["retries"])
        cut = CounterMetricFamily("specdec_router_stream_errors", "Streams ended by a replica failure "
                                  "after tokens were streamed", value=status["stream_errors"])
        replicas = GaugeMetricFamily("specdec_replicas", "Engine replicas the router knows",
                                     value=len(status["replicas"]))
        per_replica = [
            CounterMetricFamily("specdec_replica_requests", "Requests answered, per replica", labels=["replica"]),
            CounterMetricFamily("specdec_replica_prompt_tokens", "Prompt tokens answered, per replica",
                                labels=["replica"]),
            CounterMetricFamily("specdec_replica_cached_tokens", "Prompt tokens found in the replica's prefix "
                                "cache, per replica", labels=["replica"]),
        ]
        for replica in status["replicas"]:
            for family, key in zip(per_replica, ("requests", "prompt_tokens", "cached_tokens")):
                family.add_metric([replica["id"]], replica[key])
        return [decisions, retries, cut, replicas, *per_replica, *_transfer_metrics(status["replicas"])]


TRANSFER_METRICS = (  # (name, counter key, help): the decode replicas' pulls, the prefill replicas' leases
    ("specdec_kv_transfer_pulls", "pulls", "Handed-over requests whose KV blocks a decode replica pulled"),
    ("specdec_kv_transfer_blocks", "blocks", "KV blocks pulled (both caches)"),
    ("specdec_kv_transfer_bytes", "bytes", "KV bytes pulled (both caches)"),
    ("specdec_kv_transfer_seconds", "seconds", "Wall time of the pulls"),
    ("specdec_kv_transfer_skipped_blocks", "skipped_blocks", "Handed-over blocks not pulled: the decode "
     "replica held them already"),
    ("specdec_kv_transfer_recomputed", "recomputed", "Handed-over requests whose pull failed (the decode "
     "replica recomputed the prompt)"),
    ("specdec_kv_leases_granted", "leases_granted", "Leases the prefill replicas granted"),
    ("specdec_kv_leases_expired", "leases_expired", "Leases that expired unpulled (their blocks freed)"),
)


def _transfer_metrics(replicas: list[dict]) -> list[Metric]:
    """Prefill/decode disaggregation's counters, summed over the replicas (none without PD)."""
    reports = [r["kv_transfer"] for r in replicas if "kv_transfer" in r]
    if not reports:
        return []
    families: list[Metric] = [CounterMetricFamily(name, text, value=sum(r.get(key, 0) for r in reports))
                              for name, key, text in TRANSFER_METRICS]
    families.append(GaugeMetricFamily("specdec_kv_leases_held", "Leases the prefill replicas hold now",
                                      value=sum(r.get("leases_held", 0) for r in reports)))
    return families


async def _with_first(first: list, rest: Any) -> Any:
    """The replica's batches: the first one (already read), then the rest as they come."""
    yield first
    async for batch in rest:
        yield batch


def _merged_acceptance(reports: list[dict]) -> dict:
    """The replicas' acceptance counters summed (`AcceptanceStats.as_dict` shape), rates recomputed."""
    from specdec.verify.stats import AcceptanceStats

    total = AcceptanceStats()
    for report in reports:
        if report:
            total.merge(AcceptanceStats(
                report.get("num_drafts", 0), report.get("num_draft_tokens", 0), report.get("num_accepted_tokens", 0),
                list(report.get("accepted_per_position", [])), report.get("num_emitted_tokens", 0)))
    return total.as_dict()


def _add_nested(total: dict[str, dict[str, int]], part: dict[str, dict[str, int]]) -> None:
    for name, counts in part.items():
        bucket = total.setdefault(name, {})
        for key, value in counts.items():
            bucket[key] = bucket.get(key, 0) + value


def _describe_error(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
