"""The package's version, one source: `pyproject.toml`'s `[project] version`.

Read from pyproject.toml when running from a checkout (an editable install's recorded metadata
goes stale when the file is bumped), else from the installed distribution's metadata.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def version() -> str:
    """e.g. "0.11.0"; "0+unknown" when neither the checkout nor an install says."""
    if _PYPROJECT.is_file() and sys.version_info >= (3, 11):
        import tomllib

        project = tomllib.loads(_PYPROJECT.read_text()).get("project", {})
        if project.get("name") == "specdec":
            return str(project["version"])
    try:
        return metadata.version("specdec")
    except metadata.PackageNotFoundError:
        return "0+unknown"
