"""Token-tree verification (`verify/tree.py`): greedy keeps the target's argmax path; at T > 0 the
first emitted token is distributed as the target's at the root, and the next one, after an
accepted child, as the target's at that child (total variation against the exact tables), with a
negative control (no residual: a rejected child's token left in) that the same bound catches."""

from __future__ import annotations

import pytest
import torch

from specdec.verify.tree import tree_accept

N = 20_000
TV = 0.035  # sampling noise over 6 cells at N = 20k: ~0.015
# rows: 0 the root; 1 (token 1) and 2 (token 3) under it; 3 (token 0) and 4 (token 1) under 1
PARENTS = [-1, 0, 0, 1, 1]
TOKENS = [5, 1, 3, 0, 1]
P = torch.tensor([
    [0.05, 0.40, 0.05, 0.30, 0.10, 0.10],  # after the root
    [0.30, 0.20, 0.10, 0.10, 0.20, 0.10],  # after row 1
    [0.10, 0.10, 0.50, 0.10, 0.10, 0.10],
    [1 / 6] * 6,
    [1 / 6] * 6,
])


def test_greedy_keeps_the_argmax_path_and_ends_with_the_targets_token():
    probs = torch.zeros(4, 10)
    for row, best in enumerate([4, 2, 9, 9]):
        probs[row, best] = 1.0
    out = tree_accept([-1, 0, 0, 1], [8, 7, 4, 2], probs, greedy=True)
    assert (out.path, out.token_ids) == ([2], [4, 9])  # row 1 (7) rejected, row 2 (4) kept, bonus 9
    chain = tree_accept([-1, 0, 1, 2], [8, 4, 9, 1], torch.stack([probs[0], probs[2], probs[1], probs[3]]),
                        greedy=True)
    assert (chain.path, chain.token_ids) == ([1, 2], [4, 9, 2])  # a chain: accept while argmax == draft


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="root"):
        tree_accept([0, 0], [1, 2], P[:2])
    with pytest.raises(ValueError, match="earlier row"):
        tree_accept([-1, 2, 0], [1, 2, 3], P[:3])
    with pytest.raises(ValueError, match="one entry a row"):
        tree_accept([-1, 0], [1], P[:2])


def _broken_accept(generator):
    """No residual: each child tried against the root's whole distribution, the final from it."""
    row = 0
    out = []
    while True:
        kids = [c for c, p in enumerate(PARENTS) if p == row]
        kept = next((c for c in kids if torch.rand((), generator=generator) < P[row, TOKENS[c]]), None)
        if kept is None:
            return out + [int(torch.multinomial(P[row], 1, generator=generator))]
        out.append(TOKENS[kept])
        row = kept


def _tv(counts: torch.Tensor, exact: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - exact).abs().sum())


@pytest.mark.parametrize("broken", [False, True], ids=["tree_accept", "negative-control"])
def test_emitted_tokens_are_the_targets_distribution(broken):
    gen = torch.Generator().manual_seed(7)
    first, after_row1 = torch.zeros(6), torch.zeros(6)
    for _ in range(N):
        tokens = _broken_accept(gen) if broken else tree_accept(PARENTS, TOKENS, P, gen).token_ids
        first[tokens[0]] += 1
        if tokens[0] == TOKENS[1] and len(tokens) > 1:  # row 1 accepted: the next token is row 1's
            after_row1[tokens[1]] += 1
    bad = _tv(first, P[0]) > TV or _tv(after_row1, P[1]) > TV
    assert bad == broken, (_tv(first, P[0]), _tv(after_row1, P[1]))
