"""Adaptive k: the cost model's choices, and an engine that changes k every step stays exact."""

import pytest

from specdec.step.adaptive import AcceptanceEstimate, CostTable, SpeculationPolicy, expected_tokens
from specdec.sampling_params import SamplingParams

from .conftest import PROMPTS, make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.9, 4) == pytest.approx(sum(0.9**i for i in range(5)))


def test_acceptance_estimate_follows_outcomes_and_decays_to_the_prior():
    est = AcceptanceEstimate()
    prior = est.rate
    for _ in range(10):
        est.update(4, 4)
    assert est.rate > 0.9
    for _ in range(30):
        est.update(4, 0)
    assert est.rate < 0.3
    low = est.rate
    for _ in range(60):
        est.update(0, 0)  # no drafts: the evidence fades and the prior returns
    assert low < est.rate == pytest.approx(prior, abs=0.05)


def test_cost_table_buckets_and_borrows_the_nearest_measurement():
    table = CostTable(prior=7.0)
    assert table(5) == 7.0
    assert [CostTable.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    table.observe(5, 0.10)
    assert table(1) == table(8) == table(100) == 0.10
    table.observe(1, 0.08)
    assert table(2) == 0.08 and table(6) == 0.10
    table.observe(6, 0.20)
    assert 0.10 < table(5) < 0.20  # an exponential average, not the last value


def test_cost_table_extends_the_largest_measurements_along_their_line():
    """Early stop prices speculation at the cap's rows (36 for 4 sequences at k = 8), a size the
    shorter real drafts may never reach: borrowing the 5-row cost would make it look free."""
    table = CostTable(prior=None)
    table.observe(1, 0.040)
    table.observe(5, 0.060)  # 5 ms per extra row: a compute-bound kernel
    assert table(36) == pytest.approx(0.060 + 0.005 * 31)
    assert table(3) == 0.040 or table(3) == 0.060  # inside the measured range: nearest bucket
    table.observe(16, 0.050)  # cheaper than smaller sizes (noise): never extrapolate downwards
    assert table(64) == pytest.approx(0.050)


def test_cost_table_upper_bounds_sizes_never_measured():
    """A bound on a step's time must not trust a guess that may be low: a neighbour's cost, or the
    line through two measurements (a memory-bound forward's flat line), for a size never run."""
    table = CostTable(prior=None)
    table.observe(2, 0.100)
    table.observe(4, 0.120)
    assert table.upper(2) == table(2) == 0.100 and table.upper(3) == 0.120  # measured buckets
    assert table(8) == pytest.approx(0.120 + 0.010 * 4)  # the line through the two: 0.16 s
    assert table.upper(8) == pytest.approx(0.120 * 8 / 4)  # in proportion to the rows: 0.24 s
    assert table.upper(1) == 0.100  # below every measurement: the smallest measured, not less
    assert CostTable(prior=7.0).upper(5) == 7.0


def test_steady_steps_do_not_draft_a_step_size_never_measured():
    """Only 1- and 2-row verifies measured, as on a decode replica whose streams never drafted:
    borrowing would price a 4-row verify as a 2-row one and draft; steady steps do not."""
    policy = SpeculationPolicy()
    policy.verify_cost.observe(1, 0.080)
    policy.verify_cost.observe(2, 0.090)
    policy.draft_cost.observe(2, 0.010)
    assert policy.best_k([0.9] * 2, [4] * 2) > 0  # unbounded: the borrowed prices say draft
    assert policy.best_k([0.9] * 2, [4] * 2, None, 1.5) == 0
    policy.verify_cost.observe(4, 0.100)  # measured: a 4-row verify fits the bound after all
    assert policy.best_k([0.9] * 2, [4] * 2, None, 1.5) == 1


def _policy(verify, draft: float) -> SpeculationPolicy:
    policy = SpeculationPolicy()
    for rows in (1, 2, 4, 8, 16, 32, 64, 128):
        policy.verify_cost.observe(rows, verify(rows))
    for batch in (1, 2, 4, 8, 16):
        policy.draft_cost.observe(batch, draft)
    return policy


def test_high_acceptance_flat_verify_drafts_long():
    policy = _policy(lambda rows: 0.07, draft=0.01)
    assert policy.choose_k([0.95], [8]) == [8]


def test_low_acceptance_switches_speculation_off():
    policy = _policy(lambda rows: 0.07, draft=0.03)
    assert policy.choose_k([0.2], [8]) == [0]


def test_compute_bound_verify_turns_speculation_off_for_a_large_batch():
    policy = _policy(lambda rows: 0.05 + 0.01 * rows, draft=0.02)
    assert policy.choose_k([0.8], [8])[0] > 0
    assert policy.choose_k([0.8] * 16, [8] * 16) == [0] * 16


def test_target_timings_alone_do_not_price_out_an_untried_draft():
    """Target-only traffic fills the target's table first; speculation must still get tried."""
    policy = SpeculationPolicy()
    policy.verify_cost.observe(1, 0.06)
    assert policy.choose_k([0.7], [8])[0] > 0


def test_a_long_draft_catch_up_is_priced_in():
    """After steps without drafting the draft cache lags; feeding the lag costs a wide forward."""
    policy = _policy(lambda rows: 0.07, draft=0.02)
    for rows, seconds in ((32, 0.3), (64, 0.6)):
        policy.draft_cost.observe(rows, seconds)
    assert policy.choose_k([0.8], [8], lags=[1])[0] > 0
    assert policy.choose_k([0.8], [8], lags=[60]) == [0]


def test_caps_are_respected():
    policy = _policy(lambda rows: 0.07, draft=0.005)
    assert policy.choose_k([0.95, 0.95, 0.95], [8, 2, 0]) == [8, 2, 0]


def test_adaptive_engine_is_greedy_exact(pair):
    target, draft = pair
    reference = [o.token_ids for o in make_engine(target).generate(PROMPTS, GREEDY)]
    engine = make_engine(target, draft, num_speculative_tokens=8, adaptive_k=True)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert engine.stats.num_draft_tokens > 0


def test_adaptive_engine_stops_drafting_when_the_draft_never_pays(pair):
    """A draft priced far above the target: every step is plain decoding, output unchanged."""
    target, draft = pair
    reference = [o.token_ids for o in make_engine(target).generate(PROMPTS, GREEDY)]
    engine = make_engine(target, draft, num_speculative_tokens=8, adaptive_k=True)
    engine.policy.draft_cost.prior = 1e6
    engine.policy.draft_cost.observe = lambda rows, seconds: None  # keep the price
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert engine.stats.num_draft_tokens == 0


def test_a_batch_pays_its_whole_draft_catch_up_and_a_lone_sequence_a_few_rows(pair):
    """Under load the draft's prefill and catch-ups after pauses cost more than drafting won; a lone
    sequence must still get to draft (priced in full, a prompt's catch-up would keep it off)."""
    from specdec.step.planner import MAX_PRICED_LAG

    target, draft = pair
    engine = make_engine(target, draft, num_speculative_tokens=4, adaptive_k=True)
    seen = []
    best_k = engine.policy.best_k
    engine.policy.best_k = lambda rates, caps, lags=None, ratio=None: seen.append((len(caps), lags)) or best_k(rates, caps, lags, ratio)
    long_prompts = [list(range(3, 3 + 20)), list(range(30, 30 + 20))]
    engine.generate(long_prompts, GREEDY)
    engine.generate(long_prompts[:1], GREEDY)
    batched = [lags for n, lags in seen if n == 2]
    alone = [lags for n, lags in seen if n == 1]
    assert any(max(lags) > MAX_PRICED_LAG for lags in batched)  # the whole prompt is priced
    assert alone and all(max(lags) <= MAX_PRICED_LAG for lags in alone)
    assert engine.stats.num_draft_tokens > 0  # the lone sequence drafted


@pytest.mark.parametrize("stop_below, stops", [(0.999, True), (1e-12, False)])
def test_greedy_drafts_stop_on_the_drafts_own_confidence(pair, stop_below, stops):
    """Greedy q is one-hot, so the stop reads the draft's softmax: an unsure tiny draft stops after
    one token at a high bar and drafts to the cap at a negligible one; output stays exact."""
    target, draft = pair
    reference = [o.token_ids for o in make_engine(target).generate(PROMPTS, GREEDY)]
    engine = make_engine(target, draft, num_speculative_tokens=4, adaptive_k=True,
                         draft_stop_confidence=stop_below)
    engine.policy.best_k = lambda rates, caps, lags=None, ratio=None: max(caps)  # always draft
    drafted = []
    propose = engine.proposer.propose
    engine.proposer.propose = lambda *a, **kw: (out := propose(*a, **kw), drafted.extend(out.num_draft))[0]
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    drafted = [n for n in drafted if n]
    assert drafted and (max(drafted) == 1) == stops


def test_steady_steps_keep_the_batchs_k_until_another_pays_enough():
    """Steady steps: the planner drafts only a k whose step is expected within STEADY_STEP_RATIO
    of a plain step, keeps the batch's k while the policy's best promises less than STEADY_MARGIN
    over it, takes the best once it does, and stops drafting as soon as plain decoding is expected
    to be faster."""
    from specdec.step.planner import STEADY_MARGIN, STEADY_STEP_RATIO, StepPlanner

    class Seq:  # what the planner reads of a decoding sequence
        num_tokens, draft_table, num_pending, fills_only, num_draft_fill = 40, None, 1, False, 0

        class acceptance:
            rate = 0.8

    def planned(planner):
        return [p.num_draft for p in planner.plan([Seq(), Seq()]).rows]

    def steady_planner(policy):
        planner = StepPlanner(None, policy, drafts_with_model=True, looks_up=False, early_stop=True, steady=True)
        planner._cap = lambda seq: 5
        assert not planner.early_stop
        return planner

    # a draft that costs a third of a verify: unbounded, k = 3 (a step 2x a plain one); steady: k = 1
    policy = _policy(lambda rows: 0.06, draft=0.02)
    planner = steady_planner(policy)
    k = planned(planner)[0]
    assert policy.best_k([0.8] * 2, [5] * 2) == 3 and k == 1
    assert policy.step_seconds(k, [5] * 2) <= STEADY_STEP_RATIO * policy.step_seconds(0, [5] * 2) < policy.step_seconds(k + 1, [5] * 2)

    policy = _policy(lambda rows: 0.07, draft=0.005)  # a cheap draft: every k within the bound
    planner = steady_planner(policy)
    rate = lambda a, k: policy.expected_rate(k, [a] * 2, [5] * 2)  # noqa: E731
    best = lambda a: policy.best_k([a] * 2, [5] * 2, None, STEADY_STEP_RATIO)  # noqa: E731
    k = planned(planner)[0]
    assert k == best(0.8) > 0
    smaller = [a / 100 for a in range(5, 80) if 0 < best(a / 100) < k and rate(a / 100, best(a / 100)) < STEADY_MARGIN * rate(a / 100, k)]
    assert smaller
    Seq.acceptance.rate = smaller[-1]  # a smaller k is best now, but not by the margin: kept
    assert planned(planner) == [k, k]
    Seq.acceptance.rate = 0.05  # drafting is far worse than not: switched off
    assert planned(planner) == [0, 0]
    marginal = [a / 100 for a in range(5, 99) if best(a / 100) and rate(a / 100, best(a / 100)) < STEADY_MARGIN * rate(a / 100, 0)]
    assert marginal  # drafting pays, but less than the margin: plain decoding stays
    Seq.acceptance.rate = marginal[-1]
    assert planned(planner) == [0, 0]
    Seq.acceptance.rate = 0.95
    assert planned(planner)[0] == best(0.95) > 0

    # a lone stream's k that a batch of three no longer fits is dropped, gain or not
    policy = _policy(lambda rows: 0.03 + 0.01 * rows, draft=0.005)
    planner = steady_planner(policy)
    lone = planner.plan([Seq()]).rows[0].num_draft
    three = policy.best_k([0.95] * 3, [5] * 3, None, STEADY_STEP_RATIO)
    assert lone > three and policy.step_seconds(lone, [5] * 3) > STEADY_STEP_RATIO * policy.step_seconds(0, [5] * 3)
    assert [p.num_draft for p in planner.plan([Seq(), Seq(), Seq()]).rows] == [three] * 3


def test_steady_steps_draft_the_whole_k_and_stay_exact(pair):
    """No early stop under steady steps: at a confidence bar that stops every draft after one
    token, each drafting step still drafts the batch's k (early stop: 1); output equals target-only."""
    target, draft = pair
    reference = [o.token_ids for o in make_engine(target).generate(PROMPTS, GREEDY)]
    engine = make_engine(target, draft, num_speculative_tokens=4, adaptive_k=True, draft_stop_confidence=0.999,
                         steady_steps=True)
    engine.policy.best_k = lambda rates, caps, lags=None, ratio=None: 3
    drafted = []
    propose = engine.proposer.propose
    engine.proposer.propose = lambda *a, **kw: (out := propose(*a, **kw), drafted.extend(out.num_draft))[0]
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    drafted = [n for n in drafted if n]
    assert max(drafted) == 3 and drafted.count(3) >= 0.8 * len(drafted)  # fewer only where max_tokens caps it


def test_chunk_sizer_keeps_steps_within_the_gap_ratio():
    """Decode steps of 150 ms (one row) and 50 ms per prompt token: at ratio 3, 6 tokens fill
    the 300 ms a step may add. A mixed step is charged only beyond a decode step with the same
    verify rows (a long speculative window is not the chunk's cost); dearer tokens shrink it."""
    from specdec.step.adaptive import ChunkSizer

    sizer = ChunkSizer(gap_ratio=3.0, initial=8)
    sizer.observe(0.15, 0, verify_rows=1)
    sizer.observe(0.60, 0, verify_rows=6)  # a speculative step: k = 5
    sizer.observe(0.15, 0, verify_rows=1)
    assert sizer.budget() == 8  # no prompt token priced yet
    decode_s = sizer.decode_s
    assert decode_s == 0.15  # the median step, as the streams' median gap
    sizer.observe(0.60 + 0.05 * 4, 4, verify_rows=6)  # a chunk of 4 beside a k = 5 window
    assert sizer.per_token_s == pytest.approx(0.05)
    assert sizer.budget() == 6  # (3 - 1) * 0.15 / 0.05
    for _ in range(40):
        sizer.observe(0.15 + 0.5 * 4, 4, verify_rows=1)
    assert sizer.budget() == 1
    sizer.observe(0.05 * 200, 200, verify_rows=0)  # a prefill-only step prices tokens too
    assert sizer.per_token_s < 0.5
    grow = ChunkSizer(gap_ratio=3.0, initial=4)
    grow.observe(1.0, 0, verify_rows=1)
    grow.observe(0.01 * 100, 100, verify_rows=0)  # 200 tokens would fit: reached 2x per step
    assert [grow.budget() for _ in range(8)] == [8, 16, 32, 64, 128, 200, 200, 200]
    with pytest.raises(ValueError, match="gap ratio"):
        ChunkSizer(gap_ratio=1.0)
