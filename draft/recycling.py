"""Token Recycling's candidates (arXiv 2408.08696; issue 62's draft-free tree proposer): the table,
the template tree it grows (`RecycledCandidates.propose`), and the engine's proposer
(`RecyclingProposer`, `--proposer recycling`), which grows trees best first.

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


class RecyclingProposer:
    """The draft-free tree proposer (`--proposer recycling`): Token Recycling's table, grown into
    a tree by expected worth, merged with prompt lookup. No model, no cache.

    Each step, per decoding sequence, nodes are added best first by the chance that the target
    keeps their whole path: a node's chance is its parent's times its kind's measured hit rate
    (`hit_rates`: the table's candidate of rank j, or the next token of a prompt-lookup match), up
    to `SeqPlan.tree_rows` nodes and `SeqPlan.num_draft` deep. After the verify forward `observe`
    feeds the table every row's top-k (all nodes, accepted or not: each is a context the token was
    seen in) and counts, for each node under the accepted path, whether its token was the one
    emitted there.

    Example: the table holds 5, 7 after 3, and 1 after 5; the sequence ends in 3, nothing to look
    up, rank hit rates .6, .2: nodes 5 (.6), 1 under 5 (.36), 7 (.2) -> parents [0, 1, 0].
    """

    pool = None
    KINDS_LOOKUP = -1  # a node's kind: the lookup match's next token; 0..k-1: the table's rank

    def __init__(self, vocab_size: int, k: int = 4, device: str | torch.device = "cpu",
                 timings=None, min_n: int = 2, max_n: int = 4) -> None:
        from specdec.draft.base import StepTimings
        from specdec.draft.ngram import NgramProposer

        self.table = RecycledCandidates(vocab_size, k)
        self.lookup = NgramProposer(min_n, max_n, device)
        self.device = torch.device(device)
        self.timings = timings or StepTimings()
        # hits / tries per kind, rank 0..k-1 then lookup, from a prior of 2 tries
        self.hits = torch.tensor([1.0 / (j + 2) for j in range(k)] + [1.2], dtype=torch.float64)
        self.tries = torch.full((k + 1,), 2.0, dtype=torch.float64)
        self._proposed: list[tuple[list[int], list[int], list[int]] | None] = []  # per row: parents, tokens, kinds

    @property
    def hit_rates(self) -> list[float]:
        """Measured chance that a node of each kind is the target's token where its parent was
        kept: ranks 0..k-1 of the table, then prompt lookup."""
        return (self.hits / self.tries).tolist()

    def draft_slots_needed(self, num_tokens: int, num_draft: int) -> int:
        return 0

    def propose(self, plan, sampling):
        from specdec.draft.base import DraftOutput

        rows = plan.rows
        with self.timings.timing(self.timings.draft, sum(1 for p in rows if p.num_draft), self.device):
            self._proposed = [self.grow(p.seq.token_ids, p.num_draft, p.tree_rows or p.num_draft)
                              if p.num_draft and p.seq.num_pending == 1 else None for p in rows]
        counts = [len(t[1]) if t else 0 for t in self._proposed]
        k = max(counts, default=0)
        token_ids = torch.full((len(rows), k), -1, dtype=torch.long)
        for b, t in enumerate(self._proposed):
            if t:
                token_ids[b, : counts[b]] = torch.tensor(t[1])
        parents = [t[0] if t else None for t in self._proposed]
        return DraftOutput(token_ids.to(self.device), None, counts, parents=parents)

    def grow(self, tokens: list[int], depth: int, nodes: int) -> tuple[list[int], list[int], list[int]]:
        """`(parents, tokens, kinds)` of the drafts of a tree under `tokens[-1]`: at most `nodes`
        nodes, `depth` deep (parents as `DraftOutput.parents`: 0 the root)."""
        import heapq

        rates = self.hit_rates
        lookup = self.lookup.lookup(tokens, depth)
        parents: list[int] = []
        out_tokens: list[int] = []
        kinds: list[int] = []
        children: dict[int, set[int]] = {0: set()}
        heap: list[tuple[float, int, int, int, int, int]] = []  # (-chance, order, parent row, token, depth, kind)
        order = 0

        def push(row: int, token: int, at_depth: int, chance: float, on_lookup: int | None) -> None:
            nonlocal order
            if at_depth >= depth:
                return
            if on_lookup is not None and on_lookup < len(lookup):
                heapq.heappush(heap, (-chance * rates[-1], order, row, lookup[on_lookup], at_depth + 1, -1 - on_lookup))
                order += 1
            for rank, candidate in enumerate(self.table.table[token].tolist()):
                if candidate >= 0:
                    heapq.heappush(heap, (-chance * rates[rank], order, row, candidate, at_depth + 1, rank))
                    order += 1

        push(0, tokens[-1], 0, 1.0, 0)
        while heap and len(out_tokens) < nodes:
            neg, _, parent, token, at_depth, kind = heapq.heappop(heap)
            if token in children[parent]:
                continue
            children[parent].add(token)
            parents.append(parent)
            out_tokens.append(token)
            kinds.append(kind if kind >= 0 else self.KINDS_LOOKUP)
            row = len(out_tokens)
            children[row] = set()
            push(row, token, at_depth, -neg, -kind if kind < 0 else None)
        return parents, out_tokens, kinds

    def observe(self, seqs, draft, logits: torch.Tensor, emitted: list[list[int]]) -> None:
        """After the verify forward (`logits [sum(n_b + 1), V]`, each sequence's root row then its
        drafts' rows) and acceptance (`emitted[b]`, from the root's next token on): the table
        learns every row's top-k, the hit rates every node tried under the kept path.
        A request that does not speculate (k = 0: a benchmark's target-only baseline) teaches
        nothing, so a baseline run never hands the table the answer to the same prompt."""
        rows: list[int] = []
        tokens: list[int] = []
        at = 0
        for b, seq in enumerate(seqs):
            proposed = self._proposed[b] if b < len(self._proposed) else None
            row_tokens = [seq.token_ids[-1]] + (proposed[1] if proposed else [])
            if seq.num_speculative_tokens > 0:
                tokens += row_tokens
                rows += range(at, at + len(row_tokens))
            at += len(row_tokens)
            if proposed:
                self._count(proposed, emitted[b])
        self._proposed = []
        if rows and at == logits.shape[0]:
            index = torch.tensor(rows, device=logits.device)
            self.table.update(tokens, logits.index_select(0, index).topk(self.table.k, dim=-1).indices.cpu())

    def _count(self, proposed: tuple[list[int], list[int], list[int]], emitted: list[int]) -> None:
        """Each node whose parent is on the kept path (the root, then the accepted nodes) was tried."""
        parents, tokens, kinds = proposed
        kept_rows = {0: 0}  # window row -> its depth
        for row, (parent, token) in enumerate(zip(parents, tokens), start=1):
            if parent in kept_rows:
                depth = kept_rows[parent]
                hit = depth < len(emitted) and emitted[depth] == token
                kind = kinds[row - 1]  # KINDS_LOOKUP (-1) is the last slot
                self.tries[kind] += 1
                self.hits[kind] += hit
                if hit and depth + 1 < len(emitted):
                    kept_rows[row] = depth + 1
