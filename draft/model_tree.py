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
few, and a window's keys are its own rows or the prefix). While the fed nodes form a chain (one a
level, each under the one before: what priced trees feed where the draft is sure), a level feeds
its one node after them instead, as a chain's draft forward does. After verification `keep_path` keeps the
accepted path's fed nodes, moved to their positions, and drops the rest; the next catch-up feeds
what the draft never saw.

The tree is a deterministic function of the draft's logits (after the row's logit controls), so
`verify.tree.tree_accept`'s multi-candidate rejection sampling keeps the target's distribution at
any temperature.

Example (nodes 3, beam 1, depth 2): root's top tokens a (.6), b (.3); a fed; a's top c (.5) ->
candidates a .6, b .3, c .3 -> tree [a, b, c] with parents [0, 0, 1] (ties: the earlier first).
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

import torch

from specdec.draft.base import DraftSequence, SamplingTensors
from specdec.target.runner import Window

TOP_CHILDREN = 4  # candidates taken under each fed node
BEAM = 3  # nodes fed per level and row
# Calibration bins of the draft's path probability (`NodeCalibration`)
BIN_EDGES = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
CALIBRATION_PRIOR = 4.0  # a bin starts as this many nodes accepted at its middle probability
CALIBRATION_DECAY = 0.999  # per observed tree: older trees weigh less


class NodeCalibration:
    """How often a tree node of each draft path probability is on the accepted path (the target
    keeps it): what a node is worth, in tokens, when the planner prices trees. Bins of
    `BIN_EDGES`, each from a prior of its middle probability (the draft taken at its word).

    >>> cal = NodeCalibration()
    >>> round(cal(0.95), 2)          # no tree seen yet: the prior
    0.95
    >>> for _ in range(200): cal.observe([0.95], [False])
    >>> cal(0.95) < 0.2
    True
    """

    def __init__(self) -> None:
        mids = [(a + b) / 2 for a, b in zip(BIN_EDGES, BIN_EDGES[1:])]
        self.hits = [CALIBRATION_PRIOR * m for m in mids]
        self.tries = [CALIBRATION_PRIOR] * len(mids)

    @staticmethod
    def _bin(p: float) -> int:
        return min(max(bisect.bisect_right(BIN_EDGES, p) - 1, 0), len(BIN_EDGES) - 2)

    def __call__(self, p: float) -> float:
        """The measured chance that a node of draft path probability `p` is accepted."""
        b = self._bin(p)
        return self.hits[b] / self.tries[b]

    def observe(self, probs: list[float], accepted: list[bool]) -> None:
        """One verified tree: each node's draft path probability and whether it was kept."""
        self.hits = [h * CALIBRATION_DECAY for h in self.hits]
        self.tries = [t * CALIBRATION_DECAY for t in self.tries]
        for p, hit in zip(probs, accepted):
            b = self._bin(p)
            self.tries[b] += 1.0
            self.hits[b] += hit


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
    probs: list[float] = field(default_factory=list)  # each draft's path probability under the draft

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

    def __init__(self, nodes: int, depth: int, start: int, worth=None, feed_from: float = 0.0) -> None:
        self.nodes, self.depth, self.start = nodes, depth, start
        self.worth = worth  # a candidate's score -> whether it pays its verify row (None: all do)
        self.feed_from = math.log(feed_from) if feed_from > 0 else -math.inf
        self.cands: list[_Node] = []
        self.fed: list[int] = []  # candidate indices in fed order
        self.is_chain = True  # the fed nodes so far are each under the one before
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
            if score == -math.inf or score <= self.bar() or (self.worth is not None and not self.worth(score)):
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
        return [i for i in order if self.cands[i].score > self.bar() and self.cands[i].score >= self.feed_from]

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
            tree.probs.append(math.exp(node.score))
        return tree


def grow_trees(
    proposer, seqs: list[DraftSequence], depth: list[int], nodes: list[int], sampling: SamplingTensors,
    gains: list[float] | None = None, calibration: NodeCalibration | None = None, feed_from: float = 0.0,
) -> list[DraftTree | None]:
    """A tree per row (None where `depth[b]` or `nodes[b]` is 0); `proposer` a `DraftModelProposer`
    whose queued fills ride in the catch-up forward.

    Priced trees (`gains`, with a `calibration`): a candidate joins row b's tree only where its
    measured chance of being kept is at least `gains[b]` (the tokens a verify row must bring to
    pay for itself), and is fed only with a draft path probability of at least `feed_from` (the
    chain's early stop: a draft forward for its children pays only where the draft is sure)."""
    rows = [b for b in range(len(seqs)) if depth[b] > 0 and nodes[b] > 0]
    trees: dict[int, _RowTree] = {}
    if not rows:
        return [None] * len(seqs)
    windows = [proposer._catch_up(seqs[b], []) for b in rows] + proposer._take_fill()
    logits = proposer._forward(windows)  # [A, V]: each row's root
    for b in rows:
        worth = None
        if gains is not None and calibration is not None:
            worth = lambda score, gain=gains[b]: calibration(math.exp(score)) >= gain  # noqa: E731
        trees[b] = _RowTree(nodes[b], depth[b], seqs[b].draft_table.num_computed, worth, feed_from)
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
            extends = tree.is_chain and len(new) == 1 and tree.cands[new[0]].parent == (tree.fed[-1] if tree.fed else -1)
            for c in new:
                tree.cands[c].fed = len(tree.fed)
                tree.fed.append(c)
            table = seqs[b].draft_table
            if extends:  # the fed nodes are a chain: the new one is fed after them, as a chain's draft
                table.num_computed = tree.start + len(tree.fed) - 1
                windows.append(Window(table, [tree.cands[new[0]].token], 1))
            else:  # the tree so far again, from its first slot (its nodes see only their ancestors)
                tree.is_chain = False
                table.num_computed = tree.start
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
