"""Speculation on an MoE target: the experts each verify window reads are counted (step statistics,
/metrics) and the adaptive k prices verify forwards through them (rows -> experts -> seconds)."""

from __future__ import annotations

import pytest
import torch

from specdec.step.adaptive import CostTable, ExpertPricedCost, SpeculationPolicy
from specdec.config import EngineConfig
from specdec.draft import StepTimings
from specdec.engine import Engine
from specdec.expert_stats import ExpertStats, distinct_experts
from specdec.sampling_params import SamplingParams
from specdec.testing import from_hf
from tests.target.moe_models import moe_hf_model


def test_distinct_experts_are_counted_per_window_and_layer():
    ids = torch.tensor([[[0, 1], [1, 2], [3, 0]], [[0, 1], [0, 1], [0, 1]]])  # 2 layers, 3 rows, top 2
    assert distinct_experts(ids, [(0, 2), (2, 3), (0, 3)], 4) == [(3 + 2) / 2, 2.0, (4 + 2) / 2]


def test_stats_separate_windows_and_the_whole_forward():
    stats = ExpertStats(num_experts=4, top_k=2)
    ids = torch.tensor([[[0, 1], [1, 2], [9, 9], [3, 0]]]).clamp(max=3)  # row 2 is a prefill chunk's
    whole = stats.record(ids, [(0, 2), (3, 4)])
    assert whole == 4.0  # experts 0-3 between the two windows
    assert (stats.num_windows, stats.window_rows, stats.experts_per_window) == (2, 3, (3 + 2) / 2)
    assert stats.experts_per_row == pytest.approx(5 / 3)
    assert stats.as_dict()["experts_by_window_rows"] == {1: 2.0, 2: 3.0}
    assert "2.5 per verify window of 1.5 rows" in stats.summary()


def test_an_moe_engine_counts_the_experts_its_windows_read():
    target = from_hf(moe_hf_model("qwen2_moe"))
    draft = from_hf(moe_hf_model("qwen2_moe", seed=1, num_hidden_layers=1))
    config = EngineConfig(dtype="float32", num_blocks=96, block_size=4, proposer="draft", num_speculative_tokens=3,
                          adaptive_k=False)
    engine = Engine.from_models(config, target, draft)
    engine.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stats = engine.expert_stats
    assert stats.num_windows > 0 and stats.top_k == 3
    assert 3 <= stats.experts_per_window <= 8  # one row reads 3; a window at most all 8
    assert stats.experts_per_row <= 3  # windows share experts between rows, never read more
    assert stats.by_window_rows[4][1] / stats.by_window_rows[4][0] >= 3
    engine.reset_stats()
    assert engine.expert_stats.num_windows == 0
    dense = Engine.from_models(EngineConfig(dtype="float32", num_blocks=32, proposer="none"), from_hf(_dense()), None)
    assert dense.expert_stats is None


def _dense():
    from specdec.testing import tiny_hf_model

    return tiny_hf_model("qwen2")


def test_priced_by_experts_read_where_rows_alone_extrapolate_wrongly():
    """Measured: 1 row reads 8 experts, 2 rows 15, 4 rows 27 (top 8 of 128), at 1 ms a layer-expert.
    A rows table extends the line through its two largest buckets; the expert price follows the
    experts read, which saturate."""
    cost = ExpertPricedCost(num_experts=128, top_k=8, prior=1.0)
    rows_only = CostTable(prior=1.0)
    for rows, experts in ((1, 8.0), (2, 15.0), (4, 27.0)):
        seconds = 0.002 + 0.001 * experts
        cost.observe(rows, seconds)
        cost.observe_experts(rows, experts, seconds)
        rows_only.observe(rows, seconds)
    assert cost(4) == pytest.approx(0.029, rel=1e-6)
    expected_8 = 0.002 + 0.001 * cost.experts(8)
    assert cost(8) == pytest.approx(expected_8, rel=1e-3)
    assert 27 < cost.experts(8) < cost.uniform_experts(8)  # below the uniform curve, as measured
    assert cost(32) < rows_only(32)  # saturating experts, not a line
    assert cost.experts(10_000) <= 128


def test_the_policy_learns_experts_from_the_verify_timings():
    policy = SpeculationPolicy(routing=(64, 4))
    timings = StepTimings(enabled=True)
    timings.verify.append((5, 0.01))
    timings.verify_experts = 14.0
    policy.observe(timings)
    assert policy.verify_cost.experts_by_rows == {5: 14.0}
    policy.forget()
    assert isinstance(policy.verify_cost, ExpertPricedCost) and not policy.verify_cost.experts_by_rows
