"""`specdec eval acceptance`: how often the draft is accepted, and what that buys, on real prompts.

For each dataset and temperature, every prompt runs at batch 1 once target-only (k = 0) and once
per k, on ONE engine (the same weights; k is set per request), with the same per-prompt seed. Each
(dataset, temperature, k) cell reports alpha, tau, the tau predicted from alpha, acceptance by draft
position, tokens/s and the speedup over the target-only run of the same prompts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.eval import metrics, report
from specdec.eval.runner import EncodedPrompt, encode_prompts, run_request
from specdec.sampling_params import SamplingParams


@dataclass
class AcceptanceOptions:
    """What `eval acceptance` measures (the engine's own flags are separate)."""

    datasets: list[str] = field(default_factory=lambda: ["humaneval", "sharegpt"])
    ks: list[int] = field(default_factory=lambda: [2, 4, 8])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
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
) -> dict:
    """All prompts at one (temperature, k); the seed of prompt i is `seed + i` whatever k is."""
    traces, steps = [], []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=opts.max_tokens, seed=opts.seed + i)
        trace, prompt_steps = run_request(engine, prompt.token_ids, params, k)
        traces.append(trace)
        steps += prompt_steps
        bar.update(1)
    decode = metrics.decode_metrics(traces)
    return {
        "k": k,
        "temperature": temperature,
        "num_prompts": len(prompts),
        "num_output_tokens": decode["num_output_tokens"],
        "seconds": decode["seconds"],
        "tokens_per_s": decode["tokens_per_s"],
        "ttft_ms_mean": decode["ttft_ms"]["mean"],
        "acceptance": metrics.acceptance_summary(steps) if k > 0 else None,
        "token_ids": [t.token_ids for t in traces],
    }


def warm_up(engine, prompts: list[EncodedPrompt], ks: list[int]) -> None:
    """One short untimed run per mode, so allocation and first-call costs stay out of the numbers."""
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for k in (0, max(ks)):
        run_request(engine, prompts[0].token_ids, params, k)


def evaluate(engine, opts: AcceptanceOptions) -> list[dict]:
    """Every (dataset, temperature, k) cell, k = 0 (target-only) first; speedup is over k = 0."""
    from tqdm.auto import tqdm

    prompt_sets = {
        name: encode_prompts(engine, name, opts.limit, opts.seed, opts.max_prompt_tokens, opts.max_tokens)
        for name in opts.datasets
    }
    total = sum(len(p) for p in prompt_sets.values()) * len(opts.temperatures) * (len(opts.ks) + 1)
    warm_up(engine, next(iter(prompt_sets.values())), opts.ks)
    cells = []
    with tqdm(total=total, desc="eval acceptance", unit="req", disable=not opts.progress) as bar:
        for name, prompts in prompt_sets.items():
            for temperature in opts.temperatures:
                baseline = None
                for k in [0, *opts.ks]:
                    bar.set_postfix_str(f"{name} T={temperature} k={k}")
                    cell = {"dataset": name, **run_cell(engine, prompts, k, temperature, opts, bar)}
                    baseline = baseline or cell
                    cell["target_tokens_per_s"] = baseline["tokens_per_s"]
                    base_tps = baseline["tokens_per_s"]
                    cell["speedup"] = cell["tokens_per_s"] / base_tps if base_tps else None
                    if k > 0 and temperature == 0:
                        cell["greedy_matches_target"] = cell["token_ids"] == baseline["token_ids"]
                    cells.append(cell)
    for cell in cells:
        cell.pop("token_ids")
    return cells


# ---- report ----------------------------------------------------------------------------------


def table(cells: list[dict]) -> str:
    headers = ["dataset", "T", "k", "alpha", "tau", "tau from alpha", "p/token", "tok/s", "target tok/s",
               "speedup"]
    rows = []
    for c in cells:
        if c["k"] == 0:
            continue
        a = c["acceptance"]
        rows.append([c["dataset"], f"{c['temperature']:g}", c["k"], a["alpha"], a["tau"], a["tau_predicted"],
                     a["p_token"], c["tokens_per_s"], c["target_tokens_per_s"], _times(c["speedup"])])
    return report.markdown_table(headers, rows)


