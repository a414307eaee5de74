"""The draft-model proposer: it first feeds what its cache lacks (the catch-up) with the step's
queued fills in the same forward, then drafts one token per forward, stopping early when unsure."""

import pytest
import torch

from specdec.draft import DraftModelProposer, SeqPlan, StepTimings
from specdec.target.runner import Window

from .conftest import CountingForward, greedy, plan_of, seq_with_cache


def reference_greedy(model_runner, tokens, k):
    """k greedy tokens of the draft model from a fresh cache, one forward per token."""
    seq = seq_with_cache(model_runner, tokens, 0)
    out = []
    logits = model_runner.forward([Window(seq.draft_table, tokens)])
    for _ in range(k):
        out.append(int(logits[-1].argmax()))
        logits = model_runner.forward([Window(seq.draft_table, [out[-1]])])
    return out


def test_catch_up_then_one_forward_per_draft(runner):
    tokens = [5, 6, 7, 8, 9, 10, 11]
    proposer = DraftModelProposer(runner)
    seq = seq_with_cache(runner, tokens, cached=3)  # the cache lacks 4 tokens
    calls = CountingForward(runner)
    out = proposer.propose(plan_of([SeqPlan(seq, cap=3, num_draft=3)]), greedy(1))
    assert calls.calls == [[4], [1], [1]]  # the catch-up in the first forward, d_3 never fed
    assert out.num_draft == [3] and out.probs.shape[:2] == (1, 3)
    assert out.token_ids[0].tolist() == reference_greedy(runner, tokens, 3)
    assert seq.draft_table.num_computed == len(tokens) + 2
    assert torch.allclose(out.probs.sum(-1), torch.ones(1, 3))


def test_rows_draft_their_own_lengths_and_fills_ride_along(runner):
    proposer = DraftModelProposer(runner)
    a = seq_with_cache(runner, [5, 6, 7, 8], cached=3)
    b = seq_with_cache(runner, [9, 10, 11], cached=2)
    idle = seq_with_cache(runner, [12, 13], cached=1)  # decodes without drafting this step
    filling = seq_with_cache(runner, list(range(20, 40)), cached=0)  # a prompt stretch beside
    calls = CountingForward(runner)
    rows = [SeqPlan(a, cap=3, num_draft=3), SeqPlan(b, cap=1, num_draft=1), SeqPlan(idle)]
    out = proposer.propose(plan_of(rows, [SeqPlan(filling, draft_fill=8)]), greedy(3))
    assert calls.calls == [[1, 1, 8], [1], [1]]  # fills in the first forward; b stops after 1
    assert out.num_draft == [3, 1, 0]
    assert out.token_ids[1, 1:].tolist() == [-1, -1] and out.token_ids[2].tolist() == [-1, -1, -1]
    assert filling.draft_table.num_computed == 8 and idle.draft_table.num_computed == 1


def test_fills_run_in_one_forward_when_nothing_drafts(runner):
    proposer = DraftModelProposer(runner)
    filling = seq_with_cache(runner, list(range(20, 40)), cached=4)
    decoding = seq_with_cache(runner, [5, 6], cached=1)
    calls = CountingForward(runner)
    out = proposer.propose(plan_of([SeqPlan(decoding, cap=2)], [SeqPlan(filling, draft_fill=6)]), greedy(1))
    assert calls.calls == [[6]] and out.num_draft == [0] and out.token_ids.shape == (1, 0)
    assert filling.draft_table.num_computed == 10


@pytest.mark.parametrize("stop_below, drafted", [(0.0, 4), (1e-12, 4), (0.999999, 1)])
def test_early_stop_on_the_drafts_own_confidence(runner, stop_below, drafted):
    """Greedy q is one-hot, so the stop reads the draft's softmax: a random tiny draft is never
    that sure, so a bar near 1 stops after d_1 (still proposed) and a negligible one never stops."""
    proposer = DraftModelProposer(runner, stop_below=stop_below)
    seq = seq_with_cache(runner, [5, 6, 7, 8], cached=3)
    calls = CountingForward(runner)
    out = proposer.propose(plan_of([SeqPlan(seq, cap=4, num_draft=4)]), greedy(1))
    assert out.num_draft == [drafted] and len(calls.calls) == drafted


def test_a_cut_heads_confidence_is_normalized_over_its_own_ids():
    """With a cut head (`restrict_head`) the greedy confidence's softmax spans the head's ids: the
    same probabilities as over the whole expanded row, whose other ids hold FILL."""
    from specdec.draft.vocab import expand_logits

    g = torch.Generator().manual_seed(0)
    head_ids = torch.randperm(1000, generator=g)[:200].sort().values
    cut = torch.randn(3, 200, generator=g) * 4
    full = expand_logits(cut, head_ids, 1000)
    tokens = full.argmax(-1)
    probs = torch.nn.functional.one_hot(tokens, 1000).float()
    whole = DraftModelProposer._confidence(full, probs, tokens, greedy(3))
    ours = DraftModelProposer._confidence(full, probs, tokens, greedy(3), head_ids)
    assert torch.allclose(ours, whole, rtol=1e-6) and torch.allclose(whole, cut.softmax(-1).max(-1).values, rtol=1e-5)
    wrong = DraftModelProposer._confidence(full, probs, tokens, greedy(3), head_ids.flip(0)[:100])
    assert not torch.allclose(wrong, whole, rtol=1e-3)  # a normalizer over other ids is caught


def test_timings_record_each_forward_while_enabled(runner):
    timings = StepTimings(enabled=True)
    proposer = DraftModelProposer(runner, timings)
    seq = seq_with_cache(runner, [5, 6, 7, 8], cached=2)
    proposer.propose(plan_of([SeqPlan(seq, cap=2, num_draft=2)]), greedy(1))
    assert [rows for rows, _ in timings.draft] == [2, 1] and all(s > 0 for _, s in timings.draft)
    assert proposer.forward_seconds is timings.draft
    timings.enabled = False
    again = seq_with_cache(runner, [5, 6, 7, 8], cached=2)
    proposer.propose(plan_of([SeqPlan(again, cap=2, num_draft=2)]), greedy(1))
    assert len(timings.draft) == 2
