"""Acceptance statistics of speculative decoding, and the i.i.d. model that predicts them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    """Counters over verify steps; one `update` per sequence per verify step.

    `num_drafts` counts verify steps (including steps with 0 drafts, which emit one token),
    `accepted_per_position[i]` counts steps whose draft i was accepted (grows to the largest k
    seen), `num_emitted_tokens` counts accepted + recovered/bonus tokens.

    Example: update(4, 2) then update(4, 4) -> acceptance_rate 6/8 = 0.75,
    mean_accepted_length (3 + 5) / 2 = 4.0, accepted_per_position [2, 2, 1, 1].
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_emitted_tokens: int = 0

    def update(self, num_draft: int, num_accepted: int) -> None:
        """Record one verify step of one sequence: `num_accepted` of `num_draft` drafts kept."""
        if num_draft < 0 or not 0 <= num_accepted <= num_draft:
            raise ValueError(
                f"need 0 <= num_accepted <= num_draft, got num_accepted={num_accepted}, "
                f"num_draft={num_draft}"
            )
        self._grow(num_draft)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def merge(self, other: AcceptanceStats) -> AcceptanceStats:
        """Add `other`'s counters into this one (in place); returns self for chaining."""
        self._grow(len(other.accepted_per_position))
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        for position, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[position] += count
        return self

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Emitted tokens per verify step, the recovered/bonus token included (0.0 if none)."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, object]:
        """Counters and derived rates, ready for JSON."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "num_emitted_tokens": self.num_emitted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }

    def _grow(self, length: int) -> None:
        missing = length - len(self.accepted_per_position)
        if missing > 0:
            self.accepted_per_position.extend([0] * missing)


def expected_accepted_length(alpha: float, k: int) -> float:
    """Tokens per verify step if each draft is accepted independently with probability alpha.

    (1 - alpha**(k+1)) / (1 - alpha): the accepted prefix plus the recovered/bonus token; k + 1
    when alpha = 1. Example: alpha = 0.5, k = 2 -> 1 + 0.5 + 0.25 = 1.75.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
