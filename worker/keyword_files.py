"""Keyword files on disk: `id<TAB>text` TSV, one text per line, or JSONL objects with id and text.

One reader for every command that takes a file (produce, embed, bench, demo).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson

FORMATS = ("auto", "tsv", "lines", "jsonl")
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


class KeywordFileError(ValueError):
    """A keyword file cannot be read; the message names the file and, where it applies, the line."""


def read_keywords(path: str | Path, fmt: str = "auto", *, limit: int | None = None) -> Iterator[tuple[str, str]]:
    """(id, text) pairs in file order; blank lines are skipped.

    fmt: "tsv" (id<TAB>text, strict), "lines" (the line is the text, its number the id),
    "jsonl" ({"id", "text"} per line), "auto" (jsonl by suffix, otherwise TSV where a line has
    a tab and the line number as id where it has none).
    """
    path = Path(path)
    if fmt not in FORMATS:
        raise KeywordFileError(f"{path}: unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if fmt == "auto":
        fmt = "jsonl" if path.suffix in _JSONL_SUFFIXES else "tsv-or-lines"
    count = 0
    try:
        with path.open("r", encoding="utf-8", newline="\n") as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and count >= limit:
                    return
                line = line.rstrip("\n").removesuffix("\r")
                if not line.strip():
                    continue
                count += 1
                if fmt == "jsonl":
                    try:
                        obj = orjson.loads(line)
                        yield str(obj["id"]), str(obj["text"])
                    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
                        raise KeywordFileError(
                            f"{path}:{lineno}: expected a JSON object with id and text ({exc})") from None
                elif fmt == "lines":
                    yield str(lineno), line
                else:
                    qid, sep, text = line.partition("\t")
                    if sep:
                        yield qid, text
                    elif fmt == "tsv":
                        raise KeywordFileError(f"{path}:{lineno}: expected id<TAB>text")
                    else:
                        yield str(lineno), line
    except UnicodeDecodeError as exc:
        raise KeywordFileError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise KeywordFileError(f"{path}: {exc.strerror or exc}") from None
