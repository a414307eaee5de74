"""Draft-model proposer: a small model with its own paged cache proposes k tokens per sequence."""

from __future__ import annotations

import torch

from specdec.cache import BlockPool
from specdec.draft.base import (
    DraftOutput, DraftSequence, ForcingConstraint, SamplingTensors, StepPlan, StepTimings,
)
from specdec.draft.model_tree import BEAM, DraftTree, NodeCalibration, grow_trees
from specdec.draft.vocab import expand_logits
from specdec.target.runner import ModelRunner, Window
from specdec.verify import sample


class DraftModelProposer:
    """Proposes with a draft model, batched over sequences, keeping the draft probabilities `q`.

    Each call first feeds the tokens the draft cache lacks (the catch-up: the whole prompt for a new
    sequence, 1 token normally, 2 after a step where every draft was accepted), which yields the
    logits for draft 1; then feeds d_1 .. d_{k-1} one at a time. d_k itself is never fed: the next
    step's catch-up does that if it was accepted.

    Example: tokens [a b c], draft cache holds [a b], k=3 -> feeds [c] -> d1; [d1] -> d2; [d2] -> d3.

    Early stop (`stop_below` > 0): a sequence stops drafting once the draft's own probability of
    its drafts so far, q(d_1) * ... * q(d_j), falls below `stop_below` (greedy rows: the draft's
    softmax probability of each argmax); d_j is still proposed
    (verifying it costs a row, not a forward), but no forward is spent on d_{j+1}, which would
    most likely be thrown away. The stop depends only on the draft's proposals, so rejection
    sampling stays exact. `num_draft` is then a cap, and `DraftOutput.num_draft` what was drafted.

    While `timings.enabled`, every forward appends (rows fed, seconds) to `timings.draft`.

    A draft whose LM head covers part of the vocabulary (`draft.vocab.restrict_head`) has its
    logits put back in the full vocabulary, zero probability outside the set (`expand_logits`).
    """

    def __init__(
        self, runner: ModelRunner, timings: StepTimings | None = None, stop_below: float = 0.0,
        grammar_forced: bool = True, tree: bool = False,
    ) -> None:
        self.runner = runner
        self.tree = tree  # token trees (`draft.model_tree`) instead of chains
        self.calibration = NodeCalibration()  # a tree node's measured worth, for priced trees
        self.trees: list[DraftTree | None] = []  # the latest step's trees, per row (`keep_tree_path`)
        self.timings = timings or StepTimings()  # each forward's (rows, seconds) while enabled
        self.stop_below = stop_below
        self.grammar_forced = grammar_forced  # propose what a row's grammar forces, without a forward
        self.num_forced = 0  # tokens proposed by grammars so far
        self._fill_windows: list[Window] = []  # queued fills, taken by the step's first forward

    @property
    def pool(self) -> BlockPool:
        return self.runner.pool

    @property
    def timed(self) -> bool:  # eval's switch (`eval.runner.time_draft_forwards`)
        return self.timings.enabled

    @timed.setter
    def timed(self, on: bool) -> None:
        self.timings.enabled = on

    @property
    def forward_seconds(self) -> list[tuple[int, float]]:  # eval reads the draft forwards' timings
        return self.timings.draft

    def draft_slots_needed(self, num_tokens: int, num_draft: int) -> int:
        # Positions written: the catch-up up to num_tokens-1, then d_1..d_{k-1} (a tree: up to
        # BEAM nodes fed a level, for k - 1 levels).
        if num_draft <= 0:
            return 0
        return num_tokens + (BEAM if self.tree else 1) * (num_draft - 1)

    @torch.inference_mode()
    def propose(self, plan: StepPlan, sampling: SamplingTensors) -> DraftOutput:
        """Feed the plan's `draft_fill`s and draft up to `num_draft` tokens per row."""
        self.queue_fills(plan)
        seqs = [p.seq for p in plan.rows]
        if self.tree:
            out = self.draft_tree(seqs, [p.num_draft for p in plan.rows], [p.tree_rows for p in plan.rows], sampling,
                                  tree_gains(plan.rows))
        else:
            out = self.draft(seqs, [p.num_draft for p in plan.rows], sampling, [p.cap for p in plan.rows])
        self.flush()
        return out

    @torch.inference_mode()
    def draft_tree(
        self, seqs: list[DraftSequence], depth: list[int], nodes: list[int], sampling: SamplingTensors,
        gains: list[float] | None = None,
    ) -> DraftOutput:
        """A token tree per row (`draft.model_tree.grow_trees`), up to `depth[b]` deep and
        `nodes[b]` nodes (0: a chain's k, `depth[b]`); the first forward takes the queued fills.
        With `gains` (the planner's priced trees, `SeqPlan.tree_gain`), a node joins only where
        its measured worth pays its verify row, and is fed only where the draft's confidence in
        its path is at least `stop_below`. The drafts are deterministic proposals (`probs` None)."""
        nodes = [n or d for n, d in zip(nodes, depth)]
        self.trees = grow_trees(self, seqs, depth, nodes, sampling, gains, self.calibration,
                                self.stop_below if gains is not None else 0.0)
        counts = [len(t.tokens) if t else 0 for t in self.trees]
        token_ids = torch.full((len(seqs), max(counts, default=0)), -1, dtype=torch.long)
        for b, t in enumerate(self.trees):
            if t and t.tokens:
                token_ids[b, : counts[b]] = torch.tensor(t.tokens)
        parents = [t.parents if t and t.tokens else None for t in self.trees]
        return DraftOutput(token_ids.to(self.runner.device), None, counts, parents=parents)

    def keep_tree_path(self, row: int, seq: DraftSequence, path: list[int]) -> None:
        """After verification: the draft cache keeps the accepted `path`'s (verify rows) fed
        nodes, moved to the positions they now hold, and drops the rest of row `row`'s tree."""
        tree = self.trees[row] if row < len(self.trees) else None
        if tree is None or seq.draft_table is None:
            return
        kept = set(path)
        self.calibration.observe(tree.probs, [r in kept for r in range(1, len(tree.tokens) + 1)])
        src, dst = seq.draft_table.keep_tree_path(tree.start - 1, tree.draft_path(path))
        self.runner.kv_cache.copy_slots(src, dst)

    def queue_fills(self, plan: StepPlan) -> None:
        """Queue each sequence's `draft_fill` next tokens for the draft cache (prefill chunks that
        ride beside the target's, catch-up chunks; no logits). The next draft forward takes them
        along, or else `flush`: one forward's fixed cost (~80% of a one-row draft forward on a
        CPU) is not paid twice in a step."""
        self._fill_windows = []
        for p in plan.seqs:
            if p.draft_fill:
                table = p.seq.draft_table
                tokens = p.seq.token_ids[table.num_computed : table.num_computed + p.draft_fill]
                self._fill_windows.append(Window(table, tokens, 0))

    @torch.inference_mode()
    def flush(self) -> None:
        """Run the queued fill windows if no draft forward took them."""
        if self._fill_windows:
            self.runner.forward(self._take_fill())

    def _take_fill(self) -> list[Window]:
        windows, self._fill_windows = self._fill_windows, []
        return windows

    @torch.inference_mode()
    def draft(
        self, seqs: list[DraftSequence], num_draft: list[int], sampling: SamplingTensors,
        caps: list[int] | None = None,
    ) -> DraftOutput:
        """Up to `num_draft[b]` drafts for sequence b; the first forward takes the queued fills.

        Grammar-forced drafting (`grammar_forced`, rows whose constraint can name forced tokens):
        where the grammar forces the next tokens, they are proposed as they are (q one-hot), up to
        `caps[b]` (default `num_draft[b]`), and fed to the draft cache in the same window as the
        token before them, so a forced run costs no draft forward of its own; a row whose cap the
        forced tokens fill needs no forward at all.
        """
        b, k = len(seqs), max([*num_draft, *(caps or [])], default=0)
        caps = caps or num_draft
        device = self.runner.device
        token_ids = torch.full((b, k), -1, dtype=torch.long, device=device)  # [B, k]
        probs: torch.Tensor | None = None
        forcing = self._forcing(sampling, b)
        pos = [0] * b  # drafts so far per sequence (sampled and forced)
        forced: list[tuple[int, int, int]] = []  # (row, position, token) proposed by the grammar
        drafted_ids: list[list[int]] = [[] for _ in range(b)]  # host copies, for the logit controls
        for i in range(b):
            if caps[i] > 0:
                self._force(i, forcing, drafted_ids, pos, caps[i], token_ids, forced)
        rows = [i for i in range(b) if num_draft[i] > pos[i]]
        windows = [self._catch_up(seqs[i], drafted_ids[i]) for i in rows]
        confidence = [1.0] * b  # q(d_1) * ... * q(d_j) per sequence
        if rows:
            windows += self._take_fill()  # no logits: the first forward's rows are the catch-ups
        while rows:
            logits = self._forward(windows)  # [A, V]
            # Each row's penalties see its own prefix: the sequence's tokens and its drafts so far.
            logits = sampling.controlled(logits, rows, [drafted_ids[i] for i in rows])
            step_sampling = sampling.select(rows)
            step_probs = step_sampling.warp(logits)  # [A, V]
            step_tokens = sample(step_probs, step_sampling.generators, step_sampling.all_greedy)  # [A]
            if probs is None:
                probs = torch.zeros(b, k, step_probs.shape[-1], device=device)
            idx = torch.tensor(rows, dtype=torch.long, device=device)
            at = torch.tensor([pos[i] for i in rows], dtype=torch.long, device=device)
            token_ids[idx, at] = step_tokens
            probs[idx, at] = step_probs
            fed: list[list[int] | torch.Tensor] = [step_tokens[a : a + 1] for a in range(len(rows))]
            if sampling.controls is not None:
                for a, (i, token) in enumerate(zip(rows, step_tokens.tolist())):
                    drafted_ids[i].append(token)
                    pos[i] += 1
                    if forcing[i] is not None and pos[i] < caps[i]:
                        fed[a] = [token] + self._force(i, forcing, drafted_ids, pos, caps[i], token_ids, forced)
            else:
                for i in rows:
                    pos[i] += 1
            keep = [a for a, i in enumerate(rows) if num_draft[i] > pos[i]]
            if self.stop_below > 0 and keep:
                q = self._confidence(logits, step_probs, step_tokens, step_sampling,
                                     getattr(self.runner.model, "head_ids", None)).tolist()  # [A]
                for a, i in enumerate(rows):
                    confidence[i] *= q[a]
                keep = [a for a in keep if confidence[rows[a]] >= self.stop_below]
            windows = [Window(seqs[rows[a]].draft_table, fed[a]) for a in keep]
            rows = [rows[a] for a in keep]
        if probs is not None:
            for i, j, token in forced:  # q one-hot where the grammar proposed
                probs[i, j] = 0
                probs[i, j, token] = 1.0
        self.num_forced += len(forced)
        return DraftOutput(token_ids, probs, pos).trimmed()  # caps may exceed what was drafted

    def _forcing(self, sampling: SamplingTensors, b: int) -> list[ForcingConstraint | None]:
        """Each row's constraint, where it names forced tokens and grammar-forced drafting is on."""
        if not self.grammar_forced or sampling.controls is None:
            return [None] * b
        return [c.constraint if c is not None and isinstance(c.constraint, ForcingConstraint) else None
                for c in sampling.controls]

    @staticmethod
    def _force(
        i: int, forcing: list, drafted_ids: list[list[int]], pos: list[int], cap: int,
        token_ids: torch.Tensor, forced: list[tuple[int, int, int]],
    ) -> list[int]:
        """Propose what row i's grammar forces after its drafts so far (up to its cap); returns it."""
        if forcing[i] is None:
            return []
        tokens = forcing[i].forced(drafted_ids[i], cap - pos[i])
        for token in tokens:
            token_ids[i, pos[i]] = token
            forced.append((i, pos[i], token))
            drafted_ids[i].append(token)
            pos[i] += 1
        return tokens

    @staticmethod
    def _confidence(
        logits: torch.Tensor,  # [A, V]
        probs: torch.Tensor,  # [A, V] warped: one-hot on greedy rows
        tokens: torch.Tensor,  # [A]
        sampling: SamplingTensors,
        head_ids: torch.Tensor | None = None,  # a cut head's ids (`vocab.restrict_head`)
    ) -> torch.Tensor:  # [A] the draft's probability of each drafted token
        """q(d) of the distribution sampled from; for greedy rows (q one-hot) the draft's softmax
        probability of its argmax, so that greedy drafts also stop when the draft is unsure. With
        a cut head the normalizer spans its ids only: the others hold `vocab.FILL`, whose exp is 0
        (a fifth of the work for a 32,768-id head: 2.5% of a HumanEval run's time before)."""
        q = probs.gather(1, tokens[:, None]).squeeze(1)
        greedy = sampling.temperature.to(q.device) <= 0
        if not bool(greedy.any()):
            return q
        head = logits if head_ids is None else logits.index_select(1, head_ids.to(logits.device))
        raw = (logits.gather(1, tokens[:, None]).squeeze(1).float() - torch.logsumexp(head.float(), -1)).exp()
        return torch.where(greedy, raw, q)

    def _forward(self, windows: list[Window]) -> torch.Tensor:  # [A, V]
        rows = sum(len(w.token_ids) for w in windows)
        model = self.runner.model
        with self.timings.timing(self.timings.draft, rows, self.runner.device):
            logits = self.runner.forward(windows)  # [A, V], or [A, N] over model.head_ids
            return expand_logits(logits, getattr(model, "head_ids", None), model.config.vocab_size)

    @staticmethod
    def _catch_up(seq: DraftSequence, forced: list[int]) -> Window:
        """What the draft cache lacks, and the tokens the grammar forced after it."""
        table = seq.draft_table
        assert table is not None and table.num_computed < len(seq.token_ids)
        return Window(table, seq.token_ids[table.num_computed :] + forced)


def tree_gains(rows) -> list[float] | None:
    """The plan's priced-tree gains per row (`SeqPlan.tree_gain`), None where the plan prices none."""
    gains = [p.tree_gain for p in rows]
    return None if all(g is None for g in gains) else [0.0 if g is None else g for g in gains]
