"""N-gram (prompt-lookup) proposer: copy what followed the last match of the recent tokens."""

from __future__ import annotations

import torch

from specdec.draft.base import DraftOutput, SamplingTensors, StepPlan, StepTimings


class NgramProposer:
    """Proposes the tokens that followed the most recent earlier occurrence of the last n tokens.

    Tries n = max_n down to min_n; no model, no cache. Its proposals are deterministic, so the
    verifier treats q as one-hot (`probs=None`).

    Example: tokens [5 6 7 8 5 6], n=2 -> the suffix [5 6] occurred at 0, so propose [7 8 5 ...].
    """

    pool = None

    def __init__(
        self, min_n: int = 1, max_n: int = 4, device: str | torch.device = "cpu",
        timings: StepTimings | None = None,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.device = torch.device(device)
        self.timings = timings or StepTimings()  # one entry per drafting step while enabled

    def draft_slots_needed(self, num_tokens: int, num_draft: int) -> int:
        return 0

    def propose(self, plan: StepPlan, sampling: SamplingTensors) -> DraftOutput:
        """Up to `num_draft` looked-up tokens per row (no cache, so no fills)."""
        num_draft = [p.num_draft for p in plan.rows]
        if not any(num_draft):
            return DraftOutput.empty(len(num_draft), self.device)
        k = max(num_draft)
        drafting = sum(1 for n in num_draft if n)
        with self.timings.timing(self.timings.draft, drafting, self.device, positions=k):
            rows = [self.lookup(p.seq.token_ids, n) for p, n in zip(plan.rows, num_draft)]
            padded = [r + [-1] * (k - len(r)) for r in rows]
            token_ids = torch.tensor(padded, dtype=torch.long, device=self.device).view(len(rows), k)
        return DraftOutput(token_ids, None, [len(r) for r in rows])

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest suffix n-gram."""
        if k == 0:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + k]
        return []
