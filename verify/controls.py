"""Logit controls (logit_bias, repetition / frequency / presence penalties, min_tokens), applied to
any row whose token prefix is known.

Under speculation the target verifies, in one forward, rows whose prefixes differ: row j of a
window sees the committed tokens plus drafts d_1..d_j; the draft model proposes d_{j+1} from the
same prefix. A penalty computed from the committed tokens alone would give every row the same
counts, and the output would no longer be the target's distribution with the penalty (the
statistical test in tests/engine/test_losslessness.py catches exactly that). So each row is
controlled by its own prefix: `apply_controls(logits, controls, extra)` with `extra[r]` the drafts
that precede row r.

Semantics (the order of vLLM's sampler): a `TokenConstraint` (a grammar: structured output)
leaves only the tokens it allows after the row's prefix; logit_bias is added; min_tokens sets the stop ids to -inf
while the output is shorter than `min_tokens`; then the repetition penalty (HF/vLLM) divides
positive and multiplies non-positive logits of every token seen in the prompt or the output;
then frequency and presence penalties (OpenAI) subtract `frequency * count + presence` from the
logit of every token the output holds `count > 0` times. Temperature, min-p, top-k and top-p come
after, in `warp_probs`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


class TokenConstraint(Protocol):
    """Which tokens may come next (a grammar), for one sequence whose committed tokens it has
    already consumed (the engine calls `commit` with every emitted token)."""

    def allowed(self, extra: Sequence[int], vocab: int) -> torch.Tensor:
        """`[vocab]` bool: the tokens allowed after the committed tokens followed by `extra`
        (the drafts before a row); the constraint's state is as before when it returns."""
        ...

    def commit(self, token_ids: Sequence[int]) -> None:
        """Advance past emitted tokens."""
        ...


@dataclass
class LogitControls:
    """One sequence's controls and the token ids they read (plain values: no request here).

    `output_ids` are the tokens emitted so far (not the drafts); `prompt_ids` matter only to the
    repetition penalty; `stop_ids` are banned while fewer than `min_tokens` tokens are out.
    """

    output_ids: Sequence[int]
    prompt_ids: Sequence[int] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    stop_ids: Sequence[int] = ()
    constraint: TokenConstraint | None = None

    def __post_init__(self) -> None:
        self._output_counts: Counter[int] | None = None
        self._prompt_set: set[int] | None = None

    @property
    def penalizes(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def counts(self, extra: Sequence[int]) -> Counter[int]:
        """Output token counts with `extra` (drafts before the row) appended."""
        if self._output_counts is None:
            self._output_counts = Counter(self.output_ids)
        if not extra:
            return self._output_counts
        counts = self._output_counts.copy()
        counts.update(extra)
        return counts

    def seen(self, counts: Counter[int]) -> set[int]:
        """Tokens the repetition penalty applies to: the prompt's and the output's (with drafts)."""
        if self._prompt_set is None:
            self._prompt_set = set(self.prompt_ids)
        return self._prompt_set | counts.keys()


def apply_controls(
    logits: torch.Tensor,  # [R, V]
    controls: Sequence[LogitControls | None],  # [R]: the row's sequence's controls, or None
    extra: Sequence[Sequence[int]],  # [R]: tokens between the controls' output_ids and the row
) -> torch.Tensor:  # [R, V] float32 (the input itself when no row is controlled)
    """The logits of every row with its controls applied along its own prefix.

    Example (one row, V = 4): logits [1, 2, -1, 0], output_ids [1], extra [2], frequency 0.5,
    presence 0.5, repetition 2 -> seen {1, 2}: [1, 1, -2, 0], then minus 1.0 for ids 1 and 2:
    [1, 0, -3, 0].
    """
    if len(controls) != logits.shape[0] or len(extra) != logits.shape[0]:
        raise ValueError(f"need one control and one extra per row: {logits.shape[0]} rows")
    if all(c is None for c in controls):
        return logits
    out = logits.float().clone()
    vocab = out.shape[1]
    bias_r, bias_t, bias_v = [], [], []  # logit_bias entries
    ban_r, ban_t = [], []  # min_tokens: stop ids at -inf
    pen_r, pen_t, pen_n = [], [], []  # penalized tokens and their output counts
    repetition, frequency, presence = [1.0] * len(controls), [0.0] * len(controls), [0.0] * len(controls)
    for r, c in enumerate(controls):
        if c is None:
            continue
        if c.constraint is not None:
            allowed = c.constraint.allowed(extra[r], vocab).to(out.device)  # [V] bool
            out[r].masked_fill_(~allowed, float("-inf"))
        for token, bias in c.logit_bias.items():
            if token < vocab:
                bias_r.append(r), bias_t.append(token), bias_v.append(bias)
        if c.min_tokens and len(c.output_ids) + len(extra[r]) < c.min_tokens:
            for token in c.stop_ids:
                if token < vocab:
                    ban_r.append(r), ban_t.append(token)
        if c.penalizes:
            counts = c.counts(extra[r])
            tokens = c.seen(counts) if c.repetition_penalty != 1.0 else counts.keys()
            for token in tokens:
                pen_r.append(r), pen_t.append(token), pen_n.append(counts.get(token, 0))
            repetition[r], frequency[r], presence[r] = c.repetition_penalty, c.frequency_penalty, c.presence_penalty
    device = out.device
    if bias_r:
        out.index_put_(_ids(bias_r, device) + _ids(bias_t, device), torch.tensor(bias_v, device=device),
                       accumulate=True)
    if ban_r:
        out.index_put_(_ids(ban_r, device) + _ids(ban_t, device), torch.tensor(float("-inf"), device=device))
    if pen_r:
        rows, tokens = _ids(pen_r, device) + _ids(pen_t, device)
        count = torch.tensor(pen_n, dtype=torch.float32, device=device)  # [P]
        values = out[rows, tokens]  # [P]
        rep = torch.tensor(repetition, device=device)[rows]  # [P]
        values = torch.where(values > 0, values / rep, values * rep)
        freq = torch.tensor(frequency, device=device)[rows]
        pres = torch.tensor(presence, device=device)[rows]
        values = values - freq * count - pres * (count > 0).float()
        out[rows, tokens] = values
    return out


def _ids(values: list[int], device: torch.device) -> tuple[torch.Tensor]:
    return (torch.tensor(values, dtype=torch.long, device=device),)
