"""What every proposer takes and returns."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdec.cache import BlockPool, BlockTable
from specdec.verify.controls import LogitControls, apply_controls
from specdec.verify.sampling import warp_probs


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step (`[B]` each), the rows' generators and their logit
    controls (penalties, logit_bias, min_tokens; None: no row has any)."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1.0 = off
    generators: list[torch.Generator | None]
    min_p: torch.Tensor | None = None  # [B] float32, 0 = off; None: no row uses min-p
    controls: list[LogitControls | None] | None = None  # [B]

    def warp(self, logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B, V] probabilities
        """`warp_probs` of logits whose logit controls are already applied (`controlled`)."""
        return warp_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p)

    def controlled(
        self, logits: torch.Tensor, owners: list[int], extra: list[list[int]]
    ) -> torch.Tensor:  # [R, V]
        """`logits [R, V]`, row r belonging to sequence `owners[r]` and preceded by its tokens
        plus `extra[r]` (the drafts before it), with each row's logit controls applied."""
        if self.controls is None:
            return logits
        return apply_controls(logits, [self.controls[b] for b in owners], extra)

    @property
    def all_greedy(self) -> bool:
        """Every row at temperature 0 (read on the host: no sync when kept on the CPU)."""
        return self.temperature.device.type == "cpu" and bool((self.temperature <= 0).all())

    def select(self, rows: list[int]) -> "SamplingTensors":
        idx = torch.tensor(rows, dtype=torch.long, device=self.temperature.device)
        return SamplingTensors(
            self.temperature[idx], self.top_k[idx], self.top_p[idx], [self.generators[r] for r in rows],
            None if self.min_p is None else self.min_p[idx],
            None if self.controls is None else [self.controls[r] for r in rows],
        )

    def repeat(self, counts: list[int]) -> "SamplingTensors":
        """Row b repeated counts[b] times (for the k+1 verification rows of each sequence)."""
        reps = torch.tensor(counts, dtype=torch.long, device=self.temperature.device)
        gens = [g for g, c in zip(self.generators, counts) for _ in range(c)]
        return SamplingTensors(
            self.temperature.repeat_interleave(reps),
            self.top_k.repeat_interleave(reps),
            self.top_p.repeat_interleave(reps),
            gens,
            None if self.min_p is None else self.min_p.repeat_interleave(reps),
            None if self.controls is None else [c for c, n in zip(self.controls, counts) for _ in range(n)],
        )


@runtime_checkable
class ForcingConstraint(Protocol):
    """A token constraint that can name the tokens its grammar forces (`specdec.structured`):
    grammar-forced drafting proposes them without a draft forward."""

    def forced(self, extra: Sequence[int], most: int) -> list[int]:
        """Up to `most` tokens forced after the committed tokens plus `extra`; [] at a choice."""
        ...


class DraftSequence(Protocol):
    """The view of a running sequence that a proposer needs."""

    token_ids: list[int]
    draft_table: BlockTable | None


@dataclass
class SeqPlan:
    """One sequence's part in a step, decided once by the engine's planner (`specdec.step.planner`).

    `cap` bounds every draft of the step (KV slots, max_tokens, the context); `num_draft` is what
    the draft model may propose (under early stop a cap: the proposer may stop sooner);
    `num_lookup` what prompt lookup may propose (hybrid proposer; 0 = no lookup); `draft_fill`
    the tokens the draft's cache is fed without logits (a prefill stretch, or a catch-up chunk of
    a cache that fell far behind); `tree_rows` how many draft nodes a tree may have (0: chains),
    `tree_gain` what a node must be worth to join a priced tree.
    """

    seq: DraftSequence
    cap: int = 0
    num_draft: int = 0
    num_lookup: int = 0
    draft_fill: int = 0
    tree_rows: int = 0  # a tree proposer's drafts (nodes) at most; `cap` bounds their depth
    # priced trees (`spec_tree="auto"`): the chance of being kept that a node must have to pay for
    # its verify row (the planner's, from measured costs); None: the tree takes `tree_rows` nodes
    tree_gain: float | None = None


@dataclass
class StepPlan:
    """A step's plan: every scheduled sequence in the scheduler's order (`seqs`), and of them the
    `rows` that emit a token (decoding, or finishing their prompt) in batch order. The others
    feed a prefill chunk that stops short of the prompt's end."""

    seqs: list[SeqPlan]
    rows: list[SeqPlan]


