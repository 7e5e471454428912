"""The documentation site builds with `mkdocs build --strict` (a broken link or anchor between pages
fails it), its links to repository files outside docs/ are checked and served by mkdocs_hooks.py,
and the README's own links (the README is not a page of the site) point at files and headings that
exist. The whole site builds in a few seconds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mkdocs_hooks import LINK, Tree, _each_link, repo_links, rewrite_links
from tests.conftest import ROOT

ENV = dict(os.environ, NO_MKDOCS_2_WARNING="1")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, env=ENV, capture_output=True, text=True,
                          timeout=300)


def test_the_site_builds_strict_with_every_page_in_the_nav(tmp_path: Path) -> None:
    began = time.monotonic()
    run = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    took = time.monotonic() - began
    assert run.returncode == 0, run.stdout + run.stderr
    print(f"mkdocs build --strict: {took:.1f} s")
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert [p for p in pages if f": {p}\n" not in nav] == [], "pages missing from mkdocs.yml's nav"
    # A repository file a page links to is served from the site (here: the runbook's alert rules).
    assert (tmp_path / "site" / "repo" / "deploy" / "prometheus" / "alerts.yml").is_file()


def test_a_link_to_a_repository_file_that_does_not_exist_fails_the_build(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "present.txt").write_text("here\n", encoding="utf-8")
    (tmp_path / "docs" / "index.md").write_text(
        "# Home\n\n[there](../present.txt) and [gone](../benchmarks/results/gone.json)\n", encoding="utf-8")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"site_name: t\nhooks:\n  - {ROOT / 'mkdocs_hooks.py'}\n", encoding="utf-8")
    run = _build(config, tmp_path / "site")
    assert run.returncode != 0
    assert "index.md: ../benchmarks/results/gone.json: no such file" in run.stdout + run.stderr
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[there](../present.txt)\n", encoding="utf-8")
    run = _build(config, tmp_path / "site")
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "repo" / "present.txt").read_text(encoding="utf-8") == "here\n"


# ------------------------------------------------------------------ the hook's pieces


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    for name in ("docs/img/a.png", "docs/delivery.md", "benchmarks/results/r.json", "deploy/README.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x", encoding="utf-8")
    return Tree(tmp_path / "docs", tmp_path)


def test_repo_links_finds_files_outside_docs_and_reports_the_dead_ones(tree: Tree) -> None:
    page = tree.docs / "performance.md"
    text = ("[r](../benchmarks/results/r.json) [d](../deploy/README.md#images) [in](delivery.md#x) "
            "![img](img/a.png) [web](https://example.com/a.md) [here](#top)\n"
            "[gone](../benchmarks/results/gone.json) [dir](../benchmarks/results/) [out](../../x.md)\n"
            "`[code](../nowhere.md)`\n```\n[fenced](../nowhere.md)\n```\n")
    found, dead = repo_links(text, page, tree)
    assert found == [tree.repo / "benchmarks/results/r.json", tree.repo / "deploy/README.md"]
    assert dead == ["../benchmarks/results/gone.json: no such file (benchmarks/results/gone.json)",
                    "../benchmarks/results/: a folder (link a file in it) (benchmarks/results)",
                    "../../x.md: outside the repository"]


def test_rewrite_links_points_at_the_files_places_in_the_site(tree: Tree) -> None:
    page = tree.docs / "performance.md"
    text = "[r](../benchmarks/results/r.json) [in](delivery.md#x) [web](https://e.com) `[c](../deploy/README.md)`"
    assert rewrite_links(text, page, "performance.md", tree) == (
        "[r](repo/benchmarks/results/r.json) [in](delivery.md#x) [web](https://e.com) `[c](../deploy/README.md)`")
    # A repository page added to the site (deploy/README.md) links back into docs/ and beside itself.
    readme = tree.repo / "deploy" / "README.md"
    text = "[settings](../docs/delivery.md#rules) [r](../benchmarks/results/r.json) [top](#images)"
    assert rewrite_links(text, readme, "repo/deploy/README.md", tree) == (
        "[settings](../../delivery.md#rules) [r](../benchmarks/results/r.json) [top](#images)")


# ------------------------------------------------------------------ the README (not a page of the site)


def _slug(heading: str) -> str:
    """The anchor MkDocs' toc gives a heading (markdown.extensions.toc.slugify on its text), which is
    GitHub's too for headings without runs of spaces or dashes."""
    text = re.sub(r"[^\w\s-]", "", re.sub(r"[`*]", "", heading)).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {_slug(m[1]) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


@pytest.mark.parametrize("doc", ["README.md"])
def test_the_readme_links_point_at_files_and_headings_that_exist(doc: str) -> None:
    source = ROOT / doc
    problems: list[str] = []

    def check(m: re.Match[str]) -> str:
        target = m["target"]
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target):
            return m[0]
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            problems.append(f"{target}: {resolved.name} has no heading #{anchor}")
        return m[0]

    _each_link(source.read_text(encoding="utf-8"), check)
    assert LINK.search(source.read_text(encoding="utf-8")), "no links found: the pattern is wrong"
    assert problems == [], f"{doc}:\n" + "\n".join(problems)


def test_the_slug_is_the_one_mkdocs_gives() -> None:
    assert _slug("Offsets that go back") == "offsets-that-go-back"
    assert _slug("Schema Registry, headers, trace context and sinks") == "schema-registry-headers-trace-context-and-sinks"
    assert _slug("`kwe_backend_info` and the CPU") == "kwe_backend_info-and-the-cpu"
