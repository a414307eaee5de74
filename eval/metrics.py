"""Streaming latency arithmetic, as pure functions (acceptance: `acceptance_metrics`).

Latency, per vLLM's `benchmark_serving` (a request streams chunks; a chunk may carry several tokens):

- TTFT: first chunk - request start; E2E: last chunk - request start;
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token;
- ITL: the gaps between successive chunks (one per chunk after the first);
- goodput: requests per second that meet every given SLO (ttft / tpot / e2el, in ms);
- prefix hit rate: prompt tokens the server found in its prefix cache / prompt tokens (OpenAI's
  `usage.prompt_tokens_details.cached_tokens` over `usage.prompt_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")


# ---- latency ---------------------------------------------------------------------------------


@dataclass
class RequestTrace:
    """One streamed request: its start time and each chunk's arrival time and token count.

    `output_tokens` overrides the sum of chunk token counts when the server reports its own
    count (OpenAI `usage.completion_tokens`) or chunks carry text only.
    """

    start: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens served from the server's prefix cache, if reported
    token_ids: list[int] = field(default_factory=list)
    success: bool = True
    error: str = ""

    def add_chunk(self, now: float, num_tokens: int) -> None:
        self.chunk_times.append(now)
        self.chunk_tokens.append(num_tokens)

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else sum(self.chunk_tokens)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None with fewer than two output tokens."""
        n = self.num_output_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itl(self) -> list[float]:
        """Gaps between successive chunks (vLLM's ITL): one per chunk after the first."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def token_gaps(self) -> list[float]:
        """Time between tokens, a chunk's gap shared evenly by the tokens it brings.

        Unlike ITL this weighs a 5-token chunk as 5 tokens; its mean is TPOT.
        """
        gaps: list[float] = []
        for gap, n in zip(self.itl, self.chunk_tokens[1:]):
            gaps.extend([gap / n] * n if n > 0 else [])
        return gaps


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (numpy's linear interpolation); None for no values."""
    return float(np.percentile(values, p)) if len(values) else None


def distribution(values: Sequence[float], percentiles: Sequence[float] = (50, 90, 99)) -> dict:
    """mean, median, std and the given percentiles of `values` (None entries when empty)."""
    values = list(values)
    out: dict[str, float | None] = {
        "mean": float(np.mean(values)) if values else None,
        "median": percentile(values, 50),
        "std": float(np.std(values)) if values else None,
    }
    for p in percentiles:
        out[percentile_key(p)] = percentile(values, p)
    return out


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds, vLLM's keys)."""
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"SLO {item!r} must look like KEY:MS with KEY one of {SLO_KEYS}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[key] <= 0:
            raise ValueError(f"SLO {item!r} must be positive")
    return slos


def meets_slos(trace: RequestTrace, slos: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (ms). A 1-token request has TPOT 0, as in vLLM."""
    measured = {"ttft": trace.ttft, "tpot": trace.tpot or 0.0, "e2el": trace.e2e}
    return all(measured[key] <= limit / 1000.0 for key, limit in slos.items())


def serving_metrics(
    traces: Sequence[RequestTrace], duration: float, slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
) -> dict[str, object]:
    """vLLM `benchmark_serving` metrics over a run of `duration` seconds (latencies in ms)."""
    done = [t for t in traces if t.success and t.chunk_times]
    output_tokens = sum(t.num_output_tokens for t in done)
    input_tokens = sum(t.prompt_tokens for t in done)
    good = sum(1 for t in done if meets_slos(t, slos)) if slos else None
    return {
        "completed": len(done),
        "failed": len(traces) - len(done),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "request_goodput": good / duration if good is not None and duration > 0 else None,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
        **latency_distributions(done, percentiles),
        "slos_ms": dict(slos) if slos else {},
    }


def latency_distributions(traces: Sequence[RequestTrace], percentiles: Sequence[float] = (50, 90, 99)) -> dict:
    """TTFT, TPOT, ITL and E2E distributions (ms) of the successful traces that streamed text."""
    done = [t for t in traces if t.success and t.chunk_times]
    ms = lambda xs: [1000.0 * x for x in xs]  # noqa: E731
    return {
        "ttft_ms": distribution(ms([t.ttft for t in done]), percentiles),
        "tpot_ms": distribution(ms([t.tpot for t in done if t.tpot is not None]), percentiles),
        "itl_ms": distribution(ms([g for t in done for g in t.itl]), percentiles),
        "e2el_ms": distribution(ms([t.e2e for t in done]), percentiles),
    }


def prefix_cache_usage(traces: Sequence[RequestTrace]) -> dict[str, object]:
    """Prompt tokens, cached prompt tokens and their ratio (the prefix hit rate) over the successful
    traces whose server reported cached tokens; the rate is None when none did."""
    reported = [t for t in traces if t.success and t.cached_tokens is not None]
    prompt = sum(t.prompt_tokens for t in reported)
    cached = sum(t.cached_tokens or 0 for t in reported)
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefix_hit_rate": cached / prompt if prompt else None,
        "num_reported": len(reported),
    }


def decode_metrics(traces: Sequence[RequestTrace], percentiles: Sequence[float] = (50, 99)) -> dict:
    """Batch-1 decoding: tokens/s (all tokens / all request time), TTFT, TPOT, ITL, time between tokens."""
    done = [t for t in traces if t.chunk_times]
    tokens = sum(t.num_output_tokens for t in done)
    seconds = sum(t.e2e for t in done)
    ms = lambda xs: [1000.0 * x for x in xs]  # noqa: E731
    return {
        "num_requests": len(done),
        "num_output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "ttft_ms": distribution(ms([t.ttft for t in done]), percentiles),
        "tpot_ms": distribution(ms([t.tpot for t in done if t.tpot is not None]), percentiles),
        "itl_ms": distribution(ms([g for t in done for g in t.itl]), percentiles),
        "tbt_ms": distribution(ms([g for t in done for g in t.token_gaps]), percentiles),
    }


def percentile_key(p: float) -> str:
    """50 -> "p50", 99.9 -> "p99_9" (the key of a percentile in `distribution`)."""
    return "p" + (str(int(p)) if float(p).is_integer() else str(p).replace(".", "_"))
