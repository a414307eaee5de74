"""Adaptive speculation: each step's k from measured costs and each sequence's running acceptance.

A step that drafts k tokens for B sequences costs `c_draft(lag rows) + (k - 1) * c_draft(B) +
c_verify(rows)`: the first draft forward feeds what each draft cache lacks (1 token normally, more
after steps that did not draft), the others one row per sequence, and the verify pass takes the
windows (k + 1 rows each). It emits, per sequence with per-token acceptance `a`,

    E(a, k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)        tokens on average.

`choose_k` picks the k in 0..cap that maximizes expected tokens per second for the whole batch;
k = 0 is plain decoding (no draft pass at all). So speculation shortens when acceptance drops and
switches off when verifying extra rows stops being nearly free (large batches on a compute-bound
kernel) or the draft costs more than it saves.

Costs are measured, not assumed: `CostTable` keeps an exponential average of wall-clock seconds
per power-of-two bucket of the rows a forward takes (target forwards; draft-model forwards). A bucket
never measured borrows its nearest measured neighbour, so untried sizes look as cheap as the
closest known one and get tried (except where a step is bounded, as steady steps bound theirs:
there `CostTable.upper` prices them, scaling the largest smaller size measured by the rows);
above the largest measured bucket the cost is extended along the line through the two largest (a
compute-bound forward grows with its rows). Acceptance is per
sequence, from exponentially decayed counts with a prior; steps that drafted nothing decay the
counts back toward the prior, so a sequence whose speculation was switched off gets retried.

Because k follows timings, two runs with the same seed may draft differently; every k keeps the
output distribution exact (rejection sampling), but a seeded sample is reproducible token for
token only with a fixed k (`EngineConfig.adaptive_k=False`).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.draft import StepTimings

PRIOR_ACCEPTANCE = 0.8  # a draft of the target's family; a prior under break-even never retries
PRIOR_WEIGHT = 4.0  # the prior counts as this many observed draft tokens
DECAY = 0.9  # per step: older verify results weigh less
COST_EMA = 0.3  # weight of a new timing in its bucket's average
MAX_ACCEPTANCE = 0.98  # E(a, k) grows without bound in k as a -> 1


@dataclass
class AcceptanceEstimate:
    """One sequence's running per-token acceptance probability."""

    accepted: float = 0.0
    trials: float = 0.0

    def update(self, num_draft: int, num_accepted: int) -> None:
        """A verify step kept `num_accepted` of `num_draft` drafts (draft 0: decay only)."""
        self.accepted *= DECAY
        self.trials *= DECAY
        if num_draft > 0:
            # tokens up to the first rejection were tried: the accepted ones and the rejected one
            self.accepted += num_accepted
            self.trials += num_accepted + (num_accepted < num_draft)

    @property
    def rate(self) -> float:
        a = (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)
        return min(a, MAX_ACCEPTANCE)


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verify step emits on average: accepted drafts + the target's own token."""
    return (1 - a ** (k + 1)) / (1 - a)


class CostTable:
    """Seconds per call, averaged per power-of-two bucket of a size (1, 2, 3-4, 5-8, ...)."""

    def __init__(self, prior: float | None) -> None:
        self.prior = prior
        self.seconds: dict[int, float] = {}
        self.sizes: dict[int, float] = {}  # the average size measured in each bucket

    @staticmethod
    def bucket(size: int) -> int:
        return max(1, size - 1).bit_length() if size > 1 else 0

    def observe(self, size: int, seconds: float) -> None:
        b = self.bucket(size)
        old = self.seconds.get(b)
        self.seconds[b] = seconds if old is None else (1 - COST_EMA) * old + COST_EMA * seconds
        self.sizes[b] = size if old is None else (1 - COST_EMA) * self.sizes[b] + COST_EMA * size

    def __call__(self, size: int) -> float:
        if not self.seconds:
            return self.prior
        b = self.bucket(size)
        if b in self.seconds:
            return self.seconds[b]
        known = sorted(self.seconds)
        if b > known[-1] and len(known) > 1:
            # Beyond the largest size measured, extend the line through the two largest buckets:
            # a compute-bound forward grows with its rows, and under early stop the cap's size
            # that speculation is priced at may never be measured itself.
            hi, lo = known[-1], known[-2]
            slope = (self.seconds[hi] - self.seconds[lo]) / max(self.sizes[hi] - self.sizes[lo], 1e-9)
            return self.seconds[hi] + max(slope, 0.0) * (size - self.sizes[hi])
        nearest = min(self.seconds, key=lambda m: (abs(m - b), m))
        return self.seconds[nearest]

    def upper(self, size: int) -> float:
        """A cost not to be exceeded, for bounding a step rather than trying it: a measured bucket's
        average; for a size never measured, the largest measured smaller size's scaled by the size
        (a forward's cost grows at most in proportion to its rows: fixed costs only dilute), or,
        with none smaller, the smallest larger size's (it only grows with its rows)."""
        if not self.seconds:
            return self.prior
        b = self.bucket(size)
        if b in self.seconds:
            return self.seconds[b]
        below = [m for m in self.seconds if m < b]
        if below:
            lo = max(below)
            return self.seconds[lo] * size / max(self.sizes[lo], 1e-9)
        return self.seconds[min(self.seconds)]


