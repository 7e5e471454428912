"""Layers import one way: no cycle between the project's top-level packages.

    kwe_core  <-  engines  <-  worker  <-  benchmarks

The import graph is read from the source with `ast` (every `import` and `from ... import`,
including the ones inside functions, which a runtime check would miss), folded onto top-level
packages, and searched for cycles. Tests are a consumer of every layer and are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kwe_core", "engines", "worker", "benchmarks")
# The intended order, lowest first: a package may import only those before it.
ORDER = {name: i for i, name in enumerate(PACKAGES)}


def imported_modules(source: str, module: str, is_package: bool) -> Iterable[str]:
    """Absolute names of everything `module` imports (relative imports resolved)."""
    tree = ast.parse(source)
    parts = module.split(".")
    here = parts if is_package else parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                yield ".".join([*base, node.module] if node.module else base)
            elif node.module:
                yield node.module


def package_graph(root: Path, packages: Iterable[str]) -> dict[str, dict[str, list[str]]]:
    """{package: {imported package: [modules that import it]}}, between the given packages only."""
    packages = tuple(packages)
    graph: dict[str, dict[str, list[str]]] = {p: {} for p in packages}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            is_package = rel.name == "__init__"
            module = ".".join(rel.parts[:-1] if is_package else rel.parts)
            for name in imported_modules(path.read_text(encoding="utf-8"), module, is_package):
                top = name.split(".")[0]
                if top in graph and top != pkg:
                    graph[pkg].setdefault(top, []).append(module)
    return graph


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in graph:
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_top_level_packages() -> None:
    graph = package_graph(ROOT, PACKAGES)
    cycle = find_cycle(graph)
    if cycle:
        where = "; ".join(f"{a} -> {b} in {', '.join(sorted(set(graph[a][b]))[:3])}"
                          for a, b in zip(cycle, cycle[1:]))
        pytest.fail(f"import cycle between top-level packages: {' -> '.join(cycle)} ({where})")


def test_each_package_imports_only_the_layers_below_it() -> None:
    graph = package_graph(ROOT, PACKAGES)
    upward = {f"{pkg} -> {dep}": sorted(set(mods))[:3] for pkg, deps in graph.items()
              for dep, mods in deps.items() if ORDER[dep] > ORDER[pkg]}
    assert not upward, f"imports that reach up a layer: {upward}"
    assert "kwe_core" in graph["engines"] and "engines" in graph["worker"]  # the layers are in use


def test_the_checker_sees_a_cycle_through_an_import_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "low").mkdir()
    (tmp_path / "high").mkdir()
    (tmp_path / "low" / "__init__.py").write_text("")
    (tmp_path / "high" / "__init__.py").write_text("from . import thing\n")
    (tmp_path / "high" / "thing.py").write_text("from low.base import X\n")
    (tmp_path / "low" / "base.py").write_text("def f():\n    from high.thing import Y\n    return Y\n")
    graph = package_graph(tmp_path, ("low", "high"))
    assert graph == {"low": {"high": ["low.base"]}, "high": {"low": ["high.thing"]}}
    assert find_cycle(graph) in (["low", "high", "low"], ["high", "low", "high"])
    (tmp_path / "low" / "base.py").write_text("X = 1\n")
    assert find_cycle(package_graph(tmp_path, ("low", "high"))) is None
