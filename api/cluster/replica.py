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
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from specdec.api.engine_loop import AsyncEngine, EngineDeadError, GenerationRequest, RequestFailedError


@dataclass(frozen=True)
class Accepted:
    """The first item of every stream: which replica took the request."""

    replica_id: str


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


class EngineReplica:
    """Builds its engine with `engine_factory` (a picklable zero-argument callable returning an
    Engine) on the engine thread, and is ready once the engine is loaded (and warmed up)."""

    async def __init__(self, engine_factory: Callable[[], Any], warmup: bool = False,
                       stall_timeout_s: float = 300.0, step_delay_s: float = 0.0) -> None:
        from specdec.warmup import warm_up

        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit():  # set per replica by `build_app`; torch reads it only at import
            import torch

            torch.set_num_threads(int(threads))
        if step_delay_s > 0:  # slow steps on purpose: fault tests and demos kill a replica mid-request
            engine_factory = _paced(engine_factory, step_delay_s)
        self.replica_id = _replica_id()
        self.stall_timeout_s = stall_timeout_s
        self.engine = AsyncEngine(engine_factory, warmup=warm_up if warmup else None)
        self.engine.publish_keys = True
        self.engine.start()
        await asyncio.to_thread(self.engine.ready.wait)
        if self.engine.error is not None:
            raise RuntimeError(f"replica {self.replica_id}: {self.engine.error}")
        self._reports = 0

    async def describe(self) -> ReplicaFacts:
        info = self.engine.info
        return ReplicaFacts(
            max_model_len=info.max_model_len, vocab_size=info.vocab_size, block_size=info.block_size,
            tokenizer=info.tokenizer, eos_token_ids=info.eos_token_ids,
            speculative=info.speculative, num_speculative_tokens=info.num_speculative_tokens,
        )

    async def generate(self, requests: list[GenerationRequest], routing: Any = None) -> AsyncIterator[list]:
        """Stream the requests' deltas in batches (everything queued since the last batch);
        `routing` is the router's hint (unused here)."""
        try:
            stream = self.engine.submit_all(requests)
        except EngineDeadError as exc:
            yield [exc]
            return
        yield [Accepted(self.replica_id)]
        try:
            while not stream.finished:
                batch = [await stream.__anext__()]
                while not stream.finished and not stream.queue.empty():
                    batch.append(await stream.__anext__())
                yield batch
        except (EngineDeadError, RequestFailedError, ValueError) as exc:
            yield [exc]
        finally:  # cancelled (the client left) or failed: free the blocks at once
            if not stream.finished:
                for request in requests:
                    self.engine.abort(request.request_id)

    def record_routing_stats(self) -> dict[str, Any]:
        snap = self.engine.snapshot
        self._reports += 1
        return {
            "replica_id": self.replica_id, "report": self._reports, "time": time.time(),
            "keys": snap.cached_keys, "kv_usage": snap.kv_usage, "prefix_cache": snap.prefix_cache,
            "num_waiting": snap.num_waiting, "num_running": snap.num_running, "acceptance": snap.acceptance,
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