class ExpertPricedCost(CostTable):
    """An MoE target's verify forwards priced through the experts they read:
    rows -> distinct experts a layer -> seconds, each link measured.

    rows -> experts: the average measured for that many rows; for row counts never verified, the
    uniform-routing curve `E (1 - (1 - k/E)^rows)` scaled to the nearest measured count (real
    routers repeat experts between neighbouring tokens, so measured counts sit below the curve).
    experts -> seconds: least squares of the measured forwards' seconds on (1, experts, rows),
    exponentially forgetting (weights come and go with the load), once three different expert
    counts were seen; until then, and where the fit is not usable, the rows table (`CostTable`).

    A dense table extends past its largest measured row count along a line, but an MoE forward's
    expert count saturates at E, so speculation on a sparse target is priced by what it reads.
    """

    def __init__(self, num_experts: int, top_k: int, prior: float | None) -> None:
        super().__init__(prior)
        self.num_experts, self.top_k = num_experts, top_k
        self.experts_by_rows: dict[int, float] = {}  # EMA of distinct experts a layer per rows
        self._xtx = torch.zeros(3, 3, dtype=torch.float64)  # forgetting sums of the normal equations
        self._xty = torch.zeros(3, dtype=torch.float64)
        self._seen: set[int] = set()  # rounded expert counts observed
        self._coef: torch.Tensor | None = None  # seconds = coef . (1, experts, rows), once fitted

    def observe_experts(self, rows: int, experts: float, seconds: float) -> None:
        old = self.experts_by_rows.get(rows)
        self.experts_by_rows[rows] = experts if old is None else (1 - COST_EMA) * old + COST_EMA * experts
        x = torch.tensor([1.0, experts, float(rows)], dtype=torch.float64)
        self._xtx.mul_(1 - COST_EMA / 4).add_(torch.outer(x, x))
        self._xty.mul_(1 - COST_EMA / 4).add_(x * seconds)
        self._seen.add(round(experts))
        if len(self._seen) >= 3:  # three expert counts make the fit determined
            self._coef = torch.linalg.solve(self._xtx + torch.eye(3, dtype=torch.float64) * 1e-9, self._xty)

    def uniform_experts(self, rows: int) -> float:
        """Distinct experts a layer for `rows` rows under uniform routing."""
        e, k = self.num_experts, self.top_k
        return e * (1 - (1 - k / e) ** rows)

    def experts(self, rows: int) -> float:
        if rows in self.experts_by_rows:
            return self.experts_by_rows[rows]
        if not self.experts_by_rows:
            return self.uniform_experts(rows)
        nearest = min(self.experts_by_rows, key=lambda r: (abs(r - rows), r))
        scale = self.experts_by_rows[nearest] / self.uniform_experts(nearest)
        return min(float(self.num_experts), scale * self.uniform_experts(rows))

    def __call__(self, size: int) -> float:
        coef = self._coef
        if coef is not None:
            seconds = float(coef @ torch.tensor([1.0, self.experts(size), float(size)], dtype=torch.float64))
            if coef[1] >= 0 and seconds > 0:
                return seconds
        return super().__call__(size)

    def upper(self, size: int) -> float:
        bound = super().upper(size)
        return bound if self._coef is None else max(self(size), bound)


DRAFT_PRIOR_RATIO = 0.3  # an unmeasured draft step is priced at this share of a target forward


