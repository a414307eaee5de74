"""The step planner: every drafting decision of a step, made once, into one `StepPlan`.

Per sequence that emits a token this step (its `SeqPlan`):

    cap        = Scheduler.num_draft (k, max_tokens, the context), 0 on a prefill step with a draft model
    num_draft  = the policy's k (fixed k: the cap); 0 while a far-behind draft cache catches up a
                 chunk (draft_fill); under early stop, the cap wherever the policy drafts at all
    num_lookup = hybrid: max(num_draft, min(cap, LOOKUP_MIN_TOKENS)) when anything drafts or the
                 sequence runs alone (prompt lookup costs no forward)
    draft_fill = the scheduler's prefill stretch or the catch-up chunk; all held back when a
                 decoding step runs no draft forward (a forward of its own would stall the streams)

Steady steps (`steady`: a decode replica's default under prefill/decode disaggregation) bound the
streams' gaps instead of chasing every gain: the policy drafts only a k whose step is expected to
take at most STEADY_STEP_RATIO times the same batch's step without drafting, there is no early
stop, and the batch keeps its k until another promises STEADY_MARGIN more tokens per second
(drafting stops as soon as plain decoding is expected to be faster). Whatever k the batch runs and
whenever it changes, a stream's gap then stays within STEADY_STEP_RATIO of a plain step, as far
as the policy's measured costs see (a size never measured is priced by an upper bound: the
largest smaller size measured, scaled by the rows; borrowing the nearest neighbour's cost, 2
streams drafted 6-12-row verifies priced as 3-4-row ones and their gaps ran 1.6x). (With
early stop and a k that moves each step, a step streams 1 token after ~0.15 s or 5 after ~0.5 s:
a p99 gap 3-5x the median on the same work. Where verifying k + 1 rows costs little more than one,
a GPU's, steady steps still draft; on one CPU core with 2+ streams they do not.)

Example (fixed k = 4, draft model, one sequence 300 tokens ahead of its draft cache): cap 4,
num_draft 0, draft_fill 256 this step; the next step drafts 4.
"""

from __future__ import annotations

from specdec.step.adaptive import SpeculationPolicy
from specdec.draft import SeqPlan, StepPlan
from specdec.step.scheduler import Scheduler
from specdec.sequence import Sequence

MAX_PRICED_LAG = 8  # a lone sequence's draft lag is priced up to this many rows
MAX_CATCH_UP = 32  # draft-cache tokens fed in one catch-up beside other streams
MAX_LONE_CATCH_UP = 256  # ... for a sequence alone in its step (a chat prompt's draft prefill at once)
LOOKUP_MIN_TOKENS = 4  # hybrid: prompt lookup may propose this many even where the policy drafts fewer
STEADY_MARGIN = 1.15  # steady steps: the expected tokens/s another k must promise over the batch's k
STEADY_STEP_RATIO = 1.5  # steady steps: a drafting step is expected to take at most this many plain steps


