"""The shell commands of the README and docs/, read out of their fenced `bash` blocks and checked.

Each block is split into simple commands (continuation lines joined, comments dropped, split at
`|`, `&&`, `||` and `;`). A command the project owns is checked against the code:

- `keyword-embedder SUB --flag ...`: SUB is a subcommand and every `--flag` is one of its options
  (argparse's, so `--no-x` counts for a boolean);
- `make TARGET`: the Makefile defines TARGET;
- a project script (`bash deploy/local/kafka.sh start --secure`, `python deploy/tools/prometheus_rule.py
  --check`, `python -m benchmarks.x --rounds 3`, `python -m pytest tests/x.py`): the file (for
  `-m benchmarks.x`, benchmarks/x.py) exists and names every `--flag` it is given; a benchmark is
  run as a module (`python benchmarks/x.py` is refused: its imports need the repository root);
- `pip install '.[extra]'` / `'keyword-embedder[extra]'`: pyproject.toml declares the extra;
- `docker build -f FILE`, `podman build -f FILE`, `kubectl apply -k DIR`: the file or folder exists.

Anything else (kcat, curl, kubectl get, ...) is another program's business and is not checked.
A block preceded by the line `<!-- docs-test: run -->` is also run, as written, by
tests/unit/docs/test_docs_commands.py.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

RUN_MARK = "<!-- docs-test: run -->"
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[A-Za-z0-9_-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
SHELL_LANGS = ("bash", "sh", "shell", "console")
SEPARATORS = {"|", "||", "&&", ";", "&", "(", ")"}
# The interpreters a project script is run with; what follows is the script (or -m module).
INTERPRETERS = re.compile(r"^(?:\S*/)?(?:bash|sh|python3?(?:\.\d+)?)$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    body: str
    run: bool

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def shell_blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    blocks = []
    for m in FENCE.finditer(text):
        if m["lang"] not in SHELL_LANGS:
            continue
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip().splitlines()
        run = bool(before) and before[-1].strip() == RUN_MARK
        body = "\n".join(row[len(m["indent"]):] for row in m["body"].splitlines())
        blocks.append(Block(path, line, body, run))
    return blocks


def commands(body: str) -> Iterator[list[str]]:
    """The simple commands of a shell block, as word lists (leading VAR=value words dropped)."""
    joined = re.sub(r"\\\n", " ", body)
    for raw in joined.splitlines():
        lexer = shlex.shlex(raw, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            words = list(lexer)
        except ValueError:  # an unbalanced quote: a prose fragment, not a command
            continue
        current: list[str] = []
        for word in words + [";"]:
            if word in SEPARATORS:
                while current and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", current[0]):
                    current.pop(0)
                if current:
                    yield current
                current = []
            else:
                current.append(word)


def _flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2]


@cache
def subcommand_options(name: str) -> frozenset[str] | None:
    from worker.cli import SUBCOMMANDS

    entry = SUBCOMMANDS.get(name)
    if entry is None:
        return None
    module = importlib.import_module(f"worker.commands.{entry[0]}")
    parser = argparse.ArgumentParser(add_help=True)
    module.configure(parser)
    return frozenset(o for action in parser._actions for o in action.option_strings)  # noqa: SLF001


@cache
def make_targets(root: Path) -> frozenset[str]:
    text = (root / "Makefile").read_text(encoding="utf-8")
    return frozenset(m[1] for m in re.finditer(r"^([A-Za-z0-9_.-]+):", text, re.M))


@cache
def extras(root: Path) -> frozenset[str]:
    data = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    return frozenset(data["project"].get("optional-dependencies", {}))


def check(words: list[str], root: Path) -> list[str]:
    """What is wrong with one command (empty: nothing, or not the project's to check)."""
    program = Path(words[0]).name
    args = words[1:]
    if program == "keyword-embedder" or words[:3] in (["python", "-m", "worker.cli"],
                                                        ["python3", "-m", "worker.cli"]):
        args = args if program == "keyword-embedder" else words[3:]
        if not args or args[0].startswith("-"):
            return []
        options = subcommand_options(args[0])
        if options is None:
            return [f"keyword-embedder has no subcommand {args[0]!r}"]
        return [f"keyword-embedder {args[0]} has no option {flag}" for flag in _flags(args[1:])
                if flag not in options]
    if program == "make":
        targets = [a for a in args if not a.startswith("-") and "=" not in a]
        return [f"the Makefile has no target {t!r}" for t in targets if t not in make_targets(root)]
    if program in ("pip", "pip3") or words[1:3] == ["-m", "pip"]:
        problems = []
        for arg in args:
            m = re.match(r"^(?:\.|keyword-embedder)\[([^\]]+)\]$", arg)
            if m:
                problems += [f"pyproject.toml has no extra {e!r}" for e in m[1].split(",")
                             if e.strip() not in extras(root)]
        return problems
    if program in ("docker", "podman") and args[:1] == ["build"] and "-f" in args:
        target = args[args.index("-f") + 1]
        return [] if (root / target).is_file() else [f"{target} does not exist"]
    if program == "kubectl" and args[:1] == ["apply"] and "-k" in args:
        target = args[args.index("-k") + 1]
        return [] if (root / target).is_dir() else [f"{target} does not exist"]
    script: str | None = None
    rest: list[str] = []
    if INTERPRETERS.match(words[0]) and args:
        if args[0] == "-m" and len(args) > 1 and args[1] == "pytest":
            return [f"{a} does not exist" for a in args[2:]
                    if a.startswith("tests/") and not (root / a.split("::")[0]).exists()]
        if args[0] == "-m" and len(args) > 1 and args[1].split(".")[0] == "benchmarks":
            script, rest = args[1].replace(".", "/") + ".py", args[2:]
        elif not args[0].startswith("-"):
            script, rest = args[0], args[1:]
    elif "/" in words[0] and not words[0].startswith(("/", "$", "~", ".venv/")):
        script, rest = words[0], args
    if script is None:
        return []
    path = root / script
    if not path.is_file():
        return [f"{script} does not exist"]
    as_module = INTERPRETERS.match(words[0]) is not None and args[:1] == ["-m"]
    if script.startswith("benchmarks/") and script.endswith(".py") and not as_module:
        return [f"{script}: run it as a module, python -m {script.removesuffix('.py').replace('/', '.')}"]
    text = path.read_text(encoding="utf-8", errors="replace")
    return [f"{script} takes no option {flag}" for flag in _flags(rest) if flag not in text]


def doc_files(root: Path) -> list[Path]:
    files = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    files += [p for p in (root / "deploy" / "README.md",) if p.is_file()]
    return [p for p in files if p.is_file()]
