"""Token Recycling's table and trees (`draft/recycling.py`), and greedy tree speculation with them
at the algorithm level (`verify/tree.tree_accept` against a toy target): the tokens are the
target-only greedy tokens, and after the table has seen the target's rankings a step keeps more
than one token on average."""

from __future__ import annotations

import pytest
import torch

from specdec.draft.recycling import RecycledCandidates
from specdec.verify.tree import tree_accept

V = 24
PERM_A = torch.randperm(V, generator=torch.Generator().manual_seed(1)).tolist()
PERM_B = torch.randperm(V, generator=torch.Generator().manual_seed(2)).tolist()


def target_ranking(prefix: list[int]) -> list[int]:
    """A toy target's best two next tokens: one permutation of the last token or another,
    chosen by the token before it (so a table keyed on one token needs its second choice too)."""
    a, b = prefix[-2], prefix[-1]
    first, second = (PERM_A[b], PERM_B[b]) if a % 3 else (PERM_B[b], PERM_A[b])
    return [first, second] if second != first else [first]


def test_a_tree_grows_from_the_table_breadth_first_within_its_budget():
    table = RecycledCandidates(V, k=3)
    table.update([1, 2, 3], [[2, 3, 3], [4, -1, -1], [5, 6, 7]])
    assert table.propose(1, widths=(3, 2)) == ([-1, 0, 0, 1, 2, 2], [1, 2, 3, 4, 5, 6])  # 3 twice: once
    assert table.propose(1, widths=(3, 2), max_rows=4) == ([-1, 0, 0, 1], [1, 2, 3, 4])
    assert table.propose(9, widths=(3,)) == ([-1], [9])  # nothing known after 9: the root alone
    table.update([2], [[8]])  # a later row wins
    assert table.propose(2, widths=(3,)) == ([-1, 0], [2, 8])


def test_bad_input_is_refused():
    table = RecycledCandidates(V)
    with pytest.raises(ValueError, match="token ids"):
        table.update([V], [[1]])
    with pytest.raises(ValueError, match="candidates"):
        table.update([1], [[V]])
    with pytest.raises(ValueError, match="max_rows"):
        table.propose(1, (2,), max_rows=65)


def test_greedy_tree_speculation_gives_the_target_only_tokens():
    prompt = [3, 7]
    plain = list(prompt)
    while len(plain) < 80:
        plain.append(target_ranking(plain)[0])

    table = RecycledCandidates(V, k=2)
    seq, steps = list(prompt), 0
    while len(seq) < 80:
        parents, tokens = table.propose(seq[-1], widths=(2, 2, 1, 1), max_rows=16)
        prefixes = []
        for row in range(len(tokens)):  # each row's prefix: the sequence, then its path's drafts
            path, r = [], row
            while r > 0:
                path.append(tokens[r])
                r = parents[r]
            prefixes.append(seq + path[::-1])
        rankings = [target_ranking(p) for p in prefixes]
        probs = torch.zeros(len(tokens), V)
        for row, ranking in enumerate(rankings):
            probs[row, ranking[0]] = 1.0
        out = tree_accept(parents, tokens, probs, greedy=True)
        table.update(tokens, [r + [-1] * (2 - len(r)) for r in rankings])  # the forward's rankings, recycled
        seq += out.token_ids
        steps += 1
    assert seq[:80] == plain
    assert (len(seq) - len(prompt)) / steps > 2.0  # tokens a step: one a step without a tree
