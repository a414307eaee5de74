"""Bootstrap confidence intervals over prompts, for figures that are ratios of sums over prompts.

Prompts are the unit that varies (one prompt's steps are not independent of each other), so each
resample draws N prompts with replacement, sums every per-prompt count over the drawn prompts and
recomputes the figures from those sums; the interval is the 2.5th / 97.5th percentile of the
resampled figures. Figures that compare two runs (a speedup) see the same drawn prompts in both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specdec.eval.metrics import RequestTrace

NUM_RESAMPLES = 2000
SEED = 0

Statistics = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class Estimate:
    """A figure on all prompts and its bootstrap interval (None where a figure is undefined)."""

    value: float | None
    low: float | None = None
    high: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {"value": self.value, "ci95": [self.low, self.high]}


def bootstrap(
    per_prompt: dict[str, np.ndarray],
    statistics: Statistics,
    num_resamples: int = NUM_RESAMPLES,
    seed: int = SEED,
    level: float = 0.95,
) -> dict[str, Estimate]:
    """Each figure `statistics` computes from summed counts, with its bootstrap interval.

    `per_prompt[name]`: [N, ...] one row of counts per prompt (prompt i is row i in every array).
    `statistics(sums)`: sums[name] is [R, ...] (the counts summed over R sets of prompts); returns
    figure name -> [R] values. It must be vectorized over R; division by zero may give nan/inf,
    which an interval ignores (a figure undefined on all prompts is None).

    Example: per_prompt = {"accepted": [6, 0], "drafted": [8, 4]}, statistics = accepted / drafted
    -> value 6/12 = 0.5; resamples draw prompts (0, 0) -> 0.75, (1, 1) -> 0.0, (0, 1) -> 0.5, ...
    """
    arrays = {name: np.asarray(x, dtype=np.float64) for name, x in per_prompt.items()}
    n = len(next(iter(arrays.values())))
    if n == 0 or any(len(x) != n for x in arrays.values()):
        raise ValueError("bootstrap needs the same positive number of prompts in every array")
    draws = np.random.default_rng(seed).integers(0, n, size=(num_resamples, n))  # [R, N]
    counts = np.zeros((num_resamples, n))  # [R, N] times prompt i was drawn in resample r
    np.add.at(counts, (np.arange(num_resamples)[:, None], draws), 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        point = statistics({name: x.sum(0, keepdims=True) for name, x in arrays.items()})
        resampled = statistics({name: np.tensordot(counts, x, axes=1) for name, x in arrays.items()})
    tail = 50.0 * (1.0 - level)
    out = {}
    for name, values in resampled.items():
        value = float(np.asarray(point[name]).reshape(-1)[0])
        finite = values[np.isfinite(values)]
        if not np.isfinite(value) or not len(finite):
            out[name] = Estimate(None)
            continue
        low, high = np.percentile(finite, [tail, 100.0 - tail])
        out[name] = Estimate(value, float(low), float(high))
    return out


def speedup(runs: Sequence[RequestTrace], base_runs: Sequence[RequestTrace]) -> Estimate:
    """(sum tokens / sum seconds of `runs`) / (the same of `base_runs`), run i of both on prompt i,
    with its interval (the same prompts drawn for both): how many times faster `runs` decode."""
    if len(runs) != len(base_runs):
        raise ValueError(f"a speedup compares runs on the same prompts, got {len(runs)} and {len(base_runs)}")
    per_prompt = {
        "tokens": [[r.num_output_tokens, b.num_output_tokens] for r, b in zip(runs, base_runs)],  # [N, 2]
        "seconds": [[r.e2e, b.e2e] for r, b in zip(runs, base_runs)],  # [N, 2]
    }

    def ratio(sums: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rates = sums["tokens"] / sums["seconds"]  # [R, 2]
        return {"speedup": rates[:, 0] / rates[:, 1]}

    return bootstrap(per_prompt, ratio)["speedup"]
