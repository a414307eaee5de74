"""Hybrid: prompt lookup where a repeated n-gram is found (q one-hot at its tokens), the draft model
elsewhere; lookup may propose even where the model would not draft."""

import torch

from specdec.draft import DraftModelProposer, HybridProposer, SeqPlan

from .conftest import CountingForward, greedy, plan_of, seq_with_cache


def test_lookup_rows_and_model_rows_merge(runner):
    hybrid = HybridProposer(DraftModelProposer(runner))
    repeating = seq_with_cache(runner, [5, 6, 7, 8, 9, 5, 6], cached=6)  # [5 6] repeats -> [7 8 9]
    fresh = seq_with_cache(runner, [10, 11, 12, 13], cached=3)
    calls = CountingForward(runner)
    rows = [SeqPlan(repeating, cap=4, num_draft=2, num_lookup=3), SeqPlan(fresh, cap=4, num_draft=2, num_lookup=3)]
    out = hybrid.propose(plan_of(rows), greedy(2))
    assert out.looked_up == [True, False] and out.feeds_estimate == [False, True]
    assert out.num_draft == [3, 2]
    assert out.token_ids[0].tolist() == [7, 8, 9]
    assert torch.equal(out.probs[0, torch.arange(3), out.token_ids[0]], torch.ones(3))  # one-hot q
    assert out.probs[0].sum().item() == 3
    assert calls.calls == [[1], [1]]  # the model drafts only the row lookup did not cover
    assert repeating.draft_table.num_computed == 6  # its cache catches up at its next model step


def test_lookup_proposes_where_the_model_would_not(runner):
    hybrid = HybridProposer(DraftModelProposer(runner))
    repeating = seq_with_cache(runner, [5, 6, 7, 8, 5, 6], cached=5)
    calls = CountingForward(runner)
    out = hybrid.propose(plan_of([SeqPlan(repeating, cap=4, num_draft=0, num_lookup=4)]), greedy(1))
    assert out.num_draft == [4] and out.token_ids[0].tolist() == [7, 8, 5, 6]
    assert out.probs is None and calls.calls == []  # no forward: q is one-hot by definition


def test_without_lookup_it_is_the_model(runner):
    hybrid = HybridProposer(DraftModelProposer(runner))
    model = DraftModelProposer(runner)
    a = seq_with_cache(runner, [5, 6, 7, 8, 5, 6], cached=5)
    b = seq_with_cache(runner, [5, 6, 7, 8, 5, 6], cached=5)
    out = hybrid.propose(plan_of([SeqPlan(a, cap=2, num_draft=2)]), greedy(1))  # num_lookup 0
    ref = model.propose(plan_of([SeqPlan(b, cap=2, num_draft=2)]), greedy(1))
    assert out.looked_up == [False] and torch.equal(out.token_ids, ref.token_ids)
