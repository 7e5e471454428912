"""The timed batching policies, on any backend.

- monolithic: chronological batches of `batch_size` (256), each padded to its longest item
  (the design's baseline);
- sorted: an offline oracle: the whole input sorted by length, batches of `batch_size`
  padded to their longest item;
- bucketed: the worker's own `Bucketer` and dispatch, fed in file order through a bounded
  in-flight window (submit blocks while `window` items are pending: Settings.max_in_flight);
- direct: the overhead guard, the bucketed run's own batches replayed by direct backend calls.

Tokenisation is done before and excluded from every policy; padding (building the batch
arrays, with the one worker.batching.padding.pad_batch) is included in all of them.

Threads and contexts: a backend context is created, used and closed on one thread (TensorRT
needs it: its CUDA context is current only there). The baselines run on the calling thread
with `BaselineContexts`, created and closed within the run; the bucketer's dispatchers own
theirs; each direct-replay thread creates its own. A backend whose context i is bound to
bucket profile i (`max_contexts` set, TensorRT) runs a baseline batch on the context whose
profile covers its length, split into pieces of that profile's max batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from worker.backends.base import Backend, InferenceContext
from worker.batching.bucketer import Bucketer
from worker.batching.cost_model import CostModel
from worker.batching.padding import pad_batch
from worker.benchmark.errors import BenchError
from worker.core.profiles import PadPolicy, Profile
from worker.embedding_cache import EmbeddingCache, key
from worker.intake.tokenize import Encoded
from worker.operations.batch_stats import BatchStats

DEFAULT_WINDOW = 4096  # Settings.max_in_flight's default: what the Kafka worker keeps in flight
DEFAULT_BATCH = 256


# --------------------------------------------------------------------------- results
@dataclass
class PolicyRun:
    """One timed pass of one policy over the whole input."""

    policy: str
    n: int
    seconds: float
    real_tokens: int
    padded_tokens: int
    batches: int
    backend_s: float = 0.0  # time inside backend calls (summed over batches)

    @property
    def keywords_per_s(self) -> float:
        return self.n / self.seconds if self.seconds > 0 else 0.0

    @property
    def padding_waste(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


@dataclass(frozen=True)
class FormedBatch:
    """One batch the bucketer dispatched: its items (indices into the input), bucket and padded length."""

    seqs: list[int]
    bucket: int
    pad_len: int


@dataclass
class BucketedRun(PolicyRun):
    # In dispatch-completion order; the overhead guard replays exactly these.
    formed: list[FormedBatch] = field(default_factory=list)
    stats: list[BatchStats] = field(default_factory=list)
    embeddings: np.ndarray | None = None


@dataclass(frozen=True)
class BucketerOptions:
    """How the bucketed policies run the worker's bucketer (the worker's own settings)."""

    max_queue_delay_ms: float = 20.0
    dispatchers: int = 1
    pad_to: PadPolicy | None = None  # None: the profile's
    eager: bool = True
    # The measured prices: partial batches take neighbouring buckets along (worker/batching/batch_policy.py),
    # as the worker does with merge_buckets on. None: one bucket per batch.
    costs: CostModel | None = None


# --------------------------------------------------------------------------- baselines
class BaselineContexts:
    """The contexts one baseline run needs, created on first use on the calling thread and closed by it."""

    def __init__(self, backend: Backend, profile: Profile) -> None:
        self._backend = backend
        self._profile = profile
        self._contexts: dict[int, InferenceContext] = {}
        self._owner = threading.get_ident()

    def _get(self, index: int) -> InferenceContext:
        ctx = self._contexts.get(index)
        if ctx is None:
            ctx = self._contexts[index] = self._backend.create_context(index)
        return ctx

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> int:
        """Runs the batch; returns the padded tokens the backend computed."""
        if threading.get_ident() != self._owner:
            raise BenchError("baseline contexts used from a thread other than the one that made them")
        if self._backend.max_contexts is None:  # any context runs any shape (ONNX Runtime)
            self._get(0).run(input_ids, attention_mask)
            return int(input_ids.size)
        # Context i runs bucket i's shapes only: the bucket whose bound covers the batch's
        # length, in pieces of at most its max batch; the context pads each piece to the bound.
        index = self._profile.bucket_for(input_ids.shape[1])
        bucket = self._profile.buckets[index]
        ctx = self._get(index)
        for lo in range(0, len(input_ids), bucket.max_batch):
            ctx.run(input_ids[lo:lo + bucket.max_batch], attention_mask[lo:lo + bucket.max_batch])
        return len(input_ids) * bucket.max_len

    def close(self) -> None:
        for ctx in self._contexts.values():
            ctx.close()
        self._contexts.clear()


def _run_batches(backend: Backend, profile: Profile, encoded: Sequence[Encoded], order: Sequence[int],
                 batch_size: int, policy: str) -> PolicyRun:
    """Fixed-size batches over `order`, each padded to its longest item, run back to back."""
    real = padded = batches = 0
    backend_s = 0.0
    contexts = BaselineContexts(backend, profile)
    try:
        start = time.perf_counter()
        for lo in range(0, len(order), batch_size):
            rows = [encoded[i].ids for i in order[lo:lo + batch_size]]
            ids, mask = pad_batch(rows)
            t0 = time.perf_counter()
            padded += contexts.run(ids, mask)
            backend_s += time.perf_counter() - t0
            real += int(mask.sum())
            batches += 1
        seconds = time.perf_counter() - start
    finally:
        contexts.close()
    return PolicyRun(policy, len(order), seconds, real, padded, batches, backend_s)


def run_monolithic(encoded: Sequence[Encoded], backend: Backend, profile: Profile, *,
                   batch_size: int = DEFAULT_BATCH) -> PolicyRun:
    """Chronological batches padded to the batch max: the baseline."""
    return _run_batches(backend, profile, encoded, range(len(encoded)), batch_size, "monolithic")


def run_sorted(encoded: Sequence[Encoded], backend: Backend, profile: Profile, *,
               batch_size: int = DEFAULT_BATCH) -> PolicyRun:
    """Offline oracle: everything sorted by length (stable), batches padded to the batch max."""
    # The sort is part of the policy's cost (it is tiny next to inference).
    start = time.perf_counter()
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
    sort_s = time.perf_counter() - start
    run = _run_batches(backend, profile, encoded, order, batch_size, "sorted")
    run.seconds += sort_s
    return run


# --------------------------------------------------------------------------- the bucketer
class BucketerHarness:
    """The worker's Bucketer with callbacks that record every batch: shared by the bucketed and open-loop runs.

    `on_items(seqs, now)` runs after a batch is recorded, completed or failed (the caller's
    window or arrival bookkeeping). Callbacks run on the dispatcher threads.
    """

    def __init__(self, profile: Profile, backend: Backend, options: BucketerOptions,
                 on_items: Callable[[Sequence[int], float], None], *, out: np.ndarray | None = None,
                 on_rows: Callable[[Sequence[int], np.ndarray], tuple[np.ndarray, list[int]]] | None = None,
                 on_failed: Callable[[Sequence[int]], list[int]] | None = None) -> None:
        self.formed: list[FormedBatch] = []
        self.stats: list[BatchStats] = []
        self.answered_by_cache = 0  # items answered without the model (hits, and joins of a leader)
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._on_items = on_items
        self._out = out
        # A cache in front of the bucketer: on_rows stores a finished batch's rows and names the
        # items (repeats still in flight) its rows also answer; on_failed, the ones a failure strands.
        self._on_rows = on_rows
        self._on_failed = on_failed
        self.bucketer = Bucketer(profile, backend, self._complete, on_error=self._error,
                                 max_queue_delay_ms=options.max_queue_delay_ms, dispatchers=options.dispatchers,
                                 pad_to=options.pad_to, eager=options.eager, costs=options.costs)

    def _complete(self, seqs: Sequence[int], rows: np.ndarray, stats: BatchStats) -> None:
        now = time.perf_counter()
        followers: list[int] = []
        if self._on_rows is not None:
            rows, followers = self._on_rows(seqs, rows)
        if self._out is not None:
            self._out[list(seqs)] = rows
        with self._lock:
            self.formed.append(FormedBatch(list(seqs), stats.bucket, stats.pad_len))
            self.stats.append(stats)
            self.answered_by_cache += len(followers)
        self._on_items(list(seqs) + followers, now)

    def _error(self, seqs: Sequence[int], exc: BaseException) -> None:
        followers = self._on_failed(seqs) if self._on_failed is not None else []
        with self._lock:
            self.errors.append(exc)
        self._on_items(list(seqs) + followers, time.perf_counter())

    def totals(self) -> tuple[int, int, int]:
        """(items, real tokens, padded tokens) of the completed batches."""
        return (sum(s.size for s in self.stats), sum(s.real_tokens for s in self.stats),
                sum(s.padded_tokens for s in self.stats))


def run_bucketed(encoded: Sequence[Encoded], profile: Profile, backend: Backend, *, window: int = DEFAULT_WINDOW,
                 options: BucketerOptions = BucketerOptions(), keep_embeddings: bool = False,
                 policy: str = "bucketed", cache: EmbeddingCache[int] | None = None,
                 coalesce: bool = True) -> BucketedRun:
    """The worker's Bucketer fed in input order through a bounded in-flight window.

    submit() blocks (here, in the feeder) while `window` items are submitted and not yet
    completed, as the Kafka worker pauses its partitions at max_in_flight. The clock runs
    from the first submit until every item is completed and the bucketer's threads are joined.
    Raises BenchError if any item errors or is dropped.

    With a `cache`, it sits in front of the bucketer as in the worker: each item is looked up
    by its token IDs first; a hit is answered at once and never reaches the bucketer, a miss is
    submitted and its vector cached when its batch completes. coalesce=True (the cache's
    lookup/complete/abandon): a repeat of a key still in flight joins it and is answered with the
    leader's vector, holding its window slot until then, as its record would stay uncommitted
    in the worker. coalesce=False (get/put): such a repeat is a miss and computed again.
    `n` counts every item; the batch counters only the items the model ran.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    n = len(encoded)
    room = threading.Semaphore(window)
    out = np.empty((n, backend.dim), dtype=np.float32) if keep_embeddings else None
    keys: list[bytes] = []  # by seq, appended by the feeder before the item is submitted

    def release(seqs: Sequence[int], _now: float) -> None:
        room.release(len(seqs))

    def on_rows(seqs: Sequence[int], rows: np.ndarray) -> tuple[np.ndarray, list[int]]:
        assert cache is not None
        cached, followers = [], []
        for s, row in zip(seqs, rows):
            vec, waiters = cache.complete(keys[s], row) if coalesce else (cache.put(keys[s], row), [])
            cached.append(vec)
            followers += waiters
            if out is not None:
                for w in waiters:
                    out[w] = vec
        return np.stack(cached), followers

    def on_failed(seqs: Sequence[int]) -> list[int]:
        assert cache is not None
        return [w for s in seqs for w in cache.abandon(keys[s])] if coalesce else []

    harness = BucketerHarness(profile, backend, options, release, out=out,
                              on_rows=on_rows if cache is not None else None,
                              on_failed=on_failed if cache is not None else None)
    hits = 0
    harness.bucketer.start()
    start = time.perf_counter()
    try:
        for i, enc in enumerate(encoded):
            # Every item holds a window slot until answered, as its record stays uncommitted in
            # the worker; a hit gives its slot back at once.
            room.acquire()
            if cache is not None:
                k = key(enc.ids)
                keys.append(k)
                if coalesce:
                    found = cache.lookup(k, i)
                    if found.outcome == "joined":
                        continue  # answered, and its slot released, by the leader's completion
                    row = found.row
                else:
                    row = cache.get(k)
                if row is not None:
                    hits += 1
                    if out is not None:
                        out[i] = row
                    room.release()
                    continue
            harness.bucketer.submit(i, enc.ids)
    finally:
        dropped = harness.bucketer.stop(drain=True)
    seconds = time.perf_counter() - start
    if harness.errors:
        raise BenchError(f"bucketed run incomplete: {len(harness.errors)} failed batches "
                         f"(first: {harness.errors[0]!r})")
    if dropped:
        raise BenchError(f"bucketed run dropped {len(dropped)} items")
    done, real, padded = harness.totals()
    if done + hits + harness.answered_by_cache != n:
        raise BenchError(f"bucketed run completed {done + hits + harness.answered_by_cache} of {n} items")
    return BucketedRun(policy, n, seconds, real, padded, len(harness.stats),
                       sum(s.backend_s for s in harness.stats), formed=harness.formed, stats=harness.stats,
                       embeddings=out)


