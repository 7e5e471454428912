"""The benchmark's input: the `id<TAB>text` rows of a query file, through the one keyword-file reader."""

from __future__ import annotations

from pathlib import Path

from worker.benchmark.errors import BenchError
from worker.formats.keyword_files import BadLines, KeywordFileError, read_keywords


def read_queries(path: str | Path, limit: int | None = None, *,
                 bad: BadLines | None = None) -> list[tuple[str, str]]:
    """(id, text) rows of an `id<TAB>text` file, in file order; blank lines skipped.

    A bad line (not UTF-8, no tab) is a BenchError, or with `bad` counted there and skipped.
    """
    try:
        rows = list(read_keywords(path, "tsv", limit=limit, bad=bad))
    except KeywordFileError as exc:
        raise BenchError(str(exc)) from None
    if not rows:
        raise BenchError(f"{path}: no queries" + (f" ({bad.summary(path)})" if bad and bad.count else ""))
    return rows
