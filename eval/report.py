"""Result files: the run's provenance, JSON, Markdown tables and matplotlib plots (Agg backend).

Every result records the exact command line (as typed, and with every option spelled out so it
reruns the same way whatever the defaults become), the git commit, the machine and the config.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from specdec.version import version

REPO_ROOT = Path(__file__).resolve().parent.parent


def default_out_dir(command: str) -> Path:
    """`results/<command>-<UTC timestamp>/`, e.g. `results/eval-acceptance-20250101-120000`."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path("results") / f"{command}-{stamp}"


def explicit_command(parser: argparse.ArgumentParser, args: argparse.Namespace, words: Sequence[str]) -> str:
    """The command line with every option of `parser` written out, as `args` holds it."""
    parts = list(words)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.dest in ("func", "parser"):
            continue
        value = getattr(args, action.dest, None)
        if not action.option_strings:
            parts += [str(v) for v in value] if isinstance(value, list) else [str(value)]
            continue
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
            if value is not None:
                parts.append(action.option_strings[0] if value else action.option_strings[1])
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreConstAction):  # store_true / store_false / const
            if value is action.const or (value == action.const and not isinstance(value, bool)):
                parts.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for v in value or []:
                parts += [flag, str(v)]
        elif value is None:
            continue
        elif isinstance(value, list):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def provenance(args: argparse.Namespace, words: Sequence[str]) -> dict[str, object]:
    """Command lines, time, git commit and machine of this run."""
    parser = getattr(args, "parser", None)
    return {
        "command": explicit_command(parser, args, words) if parser is not None else None,
        "argv": shlex.join(sys.argv),
        "specdec_version": version(),
        "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git": git_info(),
        "machine": machine_info(),
    }


def git_info() -> dict[str, object] | None:
    """Commit and dirty flag of the source tree, if it is a git checkout."""
    try:
        run = lambda *a: subprocess.run(  # noqa: E731
            ["git", "-C", str(REPO_ROOT), *a], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        return {"commit": run("rev-parse", "HEAD"), "dirty": bool(run("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, object]:
    import torch
    import transformers

    from specdec import native

    return {
        "cpu": _cpu_model(),
        "kernels": native.describe_simd(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table; floats get 2-3 significant decimals, None shows as a dash."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return "\n".join(lines)


def interval(figure: dict | None, suffix: str = "") -> str | None:
    """A figure with its interval, `{"value": 6.03, "ci95": [5.6, 6.4]}` -> "6.03 [5.60, 6.40]"
    (None, a dash in a table, when undefined)."""
    if figure is None or figure["value"] is None:
        return None
    low, high = figure["ci95"]
    return f"{figure['value']:.2f}{suffix} [{low:.2f}, {high:.2f}]"


def _cell(value: object) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def write_markdown(path: Path, title: str, meta: dict, sections: Sequence[tuple[str, str]]) -> Path:
    """A Markdown report: title, the command that reproduces it, then (heading, body) sections."""
    machine = meta.get("machine", {})
    git = meta.get("git") or {}
    lines = [
        f"# {title}", "",
        "Reproduce with:", "", "```", str(meta.get("command") or meta.get("argv")), "```", "",
        f"Machine: {machine.get('cpu')} · {machine.get('cpu_count')} cores · torch "
        f"{machine.get('torch')} ({machine.get('torch_threads')} threads) · transformers "
        f"{machine.get('transformers')} · {machine.get('kernels', 'kernels: ?')} · commit {str(git.get('commit', '?'))[:12]}"
        f"{' (dirty)' if git.get('dirty') else ''} · {meta.get('started_utc')}", "",
    ]
    for heading, body in sections:
        lines += [f"## {heading}", "", body, ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def new_figure(ncols: int = 1, nrows: int = 1, width: float = 5.0, height: float = 3.6):
    """A matplotlib figure on the Agg backend (no display needed); returns (fig, flat axes list)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, [ax for row in axes for ax in row]


def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
