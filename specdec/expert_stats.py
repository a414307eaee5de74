"""Experts read by an MoE target's verify forwards: what speculation costs on a mixture of experts.

A dense target reads its weights once per forward whatever the rows; an MoE target reads, per
layer, the union of the experts its rows chose. A verify window of k + 1 rows therefore reads
more expert weights than one row does (up to k + 1 times top_k), and how many more depends on how
often consecutive tokens pick the same experts. `ExpertStats` counts it from the experts each
forward actually chose (`ModelRunner.expert_ids`): per decoding window (one sequence's verify rows)
and per whole forward (all windows of a step together: what the step's weights cost), as
distinct experts a layer, averaged over the MoE layers.

Example: top 8 of 128, a 5-row window whose rows chose 30 distinct experts in each layer ->
30 experts per window, 6 per row (a single row reads 8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def distinct_experts(expert_ids: torch.Tensor, spans: list[tuple[int, int]], num_experts: int) -> list[float]:
    """Per span `[start, end)` of rows: distinct experts its rows chose, averaged over layers.

    `expert_ids [L, T, k]`: the experts each row chose in each MoE layer.

        >>> ids = torch.tensor([[[0, 1], [1, 2], [3, 0]]])   # 1 layer, 3 rows, top 2
        >>> distinct_experts(ids, [(0, 2), (2, 3), (0, 3)], 4)
        [3.0, 2.0, 4.0]
    """
    layers, rows, _ = expert_ids.shape
    chosen = torch.zeros(layers, rows, num_experts, dtype=torch.bool)
    chosen.scatter_(2, expert_ids.long(), True)  # [L, T, E]
    return [chosen[:, s:e].any(1).sum(-1).float().mean().item() if e > s else 0.0 for s, e in spans]


@dataclass
class ExpertStats:
    """Counters over an MoE target's verify forwards since start (`as_dict` for JSON and /metrics)."""

    num_experts: int
    top_k: int
    num_windows: int = 0  # decoding windows verified
    window_rows: int = 0  # their rows (k + 1 each)
    window_experts: float = 0.0  # sum over windows of distinct experts a layer
    num_forwards: int = 0  # target forwards that verified
    forward_rows: int = 0
    forward_experts: float = 0.0  # sum over forwards of distinct experts a layer, all windows together
    by_window_rows: dict[int, list[float]] = field(default_factory=dict)  # rows -> [windows, experts sum]

    def record(self, expert_ids: torch.Tensor, windows: list[tuple[int, int]]) -> float:
        """Count one forward's decoding `windows` (`[start, end)` rows of `expert_ids [L, T, k]`);
        returns the forward's distinct experts a layer over all of them (0 without windows)."""
        if not windows:
            return 0.0
        rows = sum(e - s for s, e in windows)
        gathered = torch.cat([expert_ids[:, s:e] for s, e in windows], dim=1)  # [L, rows, k]
        *per_window, whole = distinct_experts(gathered, _spans(windows) + [(0, rows)], self.num_experts)
        for (s, e), experts in zip(windows, per_window):
            bucket = self.by_window_rows.setdefault(e - s, [0, 0.0])
            bucket[0] += 1
            bucket[1] += experts
        self.num_windows += len(windows)
        self.window_rows += rows
        self.window_experts += sum(per_window)
        self.num_forwards += 1
        self.forward_rows += rows
        self.forward_experts += whole
        return whole

    @property
    def experts_per_window(self) -> float:
        return self.window_experts / self.num_windows if self.num_windows else 0.0

    @property
    def experts_per_row(self) -> float:
        """Distinct experts a window reads per row it verifies (top_k for one-row windows)."""
        return self.window_experts / self.window_rows if self.window_rows else 0.0

    @property
    def experts_per_forward(self) -> float:
        return self.forward_experts / self.num_forwards if self.num_forwards else 0.0

    def summary(self) -> str:
        """One line for the statistics, e.g. "experts (top 8 of 128) read a layer: 21.3 per verify
        window of 4.0 rows (5.3 per row; one row reads 8)"."""
        if not self.num_windows:
            return f"experts (top {self.top_k} of {self.num_experts}): no verify window yet"
        rows = self.window_rows / self.num_windows
        return (f"experts (top {self.top_k} of {self.num_experts}) read a layer: {self.experts_per_window:.1f} per "
                f"verify window of {rows:.1f} rows ({self.experts_per_row:.1f} per row; one row reads {self.top_k})")

    def as_dict(self) -> dict[str, object]:
        return {
            "num_experts": self.num_experts, "top_k": self.top_k, "num_windows": self.num_windows,
            "window_rows": self.window_rows, "experts_per_window": self.experts_per_window,
            "experts_per_row": self.experts_per_row, "num_forwards": self.num_forwards,
            "experts_per_forward": self.experts_per_forward,
            "experts_by_window_rows": {r: s / n for r, (n, s) in sorted(self.by_window_rows.items())},
        }


def _spans(windows: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The windows' spans once gathered end to end."""
    spans, at = [], 0
    for s, e in windows:
        spans.append((at, at + e - s))
        at += e - s
    return spans
