"""`specdec eval acceptance`: how often the draft is accepted, and what that buys, on real prompts.

For each dataset and temperature, every prompt runs at batch 1 once target-only (k = 0) and once
per k, on ONE engine (the same weights; k is set per request), with the same per-prompt seed. Each
(dataset, temperature, k) cell reports the figures of `acceptance_metrics` (acceptance rate,
alpha, tau measured and predicted, the cost ratios, speedup measured and predicted), each with a 95%
bootstrap interval over prompts, and acceptance by draft position. Default temperatures: 0 (greedy)
and 0.7 (sampling, as chat runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specdec.eval import acceptance_metrics, metrics
from specdec.eval.metrics import RequestTrace
from specdec.eval.runner import EncodedPrompt, StepRecord, encode_prompts, run_request, time_draft_forwards
from specdec.sampling_params import SamplingParams

Run = tuple[RequestTrace, list[StepRecord]]  # one prompt's run: its trace and its steps


@dataclass
class AcceptanceOptions:
    """What `eval acceptance` measures (the engine's own flags are separate)."""

    datasets: list[str] = field(default_factory=lambda: ["humaneval", "sharegpt"])
    ks: list[int] = field(default_factory=lambda: [2, 4, 8])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    max_tokens: int = 64
    limit: int | None = 20
    seed: int = 0
    max_prompt_tokens: int = 1024
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.ks or any(not 1 <= k <= 16 for k in self.ks):
            raise ValueError(f"--ks must list draft lengths in 1..16, got {self.ks}")
        if any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
        if self.max_tokens < 2 or self.max_prompt_tokens < 1:
            raise ValueError("--max-tokens must be >= 2 and --max-prompt-tokens >= 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError("--limit must be positive")


def run_cell(
    engine, prompts: list[EncodedPrompt], k: int, temperature: float, opts: AcceptanceOptions, bar
) -> list[Run]:
    """All prompts at one (temperature, k); the seed of prompt i is `seed + i` whatever k is."""
    runs = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=opts.max_tokens, seed=opts.seed + i)
        runs.append(run_request(engine, prompt.token_ids, params, k))
        bar.update(1)
    return runs


def summarize(k: int, temperature: float, runs: list[Run], target_runs: list[Run]) -> dict:
    """One cell: throughput, and at k > 0 the summed counts, acceptance by position and every
    figure of `acceptance_metrics` with its 95% bootstrap interval over prompts."""
    decode = metrics.decode_metrics([trace for trace, _ in runs])
    target = metrics.decode_metrics([trace for trace, _ in target_runs])
    cell = {
        "k": k,
        "temperature": temperature,
        "num_prompts": len(runs),
        "num_output_tokens": decode["num_output_tokens"],
        "seconds": decode["seconds"],
        "tokens_per_s": decode["tokens_per_s"],
        "target_tokens_per_s": target["tokens_per_s"],
        "ttft_ms_mean": decode["ttft_ms"]["mean"],
        "counts": None,
        "acceptance_by_position": None,
        "figures": None,
    }
    if k > 0:
        per_prompt = [acceptance_metrics.prompt_counts(k, run, base) for run, base in zip(runs, target_runs)]
        cell["counts"] = {name: np.sum([p[name] for p in per_prompt], axis=0).tolist() for name in per_prompt[0]}
        cell["acceptance_by_position"] = acceptance_metrics.position_acceptance([s for _, steps in runs for s in steps])
        cell["figures"] = {name: e.as_dict() for name, e in acceptance_metrics.estimate(per_prompt).items()}
    return cell


def warm_up(engine, prompts: list[EncodedPrompt], ks: list[int]) -> None:
    """One short untimed run per mode, so allocation and first-call costs stay out of the numbers."""
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for k in (0, max(ks)):
        run_request(engine, prompts[0].token_ids, params, k)


def evaluate(engine, opts: AcceptanceOptions) -> list[dict]:
    """Every (dataset, temperature, k) cell, k = 0 (target-only) first: the others compare to it."""
    from tqdm.auto import tqdm

    prompt_sets = {
        name: encode_prompts(engine, name, opts.limit, opts.seed, opts.max_prompt_tokens, opts.max_tokens)
        for name in opts.datasets
    }
    total = sum(len(p) for p in prompt_sets.values()) * len(opts.temperatures) * (len(opts.ks) + 1)
    time_draft_forwards(engine)  # the draft cost c
    warm_up(engine, next(iter(prompt_sets.values())), opts.ks)
    cells = []
    with tqdm(total=total, desc="eval acceptance", unit="req", disable=not opts.progress) as bar:
        for name, prompts in prompt_sets.items():
            for temperature in opts.temperatures:
                target_runs: list[Run] = []
                for k in [0, *opts.ks]:
                    bar.set_postfix_str(f"{name} T={temperature} k={k}")
                    runs = run_cell(engine, prompts, k, temperature, opts, bar)
                    target_runs = target_runs or runs
                    cell = {"dataset": name, **summarize(k, temperature, runs, target_runs)}
                    if k > 0 and temperature == 0:
                        cell["greedy_matches_target"] = [t.token_ids for t, _ in runs] == [
                            t.token_ids for t, _ in target_runs]
                    cells.append(cell)
    return cells