def position_table(cells: list[dict]) -> str:
    k_max = max((c["k"] for c in cells), default=0)
    headers = ["dataset", "T", "k", *[f"pos {i + 1}" for i in range(k_max)]]
    rows = [[c["dataset"], f"{c['temperature']:g}", c["k"],
             *(c["acceptance"]["acceptance_by_position"] + [None] * k_max)[:k_max]]
            for c in cells if c["k"] > 0]
    return report.markdown_table(headers, rows)


def _times(x: float | None) -> str | None:
    return f"{x:.2f}x" if x is not None else None


def plot_positions(cells: list[dict], path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    groups = _groups(cells)
    ncols = min(len(groups), 2)
    fig, axes = report.new_figure(ncols=ncols, nrows=-(-len(groups) // ncols))
    for ax in axes[len(groups):]:
        ax.set_visible(False)
    for ax, ((dataset, temperature), group) in zip(axes, groups.items()):
        for c in group:
            rates = c["acceptance"]["acceptance_by_position"]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"k={c['k']}")
        ax.set(title=f"{dataset}, T={temperature:g}", xlabel="draft position",
               ylabel="share of steps with drafts 1..i accepted", ylim=(0, 1.02))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    return report.save_figure(fig, path)


def plot_tau_speedup(cells: list[dict], path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    fig, (ax_tau, ax_speed) = report.new_figure(ncols=2)
    for (dataset, temperature), group in _groups(cells).items():
        ks = [c["k"] for c in group]
        label = f"{dataset}, T={temperature:g}"
        line, = ax_tau.plot(ks, [c["acceptance"]["tau"] for c in group], marker="o", label=f"{label} measured")
        ax_tau.plot(ks, [c["acceptance"]["tau_predicted"] for c in group], linestyle="--",
                    color=line.get_color(), label=f"{label} from alpha")
        ax_speed.plot(ks, [c["speedup"] or 0.0 for c in group], marker="o", label=label)
    ax_tau.set(title="mean accepted length tau (bonus included)", xlabel="k (draft tokens)",
               ylabel="tokens per target pass")
    ax_speed.set(title="speedup over target-only", xlabel="k (draft tokens)", ylabel="x target-only tokens/s")
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    for ax in (ax_tau, ax_speed):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return report.save_figure(fig, path)


def _groups(cells: list[dict]) -> dict[tuple[str, float], list[dict]]:
    groups: dict[tuple[str, float], list[dict]] = {}
    for c in cells:
        if c["k"] > 0:
            groups.setdefault((c["dataset"], c["temperature"]), []).append(c)
    return groups


def write_report(
    out: Path, meta: dict, opts: AcceptanceOptions, engine_config, cells: list[dict]
) -> list[Path]:
    payload = {"meta": meta, "options": asdict(opts), "engine": asdict(engine_config), "results": cells}
    files = [report.write_json(out / "acceptance.json", payload)]
    files.append(report.write_markdown(out / "acceptance.md", "Draft acceptance", meta, [
        ("Acceptance and speedup", table(cells) + "\n\nalpha: accepted / drafted tokens; tau: tokens per "
         "target pass incl. the bonus/recovered token; tau from alpha: (1 - alpha^(k+1)) / (1 - alpha); "
         "p/token: per-token acceptance probability of the i.i.d. fit; speedup: tokens/s over "
         "target-only (k = 0) on the same prompts in this run, batch 1."),
        ("Acceptance by draft position", position_table(cells)
         + "\n\nShare of verify steps drafting position i whose drafts 1..i were all accepted."),
    ]))
    files.append(plot_positions(cells, out / "acceptance_by_position.png"))
    files.append(plot_tau_speedup(cells, out / "tau_speedup_vs_k.png"))
    return files
