"""The `specdec` command line: `generate`, `chat`, `models`, `serve`, `eval`, `bench`."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from specdec.api import chat_cmd, generate_cmd, models_cmd

    from specdec.version import version

    parser = argparse.ArgumentParser(
        prog="specdec", description="Speculative-decoding LLM inference engine."
    )
    parser.add_argument("--version", action="version", version=f"specdec {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_cmd.register(sub)
    chat_cmd.register(sub)
    models_cmd.register(sub)
    for module in _optional_commands():
        module.register(sub)
    return parser


def _optional_commands() -> list:
    """Subcommands living in other modules (serve, eval, bench), when present."""
    import importlib

    modules = []
    for name in ("specdec.api.serve_cmd", "specdec.eval.cli"):
        try:
            modules.append(importlib.import_module(name))
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
    return modules


def main(argv: list[str] | None = None) -> int:
    from specdec.target.default_pair import ModelsNotInstalledError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ModelsNotInstalledError as exc:
        print(f"specdec: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspecdec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