class SpeculationPolicy:
    """Chooses k per step; fed with the timings of draft passes and target forwards.

    Until the draft has been timed, a draft step is priced at `DRAFT_PRIOR_RATIO` of a target
    forward (whatever the target's table holds, measured or not), so target-only traffic that
    fills the target's table first cannot price speculation out before it was ever tried.
    """

    def __init__(self, routing: tuple[int, int] | None = None) -> None:
        self.routing = routing  # an MoE target's (experts, top k): its verify forwards priced by experts read
        # one target forward, by rows
        self.verify_cost = CostTable(prior=1.0) if routing is None else ExpertPricedCost(*routing, prior=1.0)
        self.draft_cost = CostTable(prior=None)  # one draft forward, by rows fed

    def forget(self) -> None:
        """Drop every timing measured so far (warm-up's first, cold pass)."""
        self.__init__(self.routing)

    def observe(self, timings: StepTimings) -> None:
        """Learn from one step's timed forwards: the draft model's (or a model-free proposer's
        per-position time) and the target's verify forward."""
        for rows, seconds in timings.draft:
            self.draft_cost.observe(rows, seconds)
        for rows, seconds in timings.verify:
            self.verify_cost.observe(rows, seconds)
            if timings.verify_experts is not None and isinstance(self.verify_cost, ExpertPricedCost):
                self.verify_cost.observe_experts(rows, timings.verify_experts, seconds)

    def draft_forward_cost(self, rows: int, upper: bool = False) -> float:
        if self.draft_cost.seconds or self.draft_cost.prior is not None:
            return self.draft_cost.upper(rows) if upper else self.draft_cost(rows)
        return DRAFT_PRIOR_RATIO * (self.verify_cost.upper(rows) if upper else self.verify_cost(rows))

    def choose_k(self, rates: list[float], caps: list[int], lags: list[int] | None = None) -> list[int]:
        """Each sequence's k (<= its cap) maximizing the batch's expected tokens per second.

        `lags[b]`: tokens sequence b's draft cache lacks (1 normally; more after steps without
        drafting), all fed in the first draft forward; then k - 1 forwards of one row each.
        """
        best_k = self.best_k(rates, caps, lags)
        return [min(best_k, cap) for cap in caps]

    def best_k(self, rates: list[float], caps: list[int], lags: list[int] | None = None,
               max_step_ratio: float | None = None) -> int:
        """The batch's k (before each sequence's cap) that `choose_k` applies; with
        `max_step_ratio`, among the k whose step is expected to take at most that many times a
        step without drafting (`step_seconds`), judged by the costs' upper bounds: a step size never
        measured is not assumed to fit)."""
        best_k, best_rate = 0, 0.0
        limit = None if max_step_ratio is None else max_step_ratio * self.step_seconds(0, caps, lags)
        for k in range(max(caps, default=0) + 1):
            if limit is not None and k and self.step_seconds(k, caps, lags, upper=True) > limit:
                break  # a step only grows with k
            rate = self.expected_rate(k, rates, caps, lags)
            if rate > best_rate * 1.0001:  # ties go to the smaller k
                best_k, best_rate = k, rate
        return best_k

    def expected_rate(self, k: int, rates: list[float], caps: list[int], lags: list[int] | None = None) -> float:
        """The batch's expected tokens per second when every sequence drafts min(k, its cap)."""
        tokens = sum(expected_tokens(a, min(k, cap)) for a, cap in zip(rates, caps))
        return tokens / self.step_seconds(k, caps, lags)

    def node_gain(self, k: int, rates: list[float], caps: list[int], lags: list[int] | None = None) -> float:
        """The chance of being kept that a token tree's node must have to pay for its verify row
        (priced trees, `spec_tree="auto"`): one more row's seconds (`row_seconds`) times the tokens
        per second the batch is expected to make at k. A node worth less slows the step more than
        it adds."""
        rows = sum(min(k, cap) for cap in caps) + len(caps)
        return self.row_seconds(rows) * self.expected_rate(k, rates, caps, lags)

    def row_seconds(self, rows: int) -> float:
        """What one more verify row costs near `rows`: the slope of the verify costs from `rows`
        to twice as many (0 until a larger size was measured: such rows get tried)."""
        rows = max(rows, 1)
        return max(self.verify_cost(2 * rows) - self.verify_cost(rows), 0.0) / rows

    def step_seconds(self, k: int, caps: list[int], lags: list[int] | None = None, upper: bool = False) -> float:
        """A step's expected seconds when every sequence drafts min(k, its cap): the draft
        forwards (the first feeds each drafting cache's lag) and the verify forward. `upper`:
        sizes never measured priced by `CostTable.upper` instead of their nearest neighbour."""
        lags = lags or [1] * len(caps)
        ks = [min(k, cap) for cap in caps]
        rows = sum(ks) + len(ks)
        seconds = self.verify_cost.upper(rows) if upper else self.verify_cost(rows)
        if any(ks):
            drafting = [b for b, kk in enumerate(ks) if kk]
            seconds += self.draft_forward_cost(sum(max(1, lags[b]) for b in drafting), upper)
            seconds += (max(ks) - 1) * self.draft_forward_cost(len(drafting), upper)
        return seconds


