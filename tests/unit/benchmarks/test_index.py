"""The benchmarks lab stays indexed (benchmarks/README.md, benchmarks/archive/README.md).

- every result file (benchmarks/results/, benchmarks/archive/results/) is referenced from the
  README, docs/ or one of the two indexes, by a link or by its path;
- every script under benchmarks/ is in its index: a runnable module as `-m benchmarks.X` (how
  to run it), a module without `__main__` in the index's Helpers section, a shell script by its
  path;
- every `benchmarks/...` path and `-m benchmarks.X` module that the docs, the indexes, the
  Makefile and the code name exists (a move that missed a reference fails here);
- no script edits `sys.path`: they run as modules from the repository root.

Text only: nothing here imports or runs a benchmark.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

BENCH = ROOT / "benchmarks"
ARCHIVE = BENCH / "archive"
INDEX = BENCH / "README.md"
ARCHIVE_INDEX = ARCHIVE / "README.md"
RESULTS = (BENCH / "results", ARCHIVE / "results")
# Where a result file may be referenced from.
REFERRERS = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), INDEX, ARCHIVE_INDEX)
# Where a named benchmarks/ path or module must exist (tests/ names missing ones on purpose).
NAMERS = (["README.md", "Makefile", "mkdocs.yml", "mkdocs_hooks.py", "pyproject.toml"],
          ["docs", "worker", "engines", "deploy", "benchmarks"])

LINK = re.compile(r"\]\((?P<target>[^)\s#]+)")
# A path from the repository root, or after ../ as docs/ pages write it (not inside another path).
REPO_PATH = re.compile(r"(?<![\w./-])(?:\.\./)*(?P<path>benchmarks/[\w./-]*\w)")
MODULE = re.compile(r"-m\s+(?P<module>benchmarks(?:\.\w+)+)")


def _in_results(path: Path) -> bool:
    return any(path.is_relative_to(r) for r in RESULTS)


def result_files() -> list[Path]:
    return sorted(p for r in RESULTS for p in r.rglob("*") if p.is_file())


def scripts() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*") if p.suffix in (".py", ".sh") and p.name != "__init__.py"
                  and not _in_results(p) and "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def referenced(doc: Path) -> set[Path]:
    """The repository files a document points at: its relative links, and the paths it names."""
    text = doc.read_text(encoding="utf-8")
    found = {(doc.parent / m["target"]).resolve() for m in LINK.finditer(text)
             if not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", m["target"])}
    return found | {(ROOT / m["path"]).resolve() for m in REPO_PATH.finditer(text)}


def section(text: str, heading: str) -> str:
    """The body of the `## heading...` section of a Markdown text ('' if none)."""
    parts = re.split(r"^## ", text, flags=re.M)
    return next((p for p in parts[1:] if p.startswith(heading)), "")


def naming_files() -> list[Path]:
    files, folders = NAMERS
    found = [ROOT / f for f in files]
    for folder in folders:
        found += [p for p in (ROOT / folder).rglob("*") if p.is_file() and not _in_results(p)
                  and "__pycache__" not in p.parts and p.suffix not in (".png", ".npy", ".npz", ".onnx", ".pyc")]
    return [p for p in found if p.is_file()]


def test_every_result_file_is_referenced_from_the_docs_or_an_index() -> None:
    refs = set().union(*(referenced(doc) for doc in REFERRERS))
    files = result_files()
    assert len(files) > 50, "the results folders should be found"
    missing = [str(p.relative_to(ROOT)) for p in files if p.resolve() not in refs]
    assert not missing, ("result files referenced nowhere (link them from benchmarks/README.md, "
                         "benchmarks/archive/README.md or the docs, or delete them):\n" + "\n".join(missing))


def test_every_script_is_in_its_index() -> None:
    problems = []
    for path in scripts():
        index = ARCHIVE_INDEX if path.is_relative_to(ARCHIVE) else INDEX
        text = index.read_text(encoding="utf-8")
        rel = path.relative_to(index.parent).as_posix()
        where = f"{path.relative_to(ROOT)} ({index.relative_to(ROOT)})"
        if path.suffix == ".sh":
            if rel not in text:
                problems.append(f"{where}: not named")
        elif "__main__" in path.read_text(encoding="utf-8"):
            if not re.search(r"-m\s+" + re.escape(module_name(path)) + r"(?![\w.])", text):
                problems.append(f"{where}: no `python -m {module_name(path)}` to say how it runs")
        elif rel not in section(text, "Helpers"):
            problems.append(f"{where}: a module without __main__ that the Helpers section does not name")
    assert not problems, "\n".join(problems)


def test_no_benchmark_script_edits_sys_path() -> None:
    edits = [str(p.relative_to(ROOT)) for p in scripts() if "sys.path" in p.read_text(encoding="utf-8")]
    assert not edits, f"run benchmarks as modules (python -m benchmarks.X) instead of editing sys.path: {edits}"


def test_every_benchmarks_path_and_module_named_in_the_docs_and_the_code_exists() -> None:
    dead = []
    for path in naming_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        where = path.relative_to(ROOT)
        dead += [f"{where}: {m['path']}" for m in REPO_PATH.finditer(text) if not (ROOT / m["path"]).exists()]
        for m in MODULE.finditer(text):
            base = ROOT / m["module"].replace(".", "/")
            if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
                dead.append(f"{where}: -m {m['module']}")
    for index in (INDEX, ARCHIVE_INDEX):
        text = index.read_text(encoding="utf-8")
        dead += [f"{index.relative_to(ROOT)}: {m['target']}" for m in LINK.finditer(text)
                 if not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", m["target"])
                 and not (index.parent / m["target"]).exists()]
    assert not dead, "named but not there:\n" + "\n".join(dead)


def test_the_checks_see_what_they_should(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "x.md"
    doc.parent.mkdir()
    doc.write_text("[r](../benchmarks/results/a/r.json) `benchmarks/results/b/s.md` [web](https://e.com/x) "
                   "/elsewhere/benchmarks/results/c.json\n", encoding="utf-8")
    found = referenced(doc)
    assert (tmp_path / "benchmarks/results/a/r.json").resolve() in found  # the link, from the page
    assert (ROOT / "benchmarks/results/b/s.md").resolve() in found  # the path, from the repository root
    assert not any("e.com" in str(p) or p.name == "c.json" for p in found)
    text = "# T\n\n## Scripts\n\nfresh_keywords.py\n\n## Helpers\n\ngpu/paired.py\n\n## Results\n"
    assert "gpu/paired.py" in section(text, "Helpers") and "fresh_keywords.py" not in section(text, "Helpers")
    assert module_name(BENCH / "gpu" / "trt_check.py") == "benchmarks.gpu.trt_check"
    assert [m["module"] for m in MODULE.finditer("python -m benchmarks.kafka_ab --x; $PY -m benchmarks.gpu.x")] == [
        "benchmarks.kafka_ab", "benchmarks.gpu.x"]
