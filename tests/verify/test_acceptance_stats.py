"""AcceptanceStats arithmetic and the i.i.d. expected accepted length."""

import math

import pytest

from specdec.verify import AcceptanceStats, expected_accepted_length


def test_known_accept_pattern() -> None:
    stats = AcceptanceStats()
    for num_draft, num_accepted in [(4, 2), (4, 4), (4, 0), (2, 1)]:
        stats.update(num_draft, num_accepted)
    assert stats.num_drafts == 4
    assert stats.num_draft_tokens == 14
    assert stats.num_accepted_tokens == 7
    assert stats.num_emitted_tokens == 11  # 3 + 5 + 1 + 2
    assert stats.accepted_per_position == [3, 2, 1, 1]
    assert stats.acceptance_rate == pytest.approx(7 / 14)
    assert stats.mean_accepted_length == pytest.approx(11 / 4)


def test_positions_grow_as_k_grows_and_zero_draft_steps_emit_one_token() -> None:
    stats = AcceptanceStats()
    stats.update(0, 0)  # plain decoding step
    assert stats.accepted_per_position == [] and stats.mean_accepted_length == 1.0
    stats.update(2, 2)
    stats.update(6, 1)
    assert stats.accepted_per_position == [2, 1, 0, 0, 0, 0]
    assert stats.acceptance_rate == pytest.approx(3 / 8)
    assert stats.mean_accepted_length == pytest.approx((1 + 3 + 2) / 3)


def test_empty_stats_have_zero_rates() -> None:
    stats = AcceptanceStats()
    assert stats.acceptance_rate == 0.0 and stats.mean_accepted_length == 0.0


def test_merge_adds_counters_like_one_stream() -> None:
    pattern_a, pattern_b = [(3, 3), (3, 1)], [(5, 4), (1, 0)]
    a, b, both = AcceptanceStats(), AcceptanceStats(), AcceptanceStats()
    for num_draft, num_accepted in pattern_a:
        a.update(num_draft, num_accepted)
        both.update(num_draft, num_accepted)
    for num_draft, num_accepted in pattern_b:
        b.update(num_draft, num_accepted)
        both.update(num_draft, num_accepted)
    assert a.merge(b) is a
    assert a == both
    assert a.accepted_per_position == [3, 2, 2, 1, 0]


def test_as_dict_has_counters_and_rates() -> None:
    stats = AcceptanceStats()
    stats.update(4, 3)
    assert stats.as_dict() == {
        "num_drafts": 1,
        "num_draft_tokens": 4,
        "num_accepted_tokens": 3,
        "accepted_per_position": [1, 1, 1, 0],
        "num_emitted_tokens": 4,
        "acceptance_rate": 0.75,
        "mean_accepted_length": 4.0,
    }


@pytest.mark.parametrize(("num_draft", "num_accepted"), [(2, 3), (-1, 0), (2, -1)])
def test_impossible_updates_raise_value_error(num_draft: int, num_accepted: int) -> None:
    with pytest.raises(ValueError):
        AcceptanceStats().update(num_draft, num_accepted)


@pytest.mark.parametrize(
    ("alpha", "k", "expected"),
    [(0.5, 2, 1.75), (0.0, 4, 1.0), (1.0, 4, 5.0), (0.8, 0, 1.0), (0.8, 3, 1 + 0.8 + 0.64 + 0.512)],
)
def test_expected_accepted_length(alpha: float, k: int, expected: float) -> None:
    assert expected_accepted_length(alpha, k) == pytest.approx(expected)


def test_expected_accepted_length_is_continuous_at_one() -> None:
    assert math.isclose(expected_accepted_length(1 - 1e-9, 4), 5.0, rel_tol=1e-6)


@pytest.mark.parametrize(("alpha", "k"), [(-0.1, 2), (1.5, 2), (0.5, -1)])
def test_expected_accepted_length_rejects_bad_input(alpha: float, k: int) -> None:
    with pytest.raises(ValueError):
        expected_accepted_length(alpha, k)
