"""An exact-match embedding cache: token IDs after truncation in, the computed vector out.

Keyword streams repeat (16% of the TREC 2005 efficiency queries repeat an earlier one), and a
repeat costs a full forward pass without a cache. Keys are the token IDs the model actually
sees (after truncation), so two texts that tokenize the same ("Running Shoes", "running shoes")
share one vector, and a text cut at max_len shares it with every text sharing its first
max_len tokens, as the model itself would.

Threads: any number of threads may call get/put/stats concurrently (the Kafka poll thread
looks up, dispatcher or encoder threads insert). One lock guards the map and the counters;
nothing is computed under it but a dict operation and a byte count.

Values: each vector is stored as an immutable `bytes` object and handed out as a numpy view
of it. numpy refuses to make such a view writable (its buffer is read-only), so no caller can
change a cached row, and the row a hit returns is bit for bit the row that was put. A sparse
model's rows (worker/core/sparse.py's SparseRow: the non-zero entries) are kept the same way
through `SparseRowCodec`: int32 indices then float32 values, about 120 bytes for a keyword's 15
entries where its dense row would take 122 kB; `stack` makes a batch of either kind.

In-flight repeats (single flight): a keyword repeated while its first occurrence is still being
embedded would miss and be computed again; with max_in_flight=4096 keywords in flight, that is
most repeats of a short burst (benchmarks/results/cache/cache.md). `lookup(k, waiter)` therefore
answers one of three ways: a hit (the row), a miss (the caller leads: it computes the row and
calls `complete`, or `abandon` if it cannot), or joined (someone leads already; `waiter` is
handed back by the leader's `complete` or `abandon`, to be answered with the same row or
retried). `get`/`put` remain for callers that do not coalesce.

How the Kafka worker uses it (wired in worker/app.py, used by worker/intake/stage.py and worker/output/stage.py):
    cache = EmbeddingCache(settings.cache_bytes, backend.dim, observer=metrics) if settings.cache_bytes else None
    # poll thread, per tokenized record `seq` (already tracked for commit-after-write):
    found = cache.lookup(key(enc.ids), seq)
    "hit"    -> produce found.row now, like any finished record (commit after its ack)
    "joined" -> nothing to submit: the leader's completion answers seq
    "miss"   -> bucketer.submit(seq, enc.ids)
    # on_complete, per (seq, row):  row, waiters = cache.complete(k, row); produce row for seq and
    #     each waiter (also when seq's own partition was revoked: waiters may be on others)
    # on_error / dropped by stop(): waiters = cache.abandon(k); dead-letter or redo them with seq

Eviction: least recently used (a hit refreshes an entry), until the accounted bytes fit
`max_bytes`. The accounted size of an entry is what it really holds: the key and value objects
(sys.getsizeof) plus the map's own per-entry cost; tests/unit/worker/test_embedding_cache.py checks the account
against tracemalloc.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, NamedTuple, Protocol, TypeVar

import numpy as np

from worker.core.errors import KeywordEmbedderError
from worker.core.sparse import SparseRow, SparseRowCodec, SparseRows

# An OrderedDict entry costs its hash-table slot (amortised over the table's doubling) plus a
# linked-list node; measured with tracemalloc at 75 bytes on CPython 3.11, rounded up so the
# account errs towards using less memory than max_bytes, not more.
ENTRY_OVERHEAD = 104

_KEY_DTYPE = np.dtype("<i8")
_MAX_ID = np.iinfo(np.int64).max


class CacheError(KeywordEmbedderError, ValueError):
    """A key or vector the cache cannot take; the message says which and why."""


def key(ids: np.ndarray) -> bytes:
    """The cache key of one item: its token IDs (after truncation) as int64 bytes.

    The tokenizer's own int64 array is used as it is (no conversion, no scan: this runs once per
    keyword on the poll thread); other integer arrays are widened to int64, so equal IDs give
    equal keys whatever their dtype.
    """
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise CacheError(f"cache key: expected a 1-D integer array of token ids, got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)} {getattr(ids, 'shape', '')}")
    if ids.dtype != _KEY_DTYPE:
        if ids.dtype.kind == "u" and ids.size and int(ids.max()) > _MAX_ID:
            raise CacheError(f"cache key: token id {int(ids.max())} does not fit int64")
        ids = ids.astype(_KEY_DTYPE)
    return ids.tobytes()


class CacheObserver(Protocol):
    """Where the cache's counters go (worker.operations.metrics.Metrics): it reads `stats` when scraped, so
    lookups and stores pay for no metric update."""

    def watch_cache(self, stats: Callable[[], CacheStats]) -> None: ...


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int
    entries: int
    nbytes: int
    max_bytes: int
    joined: int = 0  # lookups that joined an in-flight computation of the same key

    @property
    def lookups(self) -> int:
        return self.hits + self.misses + self.joined

    @property
    def hit_rate(self) -> float:
        """Share of lookups the model did not run for: hits and joins."""
        return (self.hits + self.joined) / self.lookups if self.lookups else 0.0

    def line(self) -> str:
        """One line for a report: `1,234 hits of 10,000 lookups (12.3%), ...`."""
        return hit_rate_line(self.hits, self.misses, self.evictions, self.entries, self.nbytes, self.joined)


def hit_rate_line(hits: float, misses: float, evictions: float, entries: float | None = None,
                  nbytes: float | None = None, joined: float = 0) -> str:
    """The cache's hit-rate line, from counters (the demo reads them off /metrics)."""
    lookups = hits + misses + joined
    rate = (hits + joined) / lookups if lookups else 0.0
    text = (f"{hits:,.0f} hits" + (f" + {joined:,.0f} joined in flight" if joined else "")
            + f" of {lookups:,.0f} lookups ({rate:.1%}), {evictions:,.0f} evicted")
    if entries is not None and nbytes is not None:
        text += f", {entries:,.0f} vectors in {nbytes / 1e6:,.1f} MB"
    return text


