"""Token trees from the draft model (issue 62; EAGLE-2's dynamic trees on the draft's own cache).

The draft scores a tree a level at a time. Its catch-up forward gives the root's next-token
distribution; the root's `TOP_CHILDREN` most likely tokens become candidates, each scored by its
**path probability** (the product of the draft's probabilities along its path, the chance the
target keeps the whole path if the draft were right about it). Each level then feeds the best
`beam` candidates of the level just added, in one forward for every row, and their children join
the candidates. After `depth` levels the tree is the `nodes` best candidates by path probability:
a child never scores above its parent, so the best are always a tree.

A candidate whose path probability is already below the `nodes`-th best is not fed: none of its
descendants could make the tree. A row whose candidates all fall there stops early (fewer forwards).

The draft cache holds the root's prefix; the fed nodes of a level go in one window of the tree
so far (`Window(parents=...)`: each node attends to the prefix and its ancestors), from the first
slot after the root, every level re-feeding the earlier levels' nodes at the same slots (they are
few, and a window's keys are its own rows or the prefix). After verification `keep_path` keeps the
accepted path's fed nodes, moved to their positions, and drops the rest; the next catch-up feeds
what the draft never saw.

The tree is a deterministic function of the draft's logits (after the row's logit controls), so
`verify.tree.tree_accept`'s multi-candidate rejection sampling keeps the target's distribution at
any temperature.

Example (nodes 3, beam 1, depth 2): root's top tokens a (.6), b (.3); a fed; a's top c (.5) ->
candidates a .6, b .3, c .3 -> tree [a, b, c] with parents [0, 0, 1] (ties: the earlier first).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch

from specdec.draft.base import DraftSequence, SamplingTensors
from specdec.target.runner import Window

TOP_CHILDREN = 4  # candidates taken under each fed node
BEAM = 3  # nodes fed per level and row


@dataclass
class _Node:
    token: int
    parent: int  # index of the parent node in the row's candidates; -1: the root
    depth: int  # 1 under the root
    score: float  # log path probability
    fed: int = -1  # its row in the draft's tree window (-1: never fed)


@dataclass
class DraftTree:
    """One row's grown tree: the verify window's `parents` and `tokens` (drafts only, parents as
    `DraftOutput.parents`: 0 the root), and each draft's fed row in the draft's window (-1: not fed)."""

    parents: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)
    start: int = 0  # the draft table's first tree slot (the root's position + 1)

    def draft_path(self, path: list[int]) -> list[int]:
        """The draft window's rows (1 + fed row) of the accepted `path`'s fed prefix (verify rows)."""
        rows = []
        for r in path:
            if self.fed[r - 1] < 0:
                break
            rows.append(self.fed[r - 1] + 1)
        return rows


class _RowTree:
    """One row's candidates while the tree grows."""

    def __init__(self, nodes: int, depth: int, start: int) -> None:
        self.nodes, self.depth, self.start = nodes, depth, start
        self.cands: list[_Node] = []
        self.fed: list[int] = []  # candidate indices in fed order
        self.best: list[float] = []  # min-heap of the `nodes` best scores so far

    def bar(self) -> float:
        """The score a candidate's children must beat to make the tree."""
        return self.best[0] if len(self.best) >= self.nodes else -math.inf

    def add(self, parent: int, logp: torch.Tensor) -> list[int]:
        """Children of candidate `parent` (-1: root) from its log-probabilities; returns them."""
        base = 0.0 if parent < 0 else self.cands[parent].score
        depth = 1 if parent < 0 else self.cands[parent].depth + 1
        values, ids = logp.topk(min(TOP_CHILDREN, logp.numel()))
        added = []
        for v, t in zip(values.tolist(), ids.tolist()):
            score = base + v
            if score == -math.inf or score <= self.bar():
                continue
            self.cands.append(_Node(t, parent, depth, score))
            added.append(len(self.cands) - 1)
            heapq.heappush(self.best, score)
            if len(self.best) > self.nodes:
                heapq.heappop(self.best)
        return added

    def to_feed(self, added: list[int]) -> list[int]:
        """The best `BEAM` of the level just added whose children could still make the tree."""
        if not added or self.cands[added[0]].depth >= self.depth:
            return []
        order = sorted(added, key=lambda i: -self.cands[i].score)[:BEAM]
        return [i for i in order if self.cands[i].score > self.bar()]

    def path(self, i: int) -> list[int]:
        tokens = []
        while i >= 0:
            tokens.append(self.cands[i].token)
            i = self.cands[i].parent
        return tokens[::-1]

    def window(self, table) -> Window:
        """The tree window of every fed node (the newly fed last, their logits kept)."""
        rows = {c: r for r, c in enumerate(self.fed)}
        parents = [rows[self.cands[c].parent] if self.cands[c].parent >= 0 else -1 for c in self.fed]
        return Window(table, [self.cands[c].token for c in self.fed], 0, parents=parents)

    def result(self) -> DraftTree:
        chosen = sorted(range(len(self.cands)), key=lambda i: (-self.cands[i].score, i))[: self.nodes]
        chosen.sort(key=lambda i: (self.cands[i].depth, i))  # parents before children
        rows = {c: r + 1 for r, c in enumerate(chosen)}
        tree = DraftTree(start=self.start)
        for c in chosen:  # a parent scores at least its child and comes first: it is chosen too
            node = self.cands[c]
            tree.parents.append(rows[node.parent] if node.parent >= 0 else 0)
            tree.tokens.append(node.token)
            tree.fed.append(node.fed)
        return tree


def grow_trees(
    proposer, seqs: list[DraftSequence], depth: list[int], nodes: list[int], sampling: SamplingTensors,
) -> list[DraftTree | None]:
    """A tree per row (None where `depth[b]` or `nodes[b]` is 0); `proposer` a `DraftModelProposer`
    whose queued fills ride in the catch-up forward."""
    rows = [b for b in range(len(seqs)) if depth[b] > 0 and nodes[b] > 0]
    trees: dict[int, _RowTree] = {}
    if not rows:
        return [None] * len(seqs)
    windows = [proposer._catch_up(seqs[b], []) for b in rows] + proposer._take_fill()
    logits = proposer._forward(windows)  # [A, V]: each row's root
    for b in rows:
        trees[b] = _RowTree(nodes[b], depth[b], seqs[b].draft_table.num_computed)
    owners = list(rows)
    parents = [-1] * len(rows)  # the candidate each logits row scores (-1: the root)
    while owners:
        extra = [trees[b].path(c) if c >= 0 else [] for b, c in zip(owners, parents)]
        logp = torch.log_softmax(sampling.controlled(logits, owners, extra).float(), dim=-1)  # [A, V]
        feed: dict[int, list[int]] = {}
        for a, (b, c) in enumerate(zip(owners, parents)):
            feed.setdefault(b, [])
            feed[b] += trees[b].add(c, logp[a])
        owners, parents, windows = [], [], []
        for b, added in feed.items():
            tree = trees[b]
            new = tree.to_feed(added)
            if not new:
                continue
            for c in new:
                tree.cands[c].fed = len(tree.fed)
                tree.fed.append(c)
            table = seqs[b].draft_table
            table.num_computed = tree.start  # every level re-feeds the tree from its first slot
            w = tree.window(table)
            w.num_logits = len(new)
            windows.append(w)
            owners += [b] * len(new)
            parents += new
        if windows:
            logits = proposer._forward(windows)
    out: list[DraftTree | None] = [None] * len(seqs)
    for b, tree in trees.items():
        out[b] = tree.result()
    return out
