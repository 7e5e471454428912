"""MkDocs hook (mkdocs.yml `hooks:`): links from docs/ pages to repository files outside docs/.

The pages link the benchmark results, source files and deploy/ by their relative path in the
repository (`../benchmarks/results/batching/bucketing.md`), which works where the Markdown is read as it
is (a repository browser, an editor). MkDocs knows only the files under docs/ and, under
`--strict`, fails on such a link. This hook:

- finds every link from a page to a path outside docs/ (on_files) and stops the build, naming the
  page and the link, when that path is not a file of the repository (a folder, a missing or
  renamed file, a path outside the repository): a link is never silently dead;
- adds each linked file to the site as `repo/<path in the repository>`: a Markdown file (a
  benchmark report, deploy/README.md) becomes a page of its own, outside the navigation, whose
  links are followed and checked the same way; any other file (JSON, source, YAML) is copied as
  it is. So the built site's links work offline and on any host, with no repository URL to know;
- rewrites those links on each page (on_page_markdown) to the file's place in the site, and the
  links of a `repo/` page back into docs/ to the page's place, so MkDocs then checks every link
  and anchor itself, as it does for links between docs/ pages.

Absolute URLs and in-page anchors are left alone, and so are fenced and inline code (a path in a
code span is text, not a link).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, InclusionLevel

SITE_FOLDER = "repo"
# [text](target "title") and ![alt](target); the target has no spaces or parentheses here.
LINK = re.compile(r"(?P<head>!?\[[^\]]*\]\()(?P<target>[^)\s]+)(?P<tail>(?:\s+\"[^\"]*\")?\))")
CODE = re.compile(r"^(?P<fence> *(?:```|~~~)).*?^(?P=fence)[ \t]*$|`[^`\n]+`", re.M | re.S)
EXTERNAL = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*:|/|#)")


@dataclass(frozen=True)
class Tree:
    """Where the pages are (docs/) inside the repository, both resolved."""
    docs: Path
    repo: Path

    def site_path(self, path: Path) -> str | None:
        """The site's source path of a repository file: docs/x.md -> x.md, README.md -> repo/README.md."""
        if path.is_relative_to(self.docs):
            return path.relative_to(self.docs).as_posix()
        if path.is_relative_to(self.repo):
            return f"{SITE_FOLDER}/{path.relative_to(self.repo).as_posix()}"
        return None


def _each_link(markdown: str, replace: Any) -> str:
    """markdown with replace(match) applied to every link outside code."""
    out, last = [], 0
    for code in CODE.finditer(markdown):
        out.append(LINK.sub(replace, markdown[last:code.start()]))
        out.append(code[0])
        last = code.end()
    out.append(LINK.sub(replace, markdown[last:]))
    return "".join(out)


def _target(source: Path, target: str) -> tuple[Path, str, str] | None:
    """(resolved path, '#' or '', anchor) of a relative link; None for URLs and anchors."""
    path, sep, anchor = target.partition("#")
    if not path or EXTERNAL.match(target):
        return None
    return (source.parent / path).resolve(), sep, anchor


def repo_links(markdown: str, source: Path, tree: Tree) -> tuple[list[Path], list[str]]:
    """The repository files outside docs/ that a page links to, and its dead links (messages)."""
    found: list[Path] = []
    dead: list[str] = []

    def visit(m: re.Match[str]) -> str:
        hit = _target(source, m["target"])
        if hit is None or hit[0].is_relative_to(tree.docs):
            return m[0]
        path = hit[0]
        if not path.is_relative_to(tree.repo):
            dead.append(f"{m['target']}: outside the repository")
        elif not path.is_file():
            what = "a folder (link a file in it)" if path.is_dir() else "no such file"
            dead.append(f"{m['target']}: {what} ({path.relative_to(tree.repo)})")
        else:
            found.append(path)
        return m[0]

    _each_link(markdown, visit)
    return found, dead


def rewrite_links(markdown: str, source: Path, src_uri: str, tree: Tree) -> str:
    """The page's links to repository files, docs/ pages included, as links between site paths."""
    here = posixpath.dirname(src_uri)

    def rewrite(m: re.Match[str]) -> str:
        hit = _target(source, m["target"])
        site_path = hit and hit[0].exists() and tree.site_path(hit[0])
        if not site_path:
            return m[0]  # left for MkDocs (and repo_links) to report
        return f"{m['head']}{posixpath.relpath(site_path, here or '.')}{hit[1]}{hit[2]}{m['tail']}"

    return _each_link(markdown, rewrite)


def _tree(config: Any) -> Tree:
    return Tree(Path(config["docs_dir"]).resolve(), Path(config["config_file_path"]).parent.resolve())


def on_files(files: Any, config: Any) -> Any:
    tree = _tree(config)
    pending = [Path(f.abs_src_path) for f in files.documentation_pages()]
    added: set[Path] = set()
    dead: list[str] = []
    while pending:
        source = pending.pop()
        found, problems = repo_links(source.read_text(encoding="utf-8"), source, tree)
        where = tree.site_path(source) if source.is_relative_to(tree.docs) else source.relative_to(tree.repo)
        dead += [f"{where}: {problem}" for problem in problems]
        for path in found:
            if path in added:
                continue
            added.add(path)
            files.append(File.generated(config, tree.site_path(path), abs_src_path=str(path),
                                        inclusion=InclusionLevel.NOT_IN_NAV))
            if path.suffix == ".md":
                pending.append(path)
    if dead:
        raise PluginError("links to repository files that do not exist:\n  " + "\n  ".join(sorted(dead)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return rewrite_links(markdown, Path(page.file.abs_src_path), page.file.src_uri, _tree(config))
