"""docs/architecture.md's code map matches the tree: every folder of worker/ and engines/, and every
module (but the one-per-subcommand commands/), is named there; every module it names exists."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

DOC = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


def _modules() -> list[Path]:
    return sorted(p for top in ("worker", "engines") for p in (ROOT / top).rglob("*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)


def test_every_folder_and_module_is_on_the_code_map() -> None:
    folders = {p.parent.relative_to(ROOT).as_posix() for p in _modules()}
    # A folder is named whole (`worker/intake/`) or, inside its parent's section, by its own name (`commands/`).
    missing = [f"{f}/" for f in sorted(folders) if f"`{f}/`" not in DOC and f"`{f.rsplit('/', 1)[-1]}/`" not in DOC]
    missing += [p.relative_to(ROOT).as_posix() for p in _modules()
                if p.parent.name != "commands" and f"`{p.name}`" not in DOC and p.relative_to(ROOT).as_posix() not in DOC]
    assert not missing, f"not on docs/architecture.md's code map: {missing}"


def test_every_module_the_map_names_exists() -> None:
    names = {p.name for p in _modules()} | {p.name for p in (ROOT / "worker").rglob("*.toml")} \
        | {p.name for p in (ROOT / "worker").rglob("*.json")} | {p.name for p in (ROOT / "benchmarks").rglob("*.py")}
    named = set(re.findall(r"`([a-z_0-9]+\.(?:py|toml|json))`", DOC))
    gone = sorted(n for n in named if n not in names)
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"
