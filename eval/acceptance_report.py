"""The report of `eval acceptance`: a table and plots of measured beside predicted, with intervals."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from specdec.eval import report

# (figure, column header, suffix) in table order; every cell shows "value [low, high]"
COLUMNS = (
    ("acceptance_rate", "acceptance rate", ""),
    ("drafts_per_step", "drafts / step", ""),
    ("alpha", "α per token", ""),
    ("tau", "τ measured", ""),
    ("tau_predicted", "τ from α", ""),
    ("draft_cost", "c", ""),
    ("verify_cost", "v", ""),
    ("decode_speedup", "decode speedup", "x"),
    ("decode_speedup_predicted", "decode speedup from α", "x"),
    ("speedup", "speedup (whole requests)", "x"),
)

DEFINITIONS = (
    "Each figure on all prompts, then its 95% bootstrap interval over prompts (2000 resamples). "
    "acceptance rate: accepted / drafted tokens; α: per-token acceptance probability, the i.i.d. fit "
    "accepted / (accepted + rejections); τ: tokens per target pass, the bonus/recovered token "
    "included; τ from α: mean over verify steps of (1 - α^(n+1)) / (1 - α), n the step's drafts; "
    "token trees: drafts count the nodes, while α, τ from α and acceptance by position take the "
    "tree's depth as n (τ above τ from α: what the other branches bought); "
    "c: seconds per draft forward / seconds per target-only decode step; v: the rest of a drafting "
    "step (verify pass, sampling) / target-only decode step; decode speedup: τ / (f·c + v), f draft "
    "forwards per step (measured), and from α: τ from α / (f·c + v); speedup (whole requests): "
    "tokens/s over target-only (k = 0) on the same prompts, prefill included, batch 1. "
    "Definitions: docs/acceptance.md."
)


def table(cells: list[dict]) -> str:
    headers = ["dataset", "T", "k", *[header for _, header, _ in COLUMNS], "tok/s", "target tok/s"]
    rows = [
        [c["dataset"], f"{c['temperature']:g}", c["k"],
         *[report.interval(c["figures"][name], suffix) for name, _, suffix in COLUMNS],
         c["tokens_per_s"], c["target_tokens_per_s"]]
        for c in cells if c["k"] > 0
    ]
    return report.markdown_table(headers, rows)


def position_table(cells: list[dict]) -> str:
    k_max = max((c["k"] for c in cells), default=0)
    headers = ["dataset", "T", "k", *[f"pos {i + 1}" for i in range(k_max)]]
    rows = [[c["dataset"], f"{c['temperature']:g}", c["k"],
             *(c["acceptance_by_position"]["acceptance_by_position"] + [None] * k_max)[:k_max]]
            for c in cells if c["k"] > 0]
    return report.markdown_table(headers, rows)


def _groups(cells: list[dict]) -> dict[tuple[str, float], list[dict]]:
    groups: dict[tuple[str, float], list[dict]] = {}
    for c in cells:
        if c["k"] > 0:
            groups.setdefault((c["dataset"], c["temperature"]), []).append(c)
    return groups


def plot_positions(cells: list[dict], path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    groups = _groups(cells)
    ncols = min(len(groups), 2)
    fig, axes = report.new_figure(ncols=ncols, nrows=-(-len(groups) // ncols))
    for ax in axes[len(groups):]:
        ax.set_visible(False)
    for ax, ((dataset, temperature), group) in zip(axes, groups.items()):
        for c in group:
            rates = c["acceptance_by_position"]["acceptance_by_position"]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"k={c['k']}")
        ax.set(title=f"{dataset}, T={temperature:g}", xlabel="draft position",
               ylabel="share of steps with drafts 1..i accepted", ylim=(0, 1.02))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    return report.save_figure(fig, path)


def _errorbar(ax, group: list[dict], name: str, offset: float, **style) -> None:
    """One figure against k with its 95% interval as error bars (x shifted by `offset` so that
    measured and predicted do not hide each other)."""
    points = [(c["k"], c["figures"][name]) for c in group if c["figures"][name]["value"] is not None]
    if not points:
        return
    ks = [k + offset for k, _ in points]
    values = [f["value"] for _, f in points]
    errors = [[v - f["ci95"][0] for v, (_, f) in zip(values, points)],
              [f["ci95"][1] - v for v, (_, f) in zip(values, points)]]
    ax.errorbar(ks, values, yerr=errors, capsize=3, marker="o", **style)


# (panel title, y label, [(figure, legend label, line style)])
PANELS = (
    ("acceptance", "probability", [("acceptance_rate", "acceptance rate (accepted / drafted)", "-"),
                                   ("alpha", "α per token (i.i.d. fit)", "--")]),
    ("mean accepted length τ", "tokens per target pass", [("tau", "measured", "-"),
                                                          ("tau_predicted", "predicted from α", "--")]),
    ("speedup over target-only", "x target-only", [("decode_speedup", "decode, measured", "-"),
                                                    ("decode_speedup_predicted", "decode, predicted from α", "--"),
                                                    ("speedup", "whole requests, measured", ":")]),
)


def plot_tau_speedup(cells: list[dict], path: Path) -> Path:
    """A row per (dataset, T): acceptance, τ and speedup against k, measured beside predicted,
    each point with its 95% bootstrap interval."""
    from matplotlib.ticker import MaxNLocator

    groups = _groups(cells)
    fig, axes = report.new_figure(ncols=len(PANELS), nrows=len(groups), width=4.6, height=3.4)
    for row, ((dataset, temperature), group) in enumerate(groups.items()):
        for ax, (title, ylabel, lines) in zip(axes[row * len(PANELS):], PANELS):
            for i, (name, label, style) in enumerate(lines):
                _errorbar(ax, group, name, 0.08 * (i - (len(lines) - 1) / 2), linestyle=style, label=label)
            ax.set(title=f"{dataset}, T={temperature:g}: {title}", xlabel="k (draft tokens)", ylabel=ylabel)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        axes[row * len(PANELS) + 2].axhline(1.0, color="grey", linewidth=0.8)
    return report.save_figure(fig, path)


def write_report(out: Path, meta: dict, opts, engine_config, cells: list[dict]) -> list[Path]:
    payload = {"meta": meta, "options": asdict(opts), "engine": asdict(engine_config), "results": cells}
    files = [report.write_json(out / "acceptance.json", payload)]
    files.append(report.write_markdown(out / "acceptance.md", "Draft acceptance", meta, [
        ("Acceptance and speedup, measured and predicted", table(cells) + "\n\n" + DEFINITIONS),
        ("Acceptance by draft position", position_table(cells)
         + "\n\nShare of verify steps drafting position i whose drafts 1..i were all accepted."),
    ]))
    files.append(plot_positions(cells, out / "acceptance_by_position.png"))
    files.append(plot_tau_speedup(cells, out / "tau_speedup_vs_k.png"))
    return files
