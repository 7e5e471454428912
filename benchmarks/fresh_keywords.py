"""A pool of distinct keywords, each handed out once per run, so that no benchmark level is answered by the cache.

Every real-traffic benchmark that offers load at several levels needs keywords the worker has not
seen before in the run: a repeated keyword is a cache hit (issue 19 found a latency table that
measured the cache). `FreshKeywords` reads one or more query files, drops repeated texts
(case and spacing folded, as a user would count them), shuffles them with a seed and hands out
disjoint slices. It refuses to hand out more than it has rather than recycle, unless told that every
worker runs with its cache off (`recycle=True`: a used-up pool starts again, reshuffled).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

from worker.core.errors import KeywordEmbedderError
from worker.formats.keyword_files import BadLines, read_keywords

ROOT = Path(__file__).resolve().parents[1]
SHARED_QUERIES = ROOT.parent / "shared" / "data" / "queries"
# Shipped with the repo (tests/data/queries/SOURCE.md, deploy/local/sample/SOURCE.md): what a fresh
# clone without ../shared has.
SHIPPED = (ROOT / "tests" / "data" / "queries" / "terabyte05-20k.tsv", ROOT / "deploy" / "local" / "sample" / "keywords.tsv")


def default_sources() -> list[Path]:
    shared = sorted(SHARED_QUERIES.glob("*.tsv")) if SHARED_QUERIES.is_dir() else []
    return shared or [p for p in SHIPPED if p.is_file()]


class PoolExhaustedError(KeywordEmbedderError, RuntimeError):
    """More fresh keywords were asked for than the sources hold."""


class FreshKeywords:
    def __init__(self, sources: Iterable[Path], *, seed: int = 0, recycle: bool = False) -> None:
        self.sources = [Path(p) for p in sources]
        seen: set[str] = set()
        rows: list[tuple[str, str]] = []
        for path in self.sources:
            for qid, text in read_keywords(path, bad=BadLines()):
                norm = " ".join(text.lower().split())
                if norm and norm not in seen:
                    seen.add(norm)
                    rows.append((f"{path.stem}-{qid}", text))
        self._random = random.Random(seed)
        self._random.shuffle(rows)
        self._rows = rows
        self._next = 0
        # Only for workers whose cache is off: a used-up pool starts again, reshuffled.
        self.recycle = recycle
        self.recycled = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def left(self) -> int:
        return len(self._rows) - self._next

    def take(self, n: int) -> list[tuple[str, str]]:
        if n > self.left and self.recycle and n <= len(self._rows):
            self._random.shuffle(self._rows)
            self._next = 0
            self.recycled += 1
        if n > self.left:
            raise PoolExhaustedError(f"asked for {n} fresh keywords but only {self.left} of {len(self)} are left "
                                     f"(sources: {', '.join(p.name for p in self.sources)}); offer fewer "
                                     "(shorter --duration, fewer --rounds or levels, a smaller --backlog)")
        out = self._rows[self._next:self._next + n]
        self._next += n
        return out
