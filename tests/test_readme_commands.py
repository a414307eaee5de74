"""What the README tells a newcomer to type exists: its length stays one screen of truth (<= 160
lines), every `specdec ...` command line in it names a subcommand that exists with options that
exist, and every `--flag` it names in prose is an option of some `specdec` subcommand."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from specdec.api.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
_NOT_SPECDEC = ("pip ", "python -m pytest", "curl ", "-d '")  # other programs' flags


def _parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every (sub)command's parser by its words: () for `specdec`, ("bench", "latency"), ..."""
    out, todo = {}, [((), build_parser())]
    while todo:
        words, parser = todo.pop()
        out[words] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [((*words, name), sub) for name, sub in action.choices.items()]
    return out


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_the_readme_is_one_screen():
    assert len(README.read_text().splitlines()) <= 160


def test_every_specdec_command_line_runs_as_written():
    parsers = _parsers()
    lines = [line.split("#")[0].strip() for line in README.read_text().splitlines()]
    commands = [line[line.index("specdec "):] for line in lines if re.match(r"^(.*&& )?specdec \w", line)]
    assert len(commands) >= 10
    for command in commands:
        words = shlex.split(command.split("&&")[0])[1:]
        path: tuple[str, ...] = ()
        while words and (*path, words[0]) in parsers:
            path, words = (*path, words[0]), words[1:]
        assert path, command
        known = _options(parsers[path])
        flags = [w.split("=")[0] for w in words if w.startswith("-")]
        assert all(f in known for f in flags), (command, [f for f in flags if f not in known])


def test_every_flag_named_in_prose_exists():
    known = set().union(*(_options(p) for p in _parsers().values()))
    text = "\n".join(line for line in README.read_text().splitlines() if not any(m in line for m in _NOT_SPECDEC))
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", text))
    assert named and named <= known, sorted(named - known)
