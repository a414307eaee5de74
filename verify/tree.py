"""Verifying a token tree (issue 62): the path of drafts the target keeps, and one token of its own.

A tree window has row 0, the sequence's last token (not a draft), and draft rows 1..n-1, each
under an earlier row (`parents`); `target_probs[u]` is the target's distribution after row u's
path. From the root down, the children of the current row are tried in row order as one-hot
proposals, SpecInfer's multi-candidate rejection sampling with a deterministic proposer: child c
(token x) is accepted with probability r(x) / sum(r), r the current row's residual (its
distribution with the tokens of the children already rejected removed); a rejected child's token
leaves the residual. An accepted child becomes the current row; when no child is accepted, the
**recovered** token is sampled from the residual (the **bonus** token from the distribution of an
accepted leaf). So each emitted token is distributed as the target's at its place, whatever the
tree: greedy (one-hot p) keeps the child whose token is the target's argmax and ends with it.

Vocabulary as `rejection.py`: accepted, recovered, bonus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.verify.sampling import sample


@dataclass
class TreeVerifyOutput:
    """One tree's result: `path`, the accepted draft rows from the root down; `token_ids`, their
    tokens then the recovered or bonus token."""

    path: list[int]
    token_ids: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def tree_accept(
    parents: list[int],  # [n]: parents[0] == -1 (the root), then each row's parent, an earlier row
    token_ids: list[int],  # [n]: each row's token (row 0's is the sequence's last token)
    target_probs: torch.Tensor,  # [n, V]: the target's distribution after each row
    generator: torch.Generator | None = None,
    greedy: bool = False,
) -> TreeVerifyOutput:
    """The accepted path of one token tree and the token after it (see the module docstring).

    Randomness: one uniform per child tried, then the final token's draw (`sample`), all from
    `generator` where one is given. `greedy` (one-hot `target_probs`, known to the caller) draws
    nothing.

    Example: rows 0 (root), 1 and 2 under it (tokens 7, 4), 3 under 1 (token 2); greedy, the
    target's argmax after row 0 is 4, after row 2 is 9: child 1 (7) is rejected, child 2 (4)
    accepted; row 2 has no children, so 9 is the bonus token -> path [2], token_ids [4, 9].
    """
    _check(parents, token_ids, target_probs)
    children: list[list[int]] = [[] for _ in parents]
    for row, parent in enumerate(parents[1:], start=1):
        children[parent].append(row)
    path: list[int] = []
    row = 0
    while True:
        residual = target_probs[row].float()
        if greedy:
            best = int(residual.argmax())
            kept = next((c for c in children[row] if token_ids[c] == best), None)
        else:
            residual = residual.clone()
            kept = None
            for child in children[row]:
                token = token_ids[child]
                u = float(torch.rand((), generator=generator, device=generator.device if generator else "cpu"))
                if u * float(residual.sum()) < float(residual[token]):
                    kept = child
                    break
                residual[token] = 0.0  # rejected: the next child is tried against the rest
        if kept is None:
            if not greedy and residual.sum() <= 0:  # rounding: the children held all the mass
                residual = target_probs[row].float()
            final = int(sample(residual.unsqueeze(0), [generator], greedy)[0])
            return TreeVerifyOutput(path, [token_ids[r] for r in path] + [final])
        path.append(kept)
        row = kept


def _check(parents: list[int], token_ids: list[int], target_probs: torch.Tensor) -> None:
    n = len(parents)
    if n == 0 or parents[0] != -1:
        raise ValueError("a tree's row 0 is its root: parents[0] must be -1")
    if any(not 0 <= p < row for row, p in enumerate(parents[1:], start=1)):
        raise ValueError(f"each row's parent must be an earlier row, got {parents}")
    if len(token_ids) != n or target_probs.dim() != 2 or target_probs.shape[0] != n:
        raise ValueError(f"token_ids and target_probs need one entry a row ({n}), got {len(token_ids)} and "
                         f"{list(target_probs.shape)}")
