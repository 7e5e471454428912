"""Keyword files on disk: `id<TAB>text` TSV, one text per line, or JSONL objects with id and text.

One reader for every command that takes a file (produce, embed, bench, demo). A bad line (not
UTF-8, no tab in a TSV, not a JSON object with id and text) stops the read with an error that
names the file and line, unless the caller passes a `BadLines` to collect it: then the line is
skipped and counted (real query logs carry a few Latin-1 lines; one of them should not refuse a
60,000-line file). `bench` and `produce` skip unless given --strict.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from worker.core.errors import KeywordEmbedderError

FORMATS = ("auto", "tsv", "lines", "jsonl")
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


class KeywordFileError(KeywordEmbedderError, ValueError):
    """A keyword file cannot be read; the message names the file and, where it applies, the line."""


@dataclass
class BadLines:
    """The lines a lenient read skipped: how many, and the first one (for the user to look at)."""

    count: int = 0
    first_line: int | None = None
    first_reason: str = ""

    def add(self, lineno: int, reason: str) -> None:
        if self.first_line is None:
            self.first_line, self.first_reason = lineno, reason
        self.count += 1

    def summary(self, path: str | Path) -> str:
        return (f"{path}: skipped {self.count} bad line{'s' if self.count != 1 else ''} (first: line "
                f"{self.first_line}, {self.first_reason}); pass --strict to refuse such a file")

    def as_dict(self) -> dict[str, object]:
        return {"skipped_lines": self.count, "first_skipped_line": self.first_line,
                "first_skipped_reason": self.first_reason}


def read_keywords(path: str | Path, fmt: str = "auto", *, limit: int | None = None,
                  bad: BadLines | None = None) -> Iterator[tuple[str, str]]:
    """(id, text) pairs in file order; blank lines are skipped.

    fmt: "tsv" (id<TAB>text), "lines" (the line is the text, its number the id), "jsonl"
    ({"id", "text"} per line), "auto" (jsonl by suffix, otherwise TSV where a line has a tab and
    the line number as id where it has none). A bad line raises KeywordFileError, or with `bad`
    is counted there and skipped. `limit` counts keywords read, not lines.
    """
    path = Path(path)
    if fmt not in FORMATS:
        raise KeywordFileError(f"{path}: unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if fmt == "auto":
        fmt = "jsonl" if path.suffix in _JSONL_SUFFIXES else "tsv-or-lines"
    count = 0

    def reject(lineno: int, reason: str) -> None:
        if bad is None:
            raise KeywordFileError(f"{path}:{lineno}: {reason}")
        bad.add(lineno, reason)

    try:
        # Binary, decoded line by line: a line that is not UTF-8 is that line's problem only.
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                if limit is not None and count >= limit:
                    return
                try:
                    line = raw.decode("utf-8").rstrip("\n").removesuffix("\r")
                except UnicodeDecodeError as exc:
                    reject(lineno, f"not UTF-8 ({exc.reason} at byte {exc.start})")
                    continue
                if not line.strip():
                    continue
                if fmt == "jsonl":
                    try:
                        obj = orjson.loads(line)
                        item = str(obj["id"]), str(obj["text"])
                    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
                        reject(lineno, f"expected a JSON object with id and text ({exc})")
                        continue
                elif fmt == "lines":
                    item = str(lineno), line
                else:
                    qid, sep, text = line.partition("\t")
                    if sep:
                        item = qid, text
                    elif fmt == "tsv":
                        reject(lineno, "expected id<TAB>text")
                        continue
                    else:
                        item = str(lineno), line
                count += 1
                yield item
    except OSError as exc:
        raise KeywordFileError(f"{path}: {exc.strerror or exc}") from None
