"""Latency arithmetic on synthetic traces: TTFT, TPOT, ITL, goodput (acceptance: test_acceptance_metrics)."""

import math

import numpy as np
import pytest

from specdec.eval.metrics import (
    RequestTrace,
    decode_metrics,
    distribution,
    latency_distributions,
    parse_slos,
    prefix_cache_usage,
    serving_metrics,
)
from specdec.eval.serve_bench import arrival_offsets


def test_ttft_tpot_itl_follow_vllm_definitions():
    # start 0; chunks at 1.0 (1 token), 1.5 (3 tokens), 2.5 (1 token)
    t = RequestTrace(0.0)
    for now, n in [(1.0, 1), (1.5, 3), (2.5, 1)]:
        t.add_chunk(now, n)
    assert t.ttft == 1.0 and t.e2e == 2.5
    assert t.tpot == pytest.approx((2.5 - 1.0) / (5 - 1))
    assert t.itl == pytest.approx([0.5, 1.0])  # one gap per chunk, whatever it carries
    assert t.token_gaps == pytest.approx([0.5 / 3] * 3 + [1.0])
    assert sum(t.token_gaps) / len(t.token_gaps) == pytest.approx(t.tpot)


def test_server_reported_token_count_wins_and_single_token_has_no_tpot():
    t = RequestTrace(0.0, output_tokens=9)
    t.add_chunk(0.2, 0)
    t.add_chunk(1.0, 0)
    assert t.num_output_tokens == 9 and t.tpot == pytest.approx(0.1)
    one = RequestTrace(0.0)
    one.add_chunk(0.3, 1)
    assert one.tpot is None


def _trace(ttft: float, e2e: float, tokens: int) -> RequestTrace:
    t = RequestTrace(0.0, prompt_tokens=10)
    t.add_chunk(ttft, 1)
    if tokens > 1:
        t.add_chunk(e2e, tokens - 1)
    return t


def test_goodput_counts_requests_meeting_every_slo():
    traces = [
        _trace(0.1, 1.1, 11),  # ttft 100 ms, tpot 100 ms -> good
        _trace(0.6, 1.6, 11),  # ttft 600 ms -> misses the TTFT SLO
        _trace(0.1, 3.1, 11),  # tpot 300 ms -> misses the TPOT SLO
        _trace(0.2, 0.2, 1),  # one token: tpot counts as 0 -> good
    ]
    failed = RequestTrace(0.0, success=False)
    m = serving_metrics(traces + [failed], duration=2.0, slos=parse_slos(["ttft:500", "tpot:150"]))
    assert m["completed"] == 4 and m["failed"] == 1
    assert m["request_goodput"] == pytest.approx(2 / 2.0)
    assert m["request_throughput"] == pytest.approx(4 / 2.0)
    assert m["total_output_tokens"] == 34 and m["output_throughput"] == pytest.approx(17.0)
    assert m["total_token_throughput"] == pytest.approx((34 + 40) / 2.0)
    assert m["ttft_ms"]["median"] == pytest.approx(150.0)
    assert m["tpot_ms"]["mean"] == pytest.approx((100 + 100 + 300) / 3)  # 1-token requests have none
    assert serving_metrics(traces, 2.0)["request_goodput"] is None


def test_parse_slos_rejects_unknown_keys_and_bad_values():
    assert parse_slos(["e2el:2000"]) == {"e2el": 2000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_distribution_and_decode_metrics():
    d = distribution([1.0, 2.0, 3.0, 4.0], (50, 99))
    assert d["mean"] == 2.5 and d["p50"] == 2.5 and d["p99"] == pytest.approx(3.97)
    assert distribution([])["mean"] is None
    m = decode_metrics([_trace(0.5, 2.5, 5), _trace(0.5, 1.5, 5)])
    assert m["tokens_per_s"] == pytest.approx(10 / 4.0)
    assert m["itl_ms"]["p50"] == pytest.approx(1500.0)


def test_poisson_arrivals_are_seeded_and_have_the_right_rate():
    a = arrival_offsets(4000, 4.0, 1.0, np.random.default_rng(7))
    b = arrival_offsets(4000, 4.0, 1.0, np.random.default_rng(7))
    assert a == b and a[0] == 0.0
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() == pytest.approx(0.25, rel=0.1)  # exponential: std == mean
    assert arrival_offsets(3, math.inf, 1.0, np.random.default_rng(0)) == [0.0, 0.0, 0.0]


def test_prefix_hit_rate_counts_only_traces_whose_server_reported_cached_tokens():
    traces = [
        RequestTrace(0.0, [0.1], [1], prompt_tokens=100, cached_tokens=0),
        RequestTrace(0.0, [0.1], [1], prompt_tokens=300, cached_tokens=240),
        RequestTrace(0.0, [0.1], [1], prompt_tokens=500),  # no cached_tokens in its usage
        RequestTrace(0.0, prompt_tokens=700, cached_tokens=700, success=False),
    ]
    usage = prefix_cache_usage(traces)
    assert usage == {"prompt_tokens": 400, "cached_tokens": 240, "prefix_hit_rate": 0.6, "num_reported": 2}
    assert prefix_cache_usage(traces[2:])["prefix_hit_rate"] is None


def test_latency_distributions_are_the_serving_metrics_ones():
    traces = [_trace(0.1, 1.1, 11), _trace(0.3, 0.9, 4), RequestTrace(0.0, success=False)]
    d = latency_distributions(traces, (50, 99))
    m = serving_metrics(traces, 1.0, percentiles=(50, 99))
    assert all(d[k] == m[k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"))
    assert d["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert latency_distributions([])["ttft_ms"]["mean"] is None