@dataclass
class DraftOutput:
    """`token_ids [B, k]` padded with -1; `probs [B, k, V]` or None for a deterministic proposer.

    `parents` (token trees, issue 62): row b's drafts are the nodes of a tree, draft i (window
    row i + 1) under window row `parents[b][i]` (0: the sequence's last token; j: draft j - 1),
    each parent an earlier row; None for a row (or for all) whose drafts are a chain. A tree's
    drafts are deterministic proposals (`probs` unused) verified by `verify.tree.tree_accept`.
    """

    token_ids: torch.Tensor  # [B, k] int64
    probs: torch.Tensor | None  # [B, k, V] float32
    num_draft: list[int]  # [B] drafts actually proposed per row
    looked_up: list[bool] | None = None  # [B] row proposed by prompt lookup, not the model (hybrid)
    parents: list[list[int] | None] | None = None  # [B] each draft's parent row (trees); None: chains

    @classmethod
    def empty(cls, batch: int, device: torch.device) -> "DraftOutput":
        return cls(torch.empty(batch, 0, dtype=torch.long, device=device), None, [0] * batch)

    def trimmed(self) -> "DraftOutput":
        """The same drafts, `[B, max(num_draft)]` wide (a proposer may stop short of its plan)."""
        k = max(self.num_draft, default=0)
        probs = self.probs[:, :k] if self.probs is not None else None
        return DraftOutput(self.token_ids[:, :k], probs, self.num_draft, self.looked_up, self.parents)

    def tree(self, b: int) -> list[int] | None:
        """Row b's window parents for `Window(parents=...)` (`[-1, ...]`), None for a chain."""
        if self.parents is None or self.parents[b] is None:
            return None
        return [-1, *self.parents[b]]

    def depth(self, b: int) -> int:
        """Row b's deepest draft (a chain: its drafts), what one acceptance step of it measures."""
        tree = self.tree(b)
        if tree is None:
            return self.num_draft[b]
        depths = [0] * len(tree)
        for row in range(1, len(tree)):
            depths[row] = depths[tree[row]] + 1
        return max(depths)

    @property
    def feeds_estimate(self) -> list[bool]:
        """Rows whose verify result measures the draft model (the adaptive-k acceptance estimate):
        all but prompt-lookup rows."""
        return [not x for x in self.looked_up] if self.looked_up else [True] * len(self.num_draft)


class StepTimings:
    """Wall-clock seconds of one step's forwards, which the adaptive-k policy learns from
    (`SpeculationPolicy.observe`). Records only while `enabled`: on CUDA a timed forward costs a
    device sync.

    `draft`: (rows fed, seconds) per draft-model forward; a model-free proposer records one entry
    per step, (rows drafting, seconds per drafted position). `verify`: (rows, seconds) of the
    target forward that verified; with an MoE target `verify_experts`, the distinct experts a layer
    its decoding rows read (`expert_stats`). The engine clears them when a step starts.
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.draft: list[tuple[int, float]] = []
        self.verify: list[tuple[int, float]] = []
        self.verify_experts: float | None = None

    def clear(self) -> None:
        self.draft.clear()
        self.verify.clear()
        self.verify_experts = None

    @contextmanager
    def timing(
        self, records: list[tuple[int, float]], rows: int, device: torch.device, positions: int = 1
    ) -> Iterator[None]:
        """Append `(rows, seconds / positions)` of the block to `records` (the device queue drained)."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        records.append((rows, (time.perf_counter() - start) / positions))


class Proposer(Protocol):
    """Proposes drafts for the rows of a step's plan."""

    pool: BlockPool | None  # the proposer's own KV pool, if it has one

    def propose(self, plan: StepPlan, sampling: SamplingTensors) -> DraftOutput:
        """Drafts for `plan.rows` (`sampling` holds their rows), up to each row's `num_draft` /
        `num_lookup`; a proposer with a cache also feeds every sequence's `draft_fill` tokens,
        taken along by its first forward of the step (or one of their own)."""
        ...

    def draft_slots_needed(self, num_tokens: int, num_draft: int) -> int:
        """Cache slots the proposer needs for a sequence of `num_tokens` drafting `num_draft`."""
        ...