W = TypeVar("W")
Row = np.ndarray | SparseRow


class DenseRowCodec:
    """How the cache keeps a dense row: its float32 bytes, handed back as a read-only view."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def to_bytes(self, row: np.ndarray) -> bytes:
        if not isinstance(row, np.ndarray) or row.shape != (self.dim,) or row.dtype != np.float32:
            raise CacheError(f"cache: expected a float32 row of shape ({self.dim},), got "
                             f"{getattr(row, 'dtype', type(row).__name__)} {getattr(row, 'shape', '')}")
        return row.tobytes()

    def from_bytes(self, value: bytes) -> np.ndarray:
        return np.frombuffer(value, dtype=np.float32)

    def stack(self, rows: list[np.ndarray]) -> np.ndarray:
        return np.stack(rows)


class _SparseCodec(SparseRowCodec):
    def to_bytes(self, row: SparseRow) -> bytes:  # type: ignore[override]
        try:
            return super().to_bytes(row)
        except ValueError as exc:
            raise CacheError(f"cache: {exc}") from None


class Lookup(NamedTuple):
    """What `EmbeddingCache.lookup` found: "hit" (row set), "miss" (the caller leads) or "joined".

    A NamedTuple, not a dataclass: one is built per keyword, and a tuple costs a fraction.
    """

    outcome: Literal["hit", "miss", "joined"]
    row: np.ndarray | SparseRow | None = None


class EmbeddingCache(Generic[W]):
    """Thread-safe, byte-bounded LRU map from `key(ids)` to one float32 vector of `dim` values (with
    `sparse`, to a SparseRow: the non-zero entries of a `dim`-entry vocabulary).

    API the pipeline uses: `get(k) -> np.ndarray | None` (read-only row, counts a hit or a
    miss) and `put(k, row) -> np.ndarray` (stores a copy, returns the cached read-only row,
    evicts the least recently used entries until the bound holds). `max_bytes=0` makes a
    cache that stores nothing and misses every time; callers can instead skip it (`enabled`).
    """

    def __init__(self, max_bytes: int, dim: int, *, observer: CacheObserver | None = None,
                 sparse: bool = False) -> None:
        if max_bytes < 0:
            raise CacheError(f"cache: max_bytes must be >= 0, got {max_bytes}")
        if dim < 1:
            raise CacheError(f"cache: dim must be >= 1, got {dim}")
        self.max_bytes = max_bytes
        self.dim = dim
        # Rows of a sparse model (SparseRow, the vocabulary's non-zero weights) or dense float32 [dim].
        self._rows: DenseRowCodec | _SparseCodec = _SparseCodec(dim) if sparse else DenseRowCodec(dim)
        self._lock = threading.Lock()
        self._map: OrderedDict[bytes, bytes] = OrderedDict()
        self._nbytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._joined = 0
        # key -> waiters of an in-flight computation (its leader is not listed)
        self._flight: dict[bytes, list[W]] = {}
        if observer is not None:
            observer.watch_cache(self.stats)  # read at scrape time

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @staticmethod
    def entry_bytes(k: bytes, value: bytes) -> int:
        """What one entry really occupies: key and value objects plus the map's per-entry cost."""
        return sys.getsizeof(k) + sys.getsizeof(value) + ENTRY_OVERHEAD

    def stack(self, rows: list[Row]) -> np.ndarray | SparseRows:
        """A batch of rows as the output stage takes them: [n, dim] float32, or SparseRows."""
        return self._rows.stack(rows)  # type: ignore[arg-type]

    def get(self, k: bytes) -> Row | None:
        """The cached row for key k (read-only float32 [dim], or a SparseRow of read-only arrays), or
        None; counts a hit or a miss."""
        with self._lock:
            value = self._map.get(k)
            if value is None:
                self._misses += 1
            else:
                self._map.move_to_end(k)
                self._hits += 1
        return None if value is None else self._rows.from_bytes(value)

    def lookup(self, k: bytes, waiter: W) -> Lookup:
        """A hit, a miss (the caller now leads k: `complete` or `abandon` it) or a join of the
        in-flight computation of k (`waiter` comes back from the leader's complete/abandon)."""
        with self._lock:
            value = self._map.get(k)
            if value is not None:
                self._map.move_to_end(k)
                self._hits += 1
                outcome = "hit"
            elif k in self._flight:
                self._flight[k].append(waiter)
                self._joined += 1
                outcome = "joined"
            else:
                self._flight[k] = []
                self._misses += 1
                outcome = "miss"
        return Lookup(outcome, None if value is None else self._rows.from_bytes(value))

    def complete(self, k: bytes, row: Row) -> tuple[Row, list[W]]:
        """The leader of k has its row: store it; returns the cached row and k's waiters to answer."""
        return self._store(k, row, release=True)

    def abandon(self, k: bytes) -> list[W]:
        """The leader of k could not compute it (failed batch, dropped on revoke or shutdown): k is
        no longer in flight; returns its waiters, which the caller retries or fails."""
        with self._lock:
            return self._flight.pop(k, [])

    def in_flight(self) -> int:
        """Keys being computed by a leader (for tests and shutdown checks)."""
        with self._lock:
            return len(self._flight)

    def put(self, k: bytes, row: Row) -> Row:
        """Store a copy of row under k; returns the cached read-only row.

        A key already present keeps its first vector (the one every earlier hit returned),
        so hits stay bit-identical even if a repeat computed in the same moment came out
        different in the last bit (another batch shape). A row bigger than max_bytes on its
        own is not stored.
        """
        return self._store(k, row, release=False)[0]

    def _store(self, k: bytes, row: Row, *, release: bool) -> tuple[Row, list[W]]:
        if type(k) is not bytes:
            raise CacheError(f"cache: key must be bytes (from worker.embedding_cache.key), got {type(k).__name__}")
        value = self._rows.to_bytes(row)  # type: ignore[arg-type]
        size = sys.getsizeof(k) + sys.getsizeof(value) + ENTRY_OVERHEAD
        evicted = 0
        with self._lock:
            existing = self._map.get(k)
            if existing is not None:
                self._map.move_to_end(k)
                value = existing
            elif size <= self.max_bytes:
                self._map[k] = value
                self._nbytes += size
                while self._nbytes > self.max_bytes:
                    old_k, old_v = self._map.popitem(last=False)
                    self._nbytes -= self.entry_bytes(old_k, old_v)
                    evicted += 1
                self._evictions += evicted
            waiters = self._flight.pop(k, []) if release else []
        return self._rows.from_bytes(value), waiters

    def __len__(self) -> int:
        with self._lock:
            return len(self._map)

    def __contains__(self, k: object) -> bool:
        # No hit or miss counted, and no recency change: for tests and assertions.
        with self._lock:
            return k in self._map

    def keys_lru_first(self) -> list[bytes]:
        """Keys from least to most recently used (the eviction order)."""
        with self._lock:
            return list(self._map)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, self._evictions, len(self._map), self._nbytes,
                              self.max_bytes, self._joined)

    def clear(self) -> None:
        with self._lock:
            self._map.clear()
            self._nbytes = 0
