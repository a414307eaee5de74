"""The documentation's relative links resolve, and the version is named one way everywhere."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = target.split("#")[0]
        if path and not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_specdec_version_prints_what_pyproject_holds():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11+")
    import tomllib

    from specdec.version import version

    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version() == expected
    out = subprocess.run([sys.executable, "-m", "specdec.api.cli", "--version"], capture_output=True, text=True)
    assert out.stdout.strip() == f"specdec {expected}"


def test_the_docs_count_releases_by_version_not_by_work_period():
    """'session' in the docs means a user's chat session only."""
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in DOCS for n, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"\bsessions?\b", line, re.I) and not re.search(r"chat sessions?", line, re.I)]
    assert not hits, hits


def test_no_sitting_scripts_under_docs_results():
    """A results page names `specdec bench` / `python -m specdec.eval.*` commands; the one-off scripts
    of earlier sittings were removed in 0.22.0 and are read with `git show <commit>:<path>`."""
    scripts = [p.relative_to(ROOT) for p in (ROOT / "docs" / "results").rglob("*") if p.suffix in (".py", ".sh")]
    assert not scripts, f"sitting scripts under docs/results (make them a command, or remove them): {scripts}"
    named = re.compile(r"(?<!:)docs/results/[\w./-]+\.(?:py|sh)\b")
    stale = [f"{p.relative_to(ROOT)}: {m}" for p in [*ROOT.glob("*/*.py"), *ROOT.glob("specdec/*/*.py"), *DOCS]
             if p.name != "CHANGELOG.md"  # history: what each release had
             for m in named.findall(p.read_text())]
    assert not stale, f"named as if still there (say `git show <commit>:<path>`): {stale}"


def test_the_source_files_the_docs_name_exist():
    """A file of the tree named in the README or docs/ (outside the results pages, which keep what
    each release had) is there: a module moved (as the step's to specdec/step/) leaves no stale name."""
    named = re.compile(r"(?<![\w:/.-])((?:specdec|target|draft|verify|cache|api|eval|tests)/[\w/.-]+\.(?:py|c|h))\b")
    missing = [f"{p.relative_to(ROOT)}: {m}" for p in DOCS if "results" not in p.parts and p.name != "CHANGELOG.md"
               for m in named.findall(p.read_text()) if not (ROOT / m).exists()]
    assert not missing, missing
