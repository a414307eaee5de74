"""The figures of `eval acceptance`, each from its own definition (docs/acceptance.md).

Per prompt, the speculative run gives one record per verify step that drafted (n drafts, a of them
accepted, its seconds, the draft model's seconds and forwards in it); the target-only run of the
same prompt gives its decode steps (every step after the first token, one token each). Over S
drafting steps, summed over prompts:

- acceptance rate = sum a / sum n (vLLM's; it counts drafts never reached after a rejection);
  drafts per step = sum n / S;
- alpha, the per-token acceptance probability: the maximum-likelihood fit of the i.i.d. model
  (each draft accepted with probability alpha until the first rejection), sum a / (sum a +
  rejections), a rejection being a step with a < n. The original paper's E[beta];
- tau, the mean accepted length: tokens per target pass, bonus/recovered included, (sum a + S) / S;
- tau predicted from alpha: the mean over steps of (1 - alpha^(n+1)) / (1 - alpha);
- c = seconds per draft forward / seconds per target-only decode step (the draft's relative cost);
- v = (step seconds - draft seconds) per step / seconds per target-only decode step: the verify
  pass (k + 1 rows), rejection sampling and bookkeeping, relative to one target decode step;
- step cost = seconds per drafting step / seconds per target-only decode step = f * c + v, with f
  draft forwards per step (k for a draft model, fewer with early stop or prompt lookup);
- decode speedup = tau / step cost (measured); predicted = tau predicted / step cost. With f = k
  and v = 1 that is Leviathan et al.'s (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1));
- speedup = (tokens / seconds) speculative / (tokens / seconds) target-only, whole requests
  (prefill included), as a user sees it.

A token tree's step drafts n nodes but keeps one path: its acceptance rate and drafts per step
count the nodes, while alpha, the rejections, tau predicted and acceptance by position take the
tree's depth d as the drafts n of a chain (a < d is a rejection). Tau measured against tau
predicted then shows what the tree's other branches bought over a chain of its depth.

Every figure is a ratio of sums over prompts, so `bootstrap` gives each a 95% interval.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specdec.eval.bootstrap import Estimate, bootstrap
from specdec.eval.metrics import RequestTrace
from specdec.eval.runner import StepRecord

FIGURES = ("acceptance_rate", "drafts_per_step", "alpha", "tau", "tau_predicted", "draft_cost", "verify_cost",
           "draft_forwards_per_step", "step_cost", "decode_speedup", "decode_speedup_predicted", "speedup")


def prompt_counts(
    k: int, spec: tuple[RequestTrace, list[StepRecord]], target: tuple[RequestTrace, list[StepRecord]]
) -> dict[str, np.ndarray]:
    """One prompt's counts: its run at k (trace, steps) and its target-only run (trace, steps)."""
    (spec_trace, spec_steps), (target_trace, target_steps) = spec, target
    drafting = [s for s in spec_steps if s.num_drafted > 0]
    if any(s.chain_length > k for s in drafting):
        raise ValueError(f"a step drafted more than k = {k} tokens deep: was the run made at this k?")
    steps_by_drafts = np.zeros(k + 1)  # [k+1] steps whose path held n drafts (a tree: its depth), at index n
    for s in drafting:
        steps_by_drafts[s.chain_length] += 1
    decode = target_steps[1:]  # the first step is the prefill that made the first token
    counts = {
        "drafted": sum(s.num_drafted for s in drafting),
        "accepted": sum(s.num_accepted for s in drafting),
        "rejections": sum(1 for s in drafting if s.num_accepted < s.chain_length),
        "step_seconds": sum(s.seconds for s in drafting),
        "draft_seconds": sum(s.draft_seconds for s in drafting),
        "draft_forwards": sum(s.num_draft_forwards for s in drafting),
        "target_steps": len(decode),
        "target_step_seconds": sum(s.seconds for s in decode),
        "tokens": spec_trace.num_output_tokens,
        "seconds": spec_trace.e2e,
        "target_tokens": target_trace.num_output_tokens,
        "target_seconds": target_trace.e2e,
    }
    return {"steps_by_drafts": steps_by_drafts, **{name: np.float64(x) for name, x in counts.items()}}


def expected_lengths(alpha: np.ndarray, k: int) -> np.ndarray:
    """[R, k+1]: (1 - alpha^(n+1)) / (1 - alpha) = 1 + alpha + ... + alpha^n at column n, for each
    alpha of [R] (no division, so alpha = 1 gives n + 1)."""
    return np.cumsum(alpha[:, None] ** np.arange(k + 1), axis=-1)


def figures(sums: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every figure of the module docstring from counts summed over prompts ([R] or [R, k+1])."""
    by_drafts = sums["steps_by_drafts"]  # [R, k+1]
    steps = by_drafts.sum(-1)  # [R]
    accepted = sums["accepted"]
    alpha = accepted / (accepted + sums["rejections"])
    tau = (accepted + steps) / steps
    tau_predicted = (by_drafts * expected_lengths(alpha, by_drafts.shape[-1] - 1)).sum(-1) / steps
    target_step = sums["target_step_seconds"] / sums["target_steps"]
    step_cost = sums["step_seconds"] / steps / target_step
    return {
        "acceptance_rate": accepted / sums["drafted"],
        "drafts_per_step": sums["drafted"] / steps,
        "alpha": alpha,
        "tau": tau,
        "tau_predicted": tau_predicted,
        "draft_cost": sums["draft_seconds"] / sums["draft_forwards"] / target_step,
        "verify_cost": (sums["step_seconds"] - sums["draft_seconds"]) / steps / target_step,
        "draft_forwards_per_step": sums["draft_forwards"] / steps,
        "step_cost": step_cost,
        "decode_speedup": tau / step_cost,
        "decode_speedup_predicted": tau_predicted / step_cost,
        "speedup": (sums["tokens"] / sums["seconds"]) / (sums["target_tokens"] / sums["target_seconds"]),
    }


def estimate(per_prompt: Sequence[dict[str, np.ndarray]]) -> dict[str, Estimate]:
    """Every figure on all prompts, with its 95% bootstrap interval over prompts."""
    stacked = {name: np.stack([p[name] for p in per_prompt]) for name in per_prompt[0]}
    return bootstrap(stacked, figures)


def position_acceptance(steps: Sequence[StepRecord]) -> dict[str, list]:
    """Per draft position i (a tree: depth i): steps that drafted it, steps whose drafts 1..i
    were all accepted, and their ratio. Example: steps (4, 2), (4, 4) -> acceptance [1.0, 1.0, 0.5, 0.5]."""
    drafting = [s for s in steps if s.num_drafted > 0]
    k_max = max((s.chain_length for s in drafting), default=0)
    drafted = [sum(1 for s in drafting if s.chain_length > i) for i in range(k_max)]
    accepted = [sum(1 for s in drafting if s.num_accepted > i) for i in range(k_max)]
    return {
        "drafted_by_position": drafted,
        "accepted_by_position": accepted,
        "acceptance_by_position": [a / d for a, d in zip(accepted, drafted)],
    }
