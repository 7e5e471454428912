"""Layers import one way: no cycle between the project's layers, nor between worker's folders.

    worker.core  <-  engines  <-  worker (the rest)  <-  benchmarks

`worker.core` is the lowest floor of the worker package: engines may import it and nothing
else of `worker`. The import graph is read from the source with `ast` (every `import` and
`from ... import`, including the ones inside functions, which a runtime check would miss),
folded onto layers (the longest layer name a module starts with), and searched for cycles.
Tests are a consumer of every layer and are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from tests.conftest import ROOT

LAYERS = ("worker.core", "engines", "worker", "benchmarks")
# The intended order, lowest first: a layer may import only those before it.
ORDER = {name: i for i, name in enumerate(LAYERS)}


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


def layer_of(module: str, layers: Iterable[str]) -> str | None:
    """The longest layer name `module` is, or lies under; None outside every layer."""
    found = [layer for layer in layers if module == layer or module.startswith(layer + ".")]
    return max(found, key=len, default=None)


def package_graph(root: Path, layers: Iterable[str]) -> dict[str, dict[str, list[str]]]:
    """{layer: {imported layer: [modules that import it]}}, between the given layers only. A layer
    is a package or a subpackage (`worker.core`); a module belongs to the longest that holds it."""
    layers = tuple(layers)
    graph: dict[str, dict[str, list[str]]] = {layer: {} for layer in layers}
    tops = sorted({layer.split(".")[0] for layer in layers})
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            is_package = rel.name == "__init__"
            module = ".".join(rel.parts[:-1] if is_package else rel.parts)
            here = layer_of(module, layers)
            if here is None:
                continue
            for name in imported_modules(path.read_text(encoding="utf-8"), module, is_package):
                there = layer_of(name, layers)
                if there is not None and there != here:
                    graph[here].setdefault(there, []).append(module)
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


def test_no_import_cycle_between_layers() -> None:
    graph = package_graph(ROOT, LAYERS)
    cycle = find_cycle(graph)
    if cycle:
        where = "; ".join(f"{a} -> {b} in {', '.join(sorted(set(graph[a][b]))[:3])}"
                          for a, b in zip(cycle, cycle[1:]))
        pytest.fail(f"import cycle between top-level packages: {' -> '.join(cycle)} ({where})")


def test_each_layer_imports_only_the_layers_below_it() -> None:
    graph = package_graph(ROOT, LAYERS)
    upward = {f"{pkg} -> {dep}": sorted(set(mods))[:3] for pkg, deps in graph.items()
              for dep, mods in deps.items() if ORDER[dep] > ORDER[pkg]}
    assert not upward, f"imports that reach up a layer: {upward}"
    # The layers are in use; engines reaches worker.core and nothing else of worker.
    assert "worker.core" in graph["engines"] and "engines" in graph["worker"]
    assert "worker" not in graph["engines"], f"engines imports worker outside worker.core: {graph['engines']['worker']}"


def worker_folders() -> tuple[str, ...]:
    """worker's subpackages and top-level modules: the units its folder graph is drawn between."""
    units = [f"worker.{p.name}" for p in sorted((ROOT / "worker").iterdir())
             if (p.is_dir() and (p / "__init__.py").is_file())
             or (p.suffix == ".py" and p.name != "__init__.py")]
    return tuple(u.removesuffix(".py") for u in units)


def test_no_import_cycle_between_worker_folders() -> None:
    graph = package_graph(ROOT, worker_folders())
    cycle = find_cycle(graph)
    if cycle:
        where = "; ".join(f"{a} -> {b} in {', '.join(sorted(set(graph[a][b]))[:3])}"
                          for a, b in zip(cycle, cycle[1:]))
        pytest.fail(f"import cycle between worker's folders: {' -> '.join(cycle)} ({where})")


# What every stage reads its settings from: it may lean on the floors below (the model, the
# names, logging), never on a stage above it.
SETTINGS_MAY_IMPORT = {"worker.core", "worker.names", "worker.operations"}


def test_settings_import_nothing_above_them() -> None:
    graph = package_graph(ROOT, worker_folders())
    above = {dep: sorted(set(mods)) for dep, mods in graph["worker.settings"].items()
             if dep not in SETTINGS_MAY_IMPORT}
    assert not above, f"settings import from above: {above}"


# The stages a record passes through (docs/architecture.md): joined by parameters the assembly
# hands them (intake's `submit` and `reject`, the bucketer's `on_batch`), never by importing each
# other. The backends' base is the one exception: the protocol every stage holds a backend through,
# and the error the isolating wrapper raises to the output stage.
STAGES = ("worker.intake", "worker.batching", "worker.backends", "worker.output")
STAGE_INTERFACES = ("worker.backends.base",)


def test_no_stage_imports_another_stage() -> None:
    graph = package_graph(ROOT, STAGES + STAGE_INTERFACES)
    across = {f"{stage} -> {other}": sorted(set(mods)) for stage in STAGES
              for other, mods in graph[stage].items() if other in STAGES}
    assert not across, f"a stage imports another stage (pass it as a parameter instead): {across}"
    # The rule is in force: the interface is what the stages do share.
    assert "worker.backends.base" in graph["worker.batching"] and "worker.backends.base" in graph["worker.output"]


def test_a_module_belongs_to_its_longest_layer() -> None:
    assert layer_of("worker.core.model", LAYERS) == "worker.core"
    assert layer_of("worker.core", LAYERS) == "worker.core"
    assert layer_of("worker.corex", LAYERS) == "worker"
    assert layer_of("engines.build_engine", LAYERS) == "engines"
    assert layer_of("numpy", LAYERS) is None


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


# A module this long says why, in its docstring (the project's rule: small modules with one job).
LONG_MODULE_LINES = 400


def test_a_module_over_400_lines_says_why() -> None:
    unexplained = []
    for top in ("worker", "engines"):
        for path in sorted((ROOT / top).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if text.count("\n") > LONG_MODULE_LINES:
                doc = ast.get_docstring(ast.parse(text)) or ""
                if f"Over {LONG_MODULE_LINES} lines because" not in doc.replace("\n", " "):
                    unexplained.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not unexplained, f"modules over {LONG_MODULE_LINES} lines whose docstring does not say why: {unexplained}"


def benchmark_modules() -> tuple[str, ...]:
    """Every module of benchmarks/ (packages by their __init__), each a unit of its own."""
    names = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        names.append(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
    return tuple(names)


def test_no_import_cycle_between_benchmark_modules() -> None:
    # Imports under `if TYPE_CHECKING:` count too: a circle only a type checker follows is still one
    # a reader has to walk round.
    graph = package_graph(ROOT, benchmark_modules())
    cycle = find_cycle(graph)
    if cycle:
        pytest.fail(f"import cycle between benchmark modules: {' -> '.join(cycle)}")