def replay_direct(encoded: Sequence[Encoded], formed: Sequence[FormedBatch], backend: Backend, *,
                  threads: int = 1) -> PolicyRun:
    """Overhead guard: the same batches, pre-padded, run by direct backend calls.

    The same thread layout as the bucketer's dispatchers, without its queues, forming or
    padding: with contexts for any shape, `threads` callers (context k each) take the batches
    in order from a shared index; with context i bound to bucket i, one caller per bucket runs
    that bucket's batches on context i, or, when no two contexts may run at once
    (`requires_serial_dispatch`), one caller runs every batch in order on its bucket's context.
    Every caller creates and closes its own contexts.
    """
    arrays = [pad_batch([encoded[i].ids for i in b.seqs], b.pad_len) for b in formed]
    # caller -> (the contexts it creates, its batches as (context, batch index)); None: shared index
    callers: dict[int, tuple[list[int], list[tuple[int, int]] | None]] = {}
    if backend.max_contexts is None:
        callers = {k: ([k], None) for k in range(threads)}
    elif backend.requires_serial_dispatch:
        used = sorted({b.bucket for b in formed})
        callers = {0: (used, [(b.bucket, i) for i, b in enumerate(formed)])}
    else:
        for i, b in enumerate(formed):
            callers.setdefault(b.bucket, ([b.bucket], []))[1].append((b.bucket, i))  # type: ignore[union-attr]
    next_index = iter(range(len(arrays)))
    lock = threading.Lock()
    failures: list[BaseException] = []
    ready = threading.Barrier(len(callers) + 1)

    def work(ctx_indexes: list[int], mine: list[tuple[int, int]] | None) -> None:
        contexts: dict[int, InferenceContext] = {}
        try:
            for k in ctx_indexes:
                contexts[k] = backend.create_context(k)
        except BaseException as exc:  # surfaced below, after the join
            failures.append(exc)
            for ctx in contexts.values():
                ctx.close()
            ready.wait()
            return
        ready.wait()  # contexts are made before the clock starts, as the bucketer's are
        try:
            if mine is None:
                ctx = contexts[ctx_indexes[0]]
                while True:
                    with lock:
                        i = next(next_index, None)
                    if i is None:
                        return
                    ctx.run(*arrays[i])
            else:
                for k, i in mine:
                    contexts[k].run(*arrays[i])
        except BaseException as exc:
            failures.append(exc)
        finally:
            for ctx in contexts.values():
                ctx.close()

    workers = [threading.Thread(target=work, args=(ctxs, mine), name=f"kwe-bench-direct-{k}")
               for k, (ctxs, mine) in callers.items()]
    for t in workers:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in workers:
        t.join()
    seconds = time.perf_counter() - start
    if failures:
        raise BenchError(f"direct replay failed: {failures[0]!r}")
    n = sum(len(b.seqs) for b in formed)
    real = sum(len(encoded[i].ids) for b in formed for i in b.seqs)
    padded = sum(len(b.seqs) * b.pad_len for b in formed)
    return PolicyRun("direct", n, seconds, real, padded, len(formed), seconds)