class StepPlanner:
    """Builds each step's `StepPlan` from the scheduled sequences.

    `drafts_with_model`: the proposer has a draft model (its own cache: prefill steps do not
    draft). `looks_up`: it proposes by prompt lookup too (hybrid). `early_stop`: with a policy,
    the draft's confidence decides how far a sequence drafts, the policy only whether. `steady`:
    with a policy, a step within STEADY_STEP_RATIO of a plain one, the batch's k changed only for
    a STEADY_MARGIN gain, and no early stop.
    """

    def __init__(
        self, scheduler: Scheduler, policy: SpeculationPolicy | None, *, drafts_with_model: bool,
        looks_up: bool, early_stop: bool, steady: bool = False, priced_trees: bool = False,
    ) -> None:
        self.scheduler, self.policy = scheduler, policy
        self.priced_trees = priced_trees and policy is not None  # trees' nodes priced (`node_gain`)
        self.node_gain: float | None = None  # this step's, for priced trees
        self.drafts_with_model, self.looks_up = drafts_with_model, looks_up
        self.early_stop, self.steady = early_stop and not steady, steady
        self.steady_k: int | None = None  # steady steps: the batch's k, kept until another pays enough

    def plan(self, scheduled: list[Sequence]) -> StepPlan:
        plans = [SeqPlan(s, draft_fill=s.num_draft_fill) for s in scheduled]
        rows = [p for p in plans if not p.seq.fills_only]
        if rows:
            for p in rows:
                p.cap = self._cap(p.seq)
            self._draft_lengths(rows)
            if self.scheduler is not None and self.scheduler.tree_rows:  # a tree proposer's node budgets
                for p in rows:
                    p.tree_rows = self.scheduler.num_rows(p.seq) if p.num_draft else 0
                    p.tree_gain = self.node_gain if p.num_draft else None
            if self.looks_up and (any(p.num_draft for p in rows) or len(rows) == 1):
                for p in rows:
                    p.num_lookup = max(p.num_draft, min(p.cap, LOOKUP_MIN_TOKENS))
            self._hold_fills(plans, rows)
        return StepPlan(plans, rows)

    def _cap(self, seq: Sequence) -> int:
        # A sequence's prefill step does not draft: its first token comes after the target's
        # prefill alone (TTFT), and the draft's cache is fed the same stretch beside it.
        if self.drafts_with_model and seq.num_pending > 1:
            return 0
        return self.scheduler.num_draft(seq)

    def _draft_lengths(self, rows: list[SeqPlan]) -> None:
        """The policy's k per row (priced without the step's prefill chunks: with per-row costs
        they add the same to every k, and counting them would make drafting look cheaper exactly
        when a step is already long; measured: a stream drafted k = 5 beside each chunk and its
        steps grew 6x), then catch-ups, then early stop."""
        alone = len(rows) == 1
        ks = [p.cap for p in rows]
        if self.policy is not None:
            # A draft cache that lags by the whole prompt must catch up once, whatever k. For a
            # lone sequence pricing that would keep speculation off forever, so its lag is priced
            # up to a few rows; a batch pays the whole catch-up it would cause (at 4 streams,
            # prefilling the draft and catching up after each pause cost more than drafting won).
            lags = [p.seq.num_tokens - p.seq.draft_table.num_computed if p.seq.draft_table else 1 for p in rows]
            if alone:
                lags = [min(MAX_PRICED_LAG, lag) for lag in lags]
            rates, caps = [p.seq.acceptance.rate for p in rows], [p.cap for p in rows]
            k = self.policy.best_k(rates, caps, lags, STEADY_STEP_RATIO if self.steady else None)
            if self.steady and any(caps):
                limit = STEADY_STEP_RATIO * self.policy.step_seconds(0, caps, lags)
                k = self.steady_k = self._steady(k, lambda k: self.policy.expected_rate(k, rates, caps, lags),
                                                 lambda k: self.policy.step_seconds(k, caps, lags, upper=True) <= limit)
            ks = [min(k, cap) for cap in caps]
            if self.priced_trees:
                self.node_gain = self.policy.node_gain(k, rates, caps, lags)
        for p, k in zip(rows, ks):
            p.num_draft = self._catch_up_first(p, k, alone)
        if self.policy is not None and self.early_stop:
            # The policy decides whether drafting pays; the draft's confidence decides how far,
            # which beats the policy's length from an average acceptance: on 10 HumanEval
            # prompts 31.7 vs 29.8 modeled tok/s (cap 8, stop 0.5).
            for p in rows:
                p.num_draft = p.cap if p.num_draft else 0

    def _steady(self, best: int, rate, fits) -> int:
        """Steady steps' k: the batch's k unless `best` (the policy's, within the step bound)
        promises STEADY_MARGIN more tokens per second, or the batch's k no longer `fits` the step
        bound (the batch grew), except that a drafting batch stops drafting as soon as plain
        decoding is expected to be faster at all (`rate(k)`: expected tokens/s). Hysteresis both
        ways, with a lean to plain decoding, whose steps are the evenest (no draft catch-ups, no
        rejections)."""
        kept = self.steady_k
        if kept is None or best == kept or not fits(kept):
            return best
        if kept and best == 0:
            return 0 if rate(0) > rate(kept) else kept
        return best if rate(best) >= STEADY_MARGIN * rate(kept) else kept

    @staticmethod
    def _catch_up_first(p: SeqPlan, k: int, alone: bool) -> int:
        """A sequence about to draft whose draft cache fell behind by more than MAX_CATCH_UP
        tokens (MAX_LONE_CATCH_UP when it is alone in the step) is fed a chunk of them this step
        instead (`draft_fill`), and drafts once caught up: one catch-up forward over hundreds of
        tokens would stall every stream of the step, a lone one after its first token."""
        table = p.seq.draft_table
        lag = p.seq.num_tokens - 1 - table.num_computed if table is not None else 0
        limit = MAX_LONE_CATCH_UP if alone else MAX_CATCH_UP
        if k == 0 or lag <= limit:
            return k
        p.draft_fill = limit
        return 0

    @staticmethod
    def _hold_fills(plans: list[SeqPlan], rows: list[SeqPlan]) -> None:
        """The draft cache takes prompt stretches in a draft forward that runs anyway, or when no
        stream waits on the step: a forward of its own would add its fixed cost (most of a one-row
        draft forward) to a step that streams wait on. A draft left behind catches up in chunks
        once it drafts."""
        decoding = [p for p in plans if p.seq.num_pending <= 1]
        if decoding and not any(p.num_draft for p in rows) and not any(p.draft_fill for p in decoding):
            for p in plans:
                p.draft_fill = 0
