"""Prompt lookup: what followed the latest earlier occurrence of the longest repeated suffix."""

import pytest

from specdec.draft import NgramProposer, SeqPlan

from .conftest import Seq, greedy, plan_of


@pytest.mark.parametrize("tokens, k, expected", [
    ([5, 6, 7, 8, 5, 6], 3, [7, 8, 5]),  # the suffix [5 6] occurred at 0
    ([5, 6, 7, 8, 5, 6], 1, [7]),  # at most k
    ([1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 2, [9, 2]),  # the longest suffix first: [1 2 3] at 0, not [2 3] at 4
    ([1, 2, 3, 4], 3, []),  # nothing repeats
    ([5, 6, 5, 6], 0, []),  # k = 0 looks nothing up
])
def test_lookup(tokens, k, expected):
    ngram = NgramProposer(min_n=1, max_n=3)
    assert ngram.lookup(tokens, k) == expected


def test_longer_ngrams_win_over_later_shorter_ones():
    ngram = NgramProposer(min_n=1, max_n=2)
    # suffix [3 4]: latest earlier match at 2 -> [8]; the unigram [4] matched later (at 6) -> [3]
    assert ngram.lookup([1, 2, 3, 4, 8, 0, 4, 3, 4], 1) == [8]


def test_min_n_bounds_the_suffix():
    tokens = [7, 1, 2, 3, 7]  # only the unigram [7] repeats
    assert NgramProposer(min_n=1, max_n=4).lookup(tokens, 2) == [1, 2]
    assert NgramProposer(min_n=2, max_n=4).lookup(tokens, 2) == []
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=3, max_n=2)


def test_propose_pads_rows_and_is_deterministic():
    ngram = NgramProposer(min_n=1, max_n=3)
    rows = [SeqPlan(Seq([5, 6, 7, 8, 5, 6]), cap=3, num_draft=3), SeqPlan(Seq([1, 2, 3]), cap=3, num_draft=3),
            SeqPlan(Seq([4, 4]), cap=0, num_draft=0)]
    out = ngram.propose(plan_of(rows), greedy(3))
    assert out.probs is None  # q is one-hot: the verifier treats it so
    assert out.num_draft == [3, 0, 0]
    assert out.token_ids.tolist() == [[7, 8, 5], [-1, -1, -1], [-1, -1, -1]]
    nothing = ngram.propose(plan_of([SeqPlan(Seq([5, 5]))]), greedy(1))
    assert nothing.num_draft == [0] and nothing.token_ids.shape == (1, 0)
