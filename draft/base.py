"""What every proposer takes and returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.cache import BlockPool, BlockTable


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step (`[B]` each) and the rows' generators."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1.0 = off
    generators: list[torch.Generator | None]

    @property
    def all_greedy(self) -> bool:
        """Every row at temperature 0 (read on the host: no sync when kept on the CPU)."""
        return self.temperature.device.type == "cpu" and bool((self.temperature <= 0).all())

    def select(self, rows: list[int]) -> "SamplingTensors":
        idx = torch.tensor(rows, dtype=torch.long, device=self.temperature.device)
        return SamplingTensors(
            self.temperature[idx], self.top_k[idx], self.top_p[idx], [self.generators[r] for r in rows]
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
        )


class DraftSequence(Protocol):
    """The view of a running sequence that a proposer needs."""

    token_ids: list[int]
    draft_table: BlockTable | None
    num_draft_fill: int  # tokens to feed the draft cache beside a prefill chunk this step


@dataclass
class DraftOutput:
    """`token_ids [B, k]` padded with -1; `probs [B, k, V]` or None for a deterministic proposer."""

    token_ids: torch.Tensor  # [B, k] int64
    probs: torch.Tensor | None  # [B, k, V] float32
    num_draft: list[int]  # [B] drafts actually proposed per row
    looked_up: list[bool] | None = None  # [B] row proposed by prompt lookup, not the model (hybrid)


class Proposer(Protocol):
    """Proposes up to `num_draft[b]` tokens for each sequence b."""

    pool: BlockPool | None  # the proposer's own KV pool, if it has one

    def fill(self, seqs: list[DraftSequence]) -> None:
        """Queue prefill chunks for the proposer's cache (`num_draft_fill` tokens per sequence);
        its next forward in this step, or `flush`, feeds them."""
        ...

    def flush(self) -> None:
        """Feed what `fill` queued if no forward of this step did."""
        ...

    def propose(
        self, seqs: list[DraftSequence], num_draft: list[int], sampling: SamplingTensors
    ) -> DraftOutput: ...

    def draft_slots_needed(self, num_tokens: int, num_draft: int) -> int:
        """Cache slots the proposer needs for a sequence of `num_tokens` drafting `num_draft`."""
        ...
