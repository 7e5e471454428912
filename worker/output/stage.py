"""The output stage: finished batches become output records, failed items dead letters.

Threads:
- dispatcher threads call `on_batch` / `on_batch_error` and return at once: they only queue,
  so the backend never waits for encoding or producing.
- the output thread ("kwe-output") owns the queue's other end: it encodes embeddings and
  hands records to the writer (the producer, or exactly-once's wrapper of it, which also wraps
  each batch in its write gate through `around_batch`; at-least-once takes no gate).
The queue holds at most what flow control let in (max_in_flight keywords), so it needs no
bound of its own. A sparse model's [B, V] rows (122 kB a keyword for a 30,522-entry vocabulary)
are cut to their non-zero entries (`sparsify`) on the dispatcher thread, before they are queued:
what waits here is then as small as it will be written (about 120 bytes a keyword), and the
output thread, the busier one, does not pay for the scan.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from worker.backends.base import PartialBatchError
from worker.deadline import Deadline
from worker.ledger.acks import Acknowledger
from worker.ledger.base import AroundBatch
from worker.ledger.inflight import InFlight, InFlightTable
from worker.embedding_cache import EmbeddingCache
from worker.errors import BackendBrokenError, WorkerError
from worker.formats.messages import Rejection, ValueEncoder
from worker.formats.propagation import Propagation, find_traceparent
from worker.kafka.producer import RecordWriter
from worker.latch import FatalLatch, guarded
from worker.operations.batch_stats import BatchStats
from worker.operations.metrics import Metrics
from worker.output.dead_letters import DeadLetters
from worker.output.tracing import BatchSpans, epoch_ns

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class _Finished:
    seqs: Sequence[int]
    rows: Any  # [n, dim] float32, or a sparse model's SparseRows (indexed the same way)
    stats: BatchStats | None
    cached: bool = field(default=False, kw_only=True)  # answered by the embedding cache, not computed
    # time.monotonic() when the batch was queued here (0: unknown, not observed)
    t_done: float = field(default=0.0, kw_only=True)


@dataclass(frozen=True, slots=True)
class _Failed:
    seqs: Sequence[int]
    error: BaseException


Item = _Finished | _Failed


class OutputStage:
    def __init__(self, topic: str, codec: ValueEncoder, writer: RecordWriter, inflight: InFlightTable,
                 acks: Acknowledger, dead_letters: DeadLetters, metrics: Metrics, latch: FatalLatch, *,
                 cache: EmbeddingCache[int] | None = None, propagation: Propagation | None = None,
                 spans: BatchSpans | None = None, around_batch: AroundBatch | None = None,
                 sparsify: Callable[[np.ndarray], Any] | None = None) -> None:
        self._topic = topic
        # A sparse model's [B, V] weights to their non-zero entries (top-k, minimum weight), run on
        # the dispatcher thread that finished the batch; None: dense rows go on as they are.
        self._sparsify = sparsify
        self._spans = spans  # one OpenTelemetry span per batch; None: no export
        self._trace_failed = False  # a span failed once (logged once; output thread only)
        # pass_headers / trace context; None when both are off (no per-record header work).
        self._propagation = propagation if propagation is not None and propagation.active else None
        self._cache = cache
        self._codec = codec
        self._writer = writer
        self._handle = self._handle_item if around_batch is None else around_batch(self._handle_item)
        self._inflight = inflight
        self._acks = acks
        self._dead_letters = dead_letters
        self._metrics = metrics
        self._latch = latch
        self._queue: queue.SimpleQueue[_Finished | _Failed | None] = queue.SimpleQueue()
        self.dropped = 0  # finished after their partition was revoked (output thread only)
        self._thread = threading.Thread(target=guarded(latch, "kwe-output", self._loop), name="kwe-output")

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def topic(self) -> str:
        return self._topic

    @property
    def dead_letter_topic(self) -> str:
        return self._dead_letters.topic

    def start(self) -> None:
        self._thread.start()

    def stop(self, deadline: Deadline) -> None:
        """Produces everything queued so far, then ends the thread (no batch may follow)."""
        self._queue.put(None)
        while self._thread.is_alive() and not deadline.expired():
            self._thread.join(min(0.05, deadline.left()))
        if self._thread.is_alive():
            log.warning("output thread did not finish in time")

    # ------------------------------------------------------------------ dispatcher threads
    def on_batch(self, seqs: Sequence[int], rows: np.ndarray, stats: BatchStats) -> None:
        if self._sparsify is not None:
            rows = self._sparsify(rows)
        self._queue.put(_Finished(seqs, rows, stats, t_done=time.monotonic()))

    def on_cached(self, seqs: Sequence[int], rows: Any) -> None:
        """Poll thread: records answered by the embedding cache (no batch, nothing to cache)."""
        self._queue.put(_Finished(seqs, rows, None, cached=True))

    def on_batch_error(self, seqs: Sequence[int], exc: BaseException) -> None:
        if isinstance(exc, PartialBatchError):
            failed = set(exc.failed)
            good = [i for i in range(len(seqs)) if i not in failed]
            if good:
                rows = exc.rows[good]
                self._queue.put(_Finished([seqs[i] for i in good],
                                          rows if self._sparsify is None else self._sparsify(rows), None))
            self._queue.put(_Failed([seqs[i] for i in sorted(failed)], exc.cause))
        elif isinstance(exc, WorkerError):
            self._latch.trip(exc)
        else:
            # Not isolated (the backend was not wrapped): nothing tells poison from a broken
            # backend, so stop rather than dead-letter good keywords.
            self._latch.trip(BackendBrokenError(f"inference failed for a batch of {len(seqs)}: {exc!r}"))

    # ------------------------------------------------------------------ output thread
    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._latch.is_set():
                continue  # stopping on an error: nothing more is produced, so nothing past it commits
            self._handle(item)

    def _handle_item(self, item: Item) -> None:
        if isinstance(item, _Finished):
            self._emit(item)
        else:
            self._fail(item)

    def _emit(self, item: _Finished) -> None:
        t0 = time.monotonic()
        if item.t_done:
            self._metrics.observe_hop("output_queue", t0 - item.t_done)
        if item.stats is not None:
            self._metrics.observe_batch(item.stats)
        live, dropped = self._inflight.take_live(item.seqs)
        self.dropped += dropped
        headers = self._codec.headers
        values = self._codec.values([rec.qid for _, rec in live], self._rows(item, live),
                                    [rec.tokens for _, rec in live], [rec.truncated for _, rec in live])
        t1 = time.monotonic()
        self._metrics.observe_hop("encode", t1 - t0)
        propagation = self._propagation
        # A record at a time: a compiled loop over the batch's produce calls gained nothing resolvable
        # through the broker (1.028, 0.985-1.088: docs/performance.md) and is gone. An interrupt()
        # from another thread lands between two records (the producer's produce() returns False).
        write, topic, embedded, now = self._writer.write, self._topic, self._acks.embedded, time.monotonic
        for (seq, rec), value in zip(live, values):
            rec.msg = None  # produced from here on: the input bytes are no longer needed
            rec.t_produced = now()
            out_headers = (headers if propagation is None or not rec.headers.headers
                           else propagation.output_headers(headers, rec.headers))
            if not write(seq, topic, rec.qid.encode("utf-8"), value, out_headers, embedded(seq)):
                return
        t2 = time.monotonic()
        self._metrics.observe_hop("produce_call", t2 - t1)
        if self._spans is not None and live:
            try:
                self._trace(item, live, t2)
            except Exception as exc:  # noqa: BLE001 - tracing is an observer: it never stops the stream
                if not self._trace_failed:
                    log.warning("batch span not recorded; tracing goes on without it", error=repr(exc))
                self._trace_failed = True

    def _trace(self, item: _Finished, live: list[tuple[int, InFlight]], end: float) -> None:
        """The batch's span: from its oldest keyword's submit (or its queueing here, for cache hits)
        to the last produce call, linked to each keyword's trace context."""
        assert self._spans is not None
        parents = [tp for _, rec in live if (tp := find_traceparent(rec.headers)) is not None]
        stats = item.stats
        start = item.t_done or end
        attributes: dict[str, object] = {}
        if stats is not None and item.t_done:
            start = item.t_done - stats.backend_s - max(stats.queue_wait_s, default=0.0)
            attributes = {"kwe.batch.bucket": stats.bound, "kwe.batch.pad_len": stats.pad_len,
                          "kwe.batch.backend_s": stats.backend_s}
        self._spans.record(parents, size=len(live), start_ns=epoch_ns(start), end_ns=epoch_ns(end),
                           cached=item.cached, attributes=attributes)

    def _rows(self, item: _Finished, live: list[tuple[int, InFlight]]) -> Any:
        """The live records' rows of the batch, in `live`'s order (take_live keeps the batch's)."""
        if len(live) == len(item.seqs):
            rows = item.rows
            positions: Sequence[int] = range(len(live))
        else:
            index = {seq: i for i, seq in enumerate(item.seqs)}
            positions = [index[seq] for seq, _ in live]
            rows = item.rows[positions]
        if self._cache is None or item.cached:
            return rows
        # Stored as computed; a repeat gets these exact bits (the first stored row wins).
        cache = self._cache
        return cache.stack([cache.put(rec.cache_key, item.rows[i]) if rec.cache_key is not None else item.rows[i]
                            for i, (_, rec) in zip(positions, live)]) if live else rows

    def _fail(self, item: _Failed) -> None:
        live, dropped = self._inflight.take_live(item.seqs)
        self.dropped += dropped
        for seq, rec in live:
            log.warning("an item fails inference on its own; dead-lettering it", qid=rec.qid,
                        error=repr(item.error))
            if rec.msg is None or not self._dead_letters.send(
                    seq, rec.msg, rec.headers, Rejection("inference_error", f"the backend failed on this item: {item.error!r}")):
                return
