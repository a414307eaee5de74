"""The package as a user installs it: a wheel built from this checkout, installed into a folder of
its own, runs `specdec generate` on a tiny random pair with no checkout on the path, and compiles
its C kernels from the installed package data (the sources and headers `pyproject.toml` lists)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import native
from specdec.testing import write_tiny_pair

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The folder the wheel was installed into (`pip install --target`)."""
    if shutil.which("git") is None and not (ROOT / ".git").exists():
        pytest.skip("not a checkout")
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"  # a copy: building in the checkout would leave build/ there
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "results", "tests", "docs", ".gpu"))
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(work), str(source)])
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = work.glob("specdec-*.whl")
    site = work / "site"
    done = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)])
    assert done.returncode == 0, done.stderr[-2000:]
    return site


def _env(site: Path, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECDEC_ISA", "SPECDEC_NO_KERNELS")}
    return env | {"PYTHONPATH": str(site), "SPECDEC_CACHE": str(cache)}


def test_the_installed_wheel_generates_and_builds_its_kernels(installed, tmp_path):
    target, draft = write_tiny_pair(tmp_path / "pair")
    env = _env(installed, tmp_path / "cache")
    where = _run([sys.executable, "-c", "import specdec; print(specdec.__file__)"], env=env, cwd=tmp_path)
    assert where.stdout.strip().startswith(str(installed)), where.stdout + where.stderr
    out = _run([sys.executable, "-m", "specdec.api.cli", "generate", "def fib(n):", "--target", str(target),
                "--draft", str(draft), "--dtype", "bfloat16", "--max-tokens", "6", "--temperature", "0",
                "--no-chat", "--no-warmup"], env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tok/s" in out.stderr and "kernels:" in out.stderr
    if native.simd_level() is not None:  # this CPU runs the kernels: they were compiled from the wheel's files
        built = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "kernels").glob("*.so"))
        assert "qgemm" in built, built


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_the_installed_wheel_knows_its_version(installed, tmp_path):
    import tomllib

    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    out = _run([sys.executable, "-m", "specdec.api.cli", "--version"], env=_env(installed, tmp_path), cwd=tmp_path)
    assert out.stdout.strip() == f"specdec {expected}", out.stdout + out.stderr
