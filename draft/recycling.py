"""Token Recycling's candidates (arXiv 2408.08696; issue 62's draft-free tree proposer), the table
and the tree it grows; not wired into the engine's step yet.

Every verify forward scores each of its rows' next tokens; the best few of them, thrown away after
the step, are what the target would likely say after that row's token next time too. The table
keeps, for each token id, the target's top-k next tokens from the last row that held that token
(`update`: int32 `[V, k]`, 600 KB at V = 151,936 and k = 1). `propose` grows a tree from the
sequence's last token by a fixed template: a node at depth d gets the first `widths[d]` of its
token's candidates as children (none where the table knows none), breadth first, up to `max_rows`
rows. No draft model, no training: any target gets a tree.

    >>> table = RecycledCandidates(vocab_size=10, k=2)
    >>> table.update([3, 5], [[5, 7], [1, -1]])   # after 3 the target ranked 5, 7; after 5: 1
    >>> table.propose(3, widths=(2, 1))
    ([-1, 0, 0, 1], [3, 5, 7, 1])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.cache.metadata import MAX_TREE_ROWS


class RecycledCandidates:
    """For each token id, the target's `k` best next tokens the last time a row held it (-1: none
    yet)."""

    def __init__(self, vocab_size: int, k: int = 2) -> None:
        if vocab_size < 1 or k < 1:
            raise ValueError(f"vocab_size and k must be >= 1, got {vocab_size} and {k}")
        self.k = k
        self.table = torch.full((vocab_size, k), -1, dtype=torch.int32)  # [V, k]

    def update(self, token_ids: Sequence[int] | torch.Tensor, top_ids: Sequence[Sequence[int]] | torch.Tensor) -> None:
        """Row i's token `token_ids[i]` was followed, in the target's ranking, by `top_ids[i]` (its
        first k kept); a later row with the same token wins."""
        tokens = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)  # [R]
        tops = torch.as_tensor(top_ids, dtype=torch.int32).reshape(tokens.numel(), -1)[:, : self.k]  # [R, <=k]
        vocab = self.table.shape[0]
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            raise ValueError(f"token ids must be in 0..{vocab - 1}")
        if tops.numel() and (int(tops.min()) < -1 or int(tops.max()) >= vocab):
            raise ValueError(f"candidates must be token ids in 0..{vocab - 1}, or -1")
        rows = torch.full((tokens.numel(), self.k), -1, dtype=torch.int32)
        rows[:, : tops.shape[1]] = tops
        for i in range(tokens.numel()):  # in order, so the last of a repeated token wins
            self.table[tokens[i]] = rows[i]

    def propose(self, last_token: int, widths: Sequence[int], max_rows: int = 16) -> tuple[list[int], list[int]]:
        """`(parents, token_ids)` of a tree for `verify.tree.tree_accept` and `cache.metadata.with_tree`:
        row 0 the last token, then breadth first each node's first `widths[depth]` candidates
        (a token already among its siblings skipped), at most `max_rows` rows (up to 64)."""
        if not 1 <= max_rows <= MAX_TREE_ROWS:
            raise ValueError(f"max_rows must be in 1..{MAX_TREE_ROWS}, got {max_rows}")
        parents, tokens, depths = [-1], [int(last_token)], [0]
        row = 0
        while row < len(tokens) and len(tokens) < max_rows:
            depth = depths[row]
            if depth < len(widths):
                seen: set[int] = set()
                for candidate in self.table[tokens[row]].tolist()[: widths[depth]]:
                    if candidate < 0 or candidate in seen or len(tokens) == max_rows:
                        continue
                    seen.add(candidate)
                    parents.append(row)
                    tokens.append(candidate)
                    depths.append(depth + 1)
            row += 1
        return parents, tokens