GAP_EMA = 0.2  # weight of a new per-token time in ChunkSizer's average
DECODE_WINDOW = 32  # decode-only steps whose median is the streams' typical gap


class ChunkSizer:
    """Sizes the prefill chunks that ride beside decoding streams from measured step times.

    A stream's gap between tokens is the step time. A step that only decodes takes `decode_s`
    (the median of the last DECODE_WINDOW); a prompt token riding along adds `per_token_s`: the
    step's time beyond what a decode-only step with the same verify rows takes (`decode_by_rows`, since a step's time also
    moves with the streams' k, which must not be charged to the chunk), or a prefill-only step's
    time per token. The budget is the most tokens that keep a step within `gap_ratio` times
    `decode_s`: `(gap_ratio - 1) * decode_s / per_token_s`. The trade-off is exact: a stream
    whose gaps may grow to r times lets a prompt arriving beside it prefill at (r - 1) / r of its
    own speed, so r = 3 costs that prompt about 1.5x its time to first token (plus what chunks
    cost beyond their tokens). Until both are measured the budget is `initial`; it grows at most
    2x per step.

    Example: decode steps of 0.15 s, 0.05 s per prompt token, gap_ratio 3 -> 6 tokens per step.
    """

    def __init__(self, gap_ratio: float, initial: int = 8, most: int = 2048) -> None:
        if not gap_ratio > 1:
            raise ValueError(f"the gap ratio must be > 1, got {gap_ratio}")
        self.gap_ratio, self.initial, self.most = gap_ratio, initial, most
        self.recent_decode_s: deque[float] = deque(maxlen=DECODE_WINDOW)
        self.decode_by_rows = CostTable(prior=None)  # decode-only step seconds by verify rows
        self.per_token_s: float | None = None
        self.last = initial

    def forget(self) -> None:
        """Drop every timing measured so far (warm-up's first, cold pass)."""
        self.__init__(self.gap_ratio, self.initial, self.most)

    def observe(self, seconds: float, prefill_tokens: int, verify_rows: int) -> None:
        """A step took `seconds` to feed `prefill_tokens` prompt tokens beside `verify_rows` rows
        of decoding streams (their windows: last token + drafts)."""
        ema = lambda old, new: new if old is None else (1 - GAP_EMA) * old + GAP_EMA * new  # noqa: E731
        if prefill_tokens == 0:
            if verify_rows:
                self.recent_decode_s.append(seconds)
                self.decode_by_rows.observe(verify_rows, seconds)
            return
        if verify_rows == 0:
            self.per_token_s = ema(self.per_token_s, seconds / prefill_tokens)
        elif self.decode_by_rows.seconds:
            extra = max(seconds - self.decode_by_rows(verify_rows), 0.0)
            self.per_token_s = ema(self.per_token_s, extra / prefill_tokens)

    @property
    def decode_s(self) -> float | None:
        """The median of recent decode-only steps: the streams' typical gap (a mean would follow
        the long speculative steps, which the streams' median gap does not)."""
        return statistics.median(self.recent_decode_s) if self.recent_decode_s else None

    def budget(self) -> int:
        """Prefill tokens the next step may carry beside its decoding streams (at least 1)."""
        decode_s = self.decode_s
        if decode_s is None or not self.per_token_s:
            return self.initial
        fits = int((self.gap_ratio - 1) * decode_s / self.per_token_s + 1e-6)
        # at most 2x the last budget: one low estimate must not freeze the streams for a step
        self.last = max(1, min(fits, 2 * self.last, self.most))
        return self.last
