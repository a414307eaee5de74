"""The definitions of `eval acceptance`, checked against hand computations (docs/acceptance.md),
and the bootstrap intervals that come with them."""

import numpy as np
import pytest

from specdec.eval.acceptance_metrics import FIGURES, estimate, position_acceptance, prompt_counts
from specdec.eval.bootstrap import bootstrap, speedup
from specdec.eval.metrics import RequestTrace
from specdec.eval.runner import StepRecord
from specdec.verify import expected_accepted_length


def _run(prefill_s: float, steps: list[StepRecord]):
    """A lone request as `run_request` returns it: the prefill step emits 1 token, a verify step
    a + 1 tokens, each chunk when its step ends."""
    steps = [StepRecord(0, 0, prefill_s), *steps]
    trace, now = RequestTrace(0.0), 0.0
    for s in steps:
        now += s.seconds
        trace.add_chunk(now, s.num_accepted + 1)
    return trace, steps


def _target(num_tokens: int, step_s: float = 0.5):
    return _run(step_s, [StepRecord(0, 0, step_s)] * (num_tokens - 1))


# Prompt A: k = 4, all 4 accepted, then 2 of 4; prompt B: none of 4, then 2 of 2 (clipped by
# max_tokens). Every draft forward takes 0.1 s, a target-only decode step 0.5 s.
PROMPT_A = (_run(0.6, [StepRecord(4, 4, 1.0, 0.4, 4), StepRecord(4, 2, 1.0, 0.4, 4)]), _target(9))
PROMPT_B = (_run(0.6, [StepRecord(4, 0, 1.0, 0.4, 4), StepRecord(2, 2, 0.8, 0.2, 2)]), _target(5))


def test_every_figure_matches_a_hand_computation():
    figures = estimate([prompt_counts(4, *PROMPT_A), prompt_counts(4, *PROMPT_B)])
    assert set(figures) == set(FIGURES)
    value = {name: e.value for name, e in figures.items()}
    # 8 of 14 drafts accepted over S = 4 drafting steps, 2 of them ending in a rejection
    assert value["acceptance_rate"] == pytest.approx(8 / 14)
    assert value["alpha"] == pytest.approx(8 / (8 + 2))
    assert value["tau"] == pytest.approx((8 + 4) / 4)
    # three steps drafted 4, one drafted 2: mean of (1 - 0.8^(n+1)) / (1 - 0.8)
    by_hand = (3 * (1 + .8 + .64 + .512 + .4096) + (1 + .8 + .64)) / 4
    assert value["tau_predicted"] == pytest.approx(by_hand) == pytest.approx(
        (3 * expected_accepted_length(0.8, 4) + expected_accepted_length(0.8, 2)) / 4)
    # costs against the target-only decode step (0.5 s): draft forward 0.1 s, step 3.8 s / 4
    assert value["draft_cost"] == pytest.approx(0.1 / 0.5)
    assert value["verify_cost"] == pytest.approx((3.8 - 1.4) / 4 / 0.5)
    assert value["draft_forwards_per_step"] == pytest.approx(14 / 4)
    assert value["step_cost"] == pytest.approx(0.95 / 0.5)
    assert value["step_cost"] == pytest.approx(value["draft_forwards_per_step"] * value["draft_cost"]
                                               + value["verify_cost"])
    assert value["decode_speedup"] == pytest.approx(3.0 / 1.9)
    assert value["decode_speedup_predicted"] == pytest.approx(by_hand / 1.9)
    # whole requests: 14 tokens in 2.6 + 2.4 s against 14 tokens in 4.5 + 2.5 s
    assert value["speedup"] == pytest.approx((14 / 5.0) / (14 / 7.0))
    for e in figures.values():
        assert e.low <= e.value <= e.high


def test_the_paper_formula_is_the_special_case_of_k_forwards_and_unit_verify_cost():
    # k = 3: 9 accepted, 1 rejection (alpha 0.9); draft forwards 0.05 s; verify 0.5 s = a target step
    step = StepRecord(3, 3, 3 * 0.05 + 0.5, 3 * 0.05, 3)
    figures = estimate([prompt_counts(3, _run(0.5, [step] * 3 + [StepRecord(3, 0, 0.65, 0.15, 3)]), _target(5))])
    alpha, c = 9 / 10, 0.05 / 0.5
    assert figures["alpha"].value == pytest.approx(alpha)
    assert figures["verify_cost"].value == pytest.approx(1.0)
    paper = (1 - alpha ** 4) / ((1 - alpha) * (3 * c + 1))
    assert figures["decode_speedup_predicted"].value == pytest.approx(paper)


def test_no_draft_model_timing_leaves_c_undefined_and_speedup_defined():
    run = _run(0.5, [StepRecord(2, 1, 0.6)])  # an n-gram proposer: no draft forwards
    figures = estimate([prompt_counts(2, run, _target(3))])
    assert figures["draft_cost"].value is None
    assert figures["verify_cost"].value == pytest.approx(0.6 / 0.5)
    assert figures["decode_speedup"].value == pytest.approx(2.0 / 1.2)


def test_identical_prompts_give_a_zero_width_interval():
    figures = estimate([prompt_counts(4, *PROMPT_A)] * 5)
    assert figures["tau"].value == figures["tau"].low == figures["tau"].high == pytest.approx(4.0)


def test_bootstrap_resamples_prompts_and_takes_ratios_of_sums():
    # prompt 0: 6 of 8 accepted, prompt 1: 0 of 4; a resample is (0,0) 0.75, (0,1) 0.5 or (1,1) 0.0
    ratio = lambda s: {"rate": s["accepted"] / s["drafted"]}  # noqa: E731
    rate = bootstrap({"accepted": [6, 0], "drafted": [8, 4]}, ratio)["rate"]
    assert rate.value == pytest.approx(0.5)  # 6 / 12, not the mean of 0.75 and 0.0
    assert (rate.low, rate.high) == (0.0, 0.75)
    again = bootstrap({"accepted": [6, 0], "drafted": [8, 4]}, ratio)["rate"]
    assert again == rate  # fixed seed


def test_speedup_compares_the_same_prompts():
    fast = [_target(9, 0.25)[0], _target(5, 0.25)[0]]
    slow = [_target(9, 0.5)[0], _target(5, 0.5)[0]]
    s = speedup(fast, slow)
    assert (s.value, s.low, s.high) == pytest.approx((2.0, 2.0, 2.0))
    with pytest.raises(ValueError):
        speedup(fast, slow[:1])


def test_iid_acceptance_is_predicted_within_the_interval():
    rng = np.random.default_rng(0)
    p, k = 0.7, 5

    def step() -> StepRecord:
        accepted = 0
        while accepted < k and rng.random() < p:
            accepted += 1
        return StepRecord(k, accepted, 1.0, 0.5, k)

    prompts = [prompt_counts(k, _run(0.5, [step() for _ in range(30)]), _target(40)) for _ in range(20)]
    figures = estimate(prompts)
    assert figures["alpha"].low < p < figures["alpha"].high
    assert figures["tau"].low < figures["tau_predicted"].value < figures["tau"].high


def test_position_acceptance_counts_only_steps_that_drafted_the_position():
    steps = [StepRecord(4, 4, 1.0), StepRecord(2, 2, 1.0), StepRecord(4, 1, 1.0), StepRecord(0, 0, 1.0)]
    p = position_acceptance(steps)
    assert p["drafted_by_position"] == [3, 3, 2, 2]
    assert p["accepted_by_position"] == [3, 2, 1, 1]
    assert p["acceptance_by_position"] == pytest.approx([1.0, 2 / 3, 0.5, 0.5])
