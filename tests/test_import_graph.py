"""The layering is true: every specdec import (inside functions too) read from the source.

    paths, native                      leaves (the cache folder, the C kernel builds)
    cache, verify                      below everything that knows models or requests
    target.model (config, rope)        knows no quantization and no loader
    target.quant                       converts linears; knows no loader and no runner
    target.runner, target loaders      build and run models
    parallel                           a target split over processes (runner, loaders below it)
    draft, engine, api, eval           above

An import inside a function is an import: a loop held together by one is still a loop.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODELS = ("specdec.target",)
PROPOSERS = ("specdec.draft",)
ENGINE = (
    "specdec.engine", "specdec.step", "specdec.sequence", "specdec.engine_parts",
)
FRONTS = ("specdec.api", "specdec.eval")
LOADERS = ("specdec.target.model_weights", "specdec.target.model_files", "specdec.engine_parts")
MODEL = ("specdec.target.model", "specdec.target.config", "specdec.target.rope")

# (modules, what they must never reach, even through a chain of imports)
RULES = [
    (("specdec.cache", "specdec.verify"), MODELS + PROPOSERS + ENGINE + FRONTS),
    (MODEL, ("specdec.target.quant", "specdec.target.runner") + LOADERS),
    (("specdec.target.quant",), ("specdec.target.runner",) + LOADERS),
    (MODELS, PROPOSERS + ENGINE + FRONTS),
    (("specdec.parallel",), PROPOSERS + ENGINE + FRONTS),  # a target over ranks: below the engine
    (("specdec.paths", "specdec.target.quant.modes"), ("specdec.",)),  # leaves
]


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p if p.endswith(".") else p + ".") for p in prefixes)


def module_files() -> dict[str, Path]:
    """Every module of the installed packages, by name (`package-dir` of pyproject.toml)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    files = {}
    for package, folder in setuptools["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join((package, *parts))] = path
    return files


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:` (never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for child in node.orelse:
                yield child
                yield from _runtime_nodes(child)
            continue
        yield node
        yield from _runtime_nodes(node)


def imports_of(name: str, path: Path, modules: set[str]) -> tuple[set[str], set[str]]:
    """(specdec modules `name` imports, names it imports that are no module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found, unknown = set(), set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            if target == "specdec" or target.startswith("specdec."):
                (found if target in modules else unknown).add(target)
    return found, unknown


def _read_graph() -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    files = module_files()
    edges, unknown = {}, {}
    for name, path in files.items():
        edges[name], missing = imports_of(name, path, set(files))
        if missing:
            unknown[name] = sorted(missing)
    return edges, unknown


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _read_graph()[0]


def test_every_specdec_import_names_a_module():
    assert not _read_graph()[1], "imports of modules that do not exist (renamed or moved?)"


def _loops(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                loops.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return loops


def test_no_import_cycles(graph):
    assert not _loops(graph), "import loops:\n" + "\n".join(" <-> ".join(loop) for loop in _loops(graph))


def _with_parents(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing `a.b.c` runs `a` and `a.b` first: for what a module pulls in, those count too."""
    full = {name: set(deps) for name, deps in graph.items()}
    for name in graph:
        parts = name.split(".")
        full[name] |= {".".join(parts[:i]) for i in range(1, len(parts))}
    return full


def _reach(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module `start` loads, with the module that imports it (for the error message)."""
    seen, todo = {start: ""}, [start]
    while todo:
        node = todo.pop()
        for nxt in graph.get(node, ()):
            if nxt not in seen:
                seen[nxt] = node
                todo.append(nxt)
    return seen


def _chain(seen: dict[str, str], end: str) -> str:
    chain = [end]
    while seen[chain[-1]]:
        chain.append(seen[chain[-1]])
    return " <- ".join(chain)


@pytest.mark.parametrize("lower, upper", RULES, ids=[",".join(r[0]) for r in RULES])
def test_layers_import_downwards_only(graph, lower, upper):
    full = _with_parents(graph)
    bad = []
    for name in sorted(n for n in graph if _under(n, lower)):
        seen = _reach(full, name)
        own = {m for m in seen if m == name or name.startswith(m + ".")}  # itself, its packages
        bad += [_chain(seen, m) for m in sorted(seen) if m not in own and _under(m, upper)]
    assert not bad, "\n".join(bad)


def test_importing_the_cache_loads_no_model_and_no_engine():
    code = (
        "import sys, specdec.cache\n"
        "from specdec import EngineConfig\n"
        "EngineConfig()\n"  # a plain value: builds nothing, loads no model code
        "print(' '.join(m for m in sys.modules if m.startswith(('specdec.target.', 'specdec.engine'))))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == ["specdec.target.quant", "specdec.target.quant.modes"]


def test_the_root_still_exports_its_names():
    import specdec

    assert {"Engine", "EngineConfig", "SamplingParams", "RequestOutput", "StepDelta", "TokenOrigin"} <= set(dir(specdec))
    from specdec import EngineConfig, SamplingParams

    assert EngineConfig().proposer and SamplingParams().max_tokens
    with pytest.raises(AttributeError):
        specdec.NoSuchName  # noqa: B018
