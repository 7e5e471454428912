"""The worker: Kafka consumer -> tokenizer -> bucketer -> backend contexts -> producer.

Threads and what each one owns:
- the poll thread (the caller of `Pipeline.run`): the Consumer. It consumes, decodes,
  validates, tokenizes and submits to the bucketer; it pauses/resumes partitions for
  backpressure, commits finished offsets, and runs the rebalance callbacks.
- the bucketer's former and dispatcher threads: bucket state, and one backend context
  per dispatcher. A finished batch is queued to the output thread at once, so the
  backend never waits for encoding.
- the output thread: encodes embeddings and hands them to the Producer (produce() is
  thread-safe in librdkafka).
- the delivery thread (`DeliveryLoop`): the only caller of Producer.poll, so every
  delivery callback runs there; it marks offsets done once the broker acknowledged.
- the metrics server thread, when enabled.
Shared state is the in-flight table (one lock) and the per-partition offset trackers
(one lock each).

Delivery: at-least-once. An input offset is committed only after its output (or its
dead-letter record) is acknowledged, and never past a partition's lowest unfinished
offset. Keywords consumed but not yet committed are bounded by max_in_flight (plus one
consume batch), which bounds the duplicates a crash can cause.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from worker.config import Settings
from worker.kafka.consumer import consumer_config
from worker.kafka.errors import FailurePolicy
from worker.kafka.messages import Keyword, OutputCodec, Rejection, dead_letter, decode_input
from worker.kafka.offsets import OffsetTracker, PartitionOffsets
from worker.kafka.producer import DeliveryLoop, producer_config

log = structlog.get_logger(__name__)

CONSUME_BATCH = 500
# Deliveries that failed for good (after librdkafka's own retries) are produced again this
# many times before the worker gives up and stops without committing them.
MAX_REPRODUCE = 3
# A backend failing this many batches in a row is broken, not fed bad input: stop the
# worker (nothing unfinished is committed) instead of dead-lettering the whole stream.
MAX_CONSECUTIVE_BACKEND_FAILURES = 3


class WorkerError(RuntimeError):
    """The worker cannot go on (fatal Kafka error, broken backend); the message says why."""


@dataclass(slots=True)
class InFlight:
    part: PartitionOffsets
    offset: int
    qid: str
    tokens: int
    truncated: bool
    timestamp_ms: int | None
    msg: Message | None  # kept for dead-lettering after an inference error


class _ThrottledErrors:
    """Transient client errors (a broker down, a reconnect loop) come many times a second:
    log each kind once per interval, with how many were suppressed since."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self._interval = interval_s
        self._lock = threading.Lock()
        self._last: dict[tuple[str, int], tuple[float, int]] = {}

    def warn(self, event: str, err: KafkaError) -> None:
        key, now = (event, err.code()), time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(key, (float("-inf"), 0))
            if now - last < self._interval:
                self._last[key] = (last, suppressed + 1)
                return
            self._last[key] = (now, 0)
        log.warning(event, error=str(err), suppressed_since_last=suppressed)


class _Owned:
    """`(topic, partition) in owned`: whether the partition is in the current assignment."""

    def __init__(self, tracker: OffsetTracker) -> None:
        self._tracker = tracker

    def __contains__(self, key: object) -> bool:
        topic, partition = key  # type: ignore[misc]
        return self._tracker.get(topic, partition) is not None


class Pipeline:
    def __init__(self, settings: Settings, *, tokenizer: Any, backend: Any, profile: Any, model_name: str,
                 metrics: Any = None, bucketer_factory: Any = None) -> None:
        from worker.bucketing import Bucketer

        self.settings = settings
        self._tokenizer = tokenizer
        self._backend = backend
        self._metrics = metrics
        self._codec = OutputCodec(model=model_name, dim=backend.dim, encoding=settings.output_encoding)  # type: ignore[arg-type]
        self._tracker = OffsetTracker()
        self._inflight: dict[int, InFlight] = {}
        self._inflight_lock = threading.Lock()
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._fatal: BaseException | None = None
        self._paused = False
        self._producer_ok = True
        self._backend_failures = 0
        self._client_errors = _ThrottledErrors()
        # Auth/TLS/ACL errors that librdkafka would retry forever stop the worker (worker/kafka/errors.py).
        self._failures = FailurePolicy()
        self._last_commit = 0.0
        self.counts = {"consumed": 0, "produced": 0, "dead_lettered": 0, "dropped": 0}
        self._counts_lock = threading.Lock()

        self._producer = Producer(producer_config(settings, error_cb=self._on_producer_error))
        self._consumer = Consumer(consumer_config(
            settings, error_cb=self._on_consumer_error, on_commit=self._on_commit, stats_cb=self._on_stats))
        self._delivery = DeliveryLoop(self._producer)
        # Finished batches wait here for the output thread (unbounded, but never more than
        # max_in_flight keywords, which bound everything consumed).
        self._outbox: queue.SimpleQueue[tuple[Sequence[int], np.ndarray, Any] | None] = queue.SimpleQueue()
        self._output = threading.Thread(target=self._output_loop, name="kwe-output")
        factory = bucketer_factory or Bucketer
        self._bucketer = factory(
            profile, backend, self._on_batch, on_error=self._on_batch_error,
            max_queue_delay_ms=settings.max_queue_delay_ms, dispatchers=settings.dispatchers,
            pad_to=settings.pad_to)

    # ------------------------------------------------------------------ state for probes
    def ready(self) -> tuple[bool, dict[str, bool]]:
        checks = {"assigned": bool(self._tracker.partitions()), "backend_loaded": self._backend is not None,
                  "producer_healthy": self._producer_ok and self._fatal is None}
        return all(checks.values()), checks

    def in_flight(self) -> int:
        with self._inflight_lock:
            return len(self._inflight)

    def uncommitted(self) -> int:
        return sum(p.uncommitted() for p in self._tracker.partitions())

    def request_stop(self) -> None:
        """First signal: drain in-flight work, commit, leave the group."""
        if self._stop.is_set():
            self._abort.set()
            log.warning("second stop request: aborting without draining")
        self._stop.set()

    def _count(self, key: str, n: int = 1) -> None:
        with self._counts_lock:
            self.counts[key] += n

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        """Runs until stopped; returns the process exit code."""
        s = self.settings
        self._bucketer.start()
        self._output.start()
        self._delivery.start()
        self._consumer.subscribe([s.input_topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_lost)
        log.info("worker started", group=s.group_id, input_topic=s.input_topic, output_topic=s.output_topic,
                 dead_letter_topic=s.dead_letter_topic, max_in_flight=s.max_in_flight)
        try:
            while not self._stop.is_set() and self._fatal is None:
                self._poll_once()
            if self._fatal is None and not self._abort.is_set():
                self._drain()
        finally:
            self._shutdown()
        if self._fatal is not None:
            log.error("worker stopped on a fatal error", error=str(self._fatal))
            return 1
        return 130 if self._abort.is_set() else 0

    def _poll_once(self) -> None:
        pending = self.uncommitted()
        self._apply_backpressure(pending)
        room = CONSUME_BATCH if not self._paused else 1
        room = max(1, min(room, self.settings.max_in_flight - pending))
        msgs = self._consumer.consume(num_messages=room, timeout=0.05)
        if msgs:
            self._handle(msgs)
        self._maybe_commit()

    def _apply_backpressure(self, pending: int) -> None:
        limit = self.settings.max_in_flight
        if not self._paused and pending >= limit:
            self._set_paused(True, pending)
        elif self._paused and pending <= limit * 3 // 4:
            # Resume well before the bound drains: the fetch that refills the buckets takes a
            # round trip, and the backend must not run dry meanwhile.
            self._set_paused(False, pending)
        if self._metrics is not None:
            self._metrics.set_in_flight(pending)

    def _set_paused(self, paused: bool, pending: int) -> None:
        assignment = self._consumer.assignment()
        if assignment:
            (self._consumer.pause if paused else self._consumer.resume)(assignment)
        self._paused = paused
        log.info("partitions paused" if paused else "partitions resumed", partitions=len(assignment),
                 uncommitted=pending)
        if self._metrics is not None:
            self._metrics.set_paused_partitions(len(assignment) if paused else 0)

    # ------------------------------------------------------------------ intake
    def _handle(self, msgs: Sequence[Message]) -> None:
        s = self.settings
        good: list[tuple[int, Keyword, PartitionOffsets, Message, int | None]] = []
        consumed = 0
        for msg in msgs:
            err = msg.error()
            if err is not None:
                reason = self._failures.decide(err, topic=msg.topic(), op="read", group=s.group_id)
                if reason is not None:
                    self._fail(reason)
                    return
                if err.code() != KafkaError._PARTITION_EOF:
                    self._client_errors.warn("consume error", err)
                continue
            part = self._tracker.get(msg.topic(), msg.partition())
            if part is None:
                # Delivered for a partition no longer ours (revoked between fetch and here).
                continue
            offset = msg.offset()
            try:
                part.track(offset)
            except ValueError as exc:
                # Re-fetched after an offset reset: already in flight or done here.
                log.warning("skipping a re-fetched message", error=str(exc))
                continue
            consumed += 1
            decoded = decode_input(msg.key(), msg.value(), fmt=s.input_format,  # type: ignore[arg-type]
                                   max_bytes=s.max_message_bytes)
            seq = next(self._seq)
            ts_type, ts = msg.timestamp()
            if isinstance(decoded, Rejection):
                with self._inflight_lock:
                    self._inflight[seq] = InFlight(part, offset, "", 0, False, ts if ts_type else None, None)
                self._dead_letter(seq, msg, decoded)
            else:
                good.append((seq, decoded, part, msg, ts if ts_type else None))
        self._count("consumed", consumed)
        if self._metrics is not None:
            self._metrics.count_consumed(consumed)
        if not good:
            return
        encoded = self._tokenizer.encode([kw.text for _, kw, _, _, _ in good])
        with self._inflight_lock:
            for (seq, kw, part, msg, ts), enc in zip(good, encoded):
                self._inflight[seq] = InFlight(part, msg.offset(), kw.id, enc.length, enc.truncated, ts, msg)
        for (seq, _, _, _, _), enc in zip(good, encoded):
            self._bucketer.submit(seq, enc.ids)

    def _dead_letter(self, seq: int, msg: Message, rejection: Rejection) -> None:
        ts_type, ts = msg.timestamp()
        value, headers = dead_letter(rejection, topic=msg.topic(), partition=msg.partition(), offset=msg.offset(),
                                     timestamp_ms=ts if ts_type else None, key=msg.key(), value=msg.value(),
                                     headers=msg.headers())
        log.debug("dead-lettering", reason=rejection.reason, topic=msg.topic(), partition=msg.partition(),
                  offset=msg.offset())
        if self._metrics is not None:
            self._metrics.count_dead_lettered(rejection.reason)
        self._count("dead_lettered")
        self._produce(self.settings.dead_letter_topic, msg.key(), value, headers, seq)

    # ------------------------------------------------------------------ output
    def _on_batch(self, seqs: Sequence[int], rows: np.ndarray, stats: Any) -> None:
        """Dispatcher thread: hand the finished batch over and go back to the backend at once."""
        self._backend_failures = 0
        self._outbox.put((seqs, rows, stats))

    def _output_loop(self) -> None:
        """Output thread: encodes finished batches and produces them, off the dispatchers' path."""
        while True:
            item = self._outbox.get()
            if item is None:
                return
            try:
                self._emit(*item)
            except Exception as exc:  # noqa: BLE001 - a bug here must stop the worker, not hang it
                self._fatal = WorkerError(f"output thread failed: {exc!r}")
                self._stop.set()
                return

    def _emit(self, seqs: Sequence[int], rows: np.ndarray, stats: Any) -> None:
        if self._metrics is not None:
            self._metrics.observe_batch(stats)
        out_topic = self.settings.output_topic
        headers = self._codec.headers
        live: list[tuple[int, InFlight, np.ndarray]] = []
        dropped = 0
        with self._inflight_lock:
            for seq, row in zip(seqs, rows):
                rec = self._inflight.get(seq)
                if rec is None:
                    continue
                if rec.part.revoked:
                    # The partition moved on to another member, which redoes this keyword.
                    del self._inflight[seq]
                    dropped += 1
                    continue
                rec.msg = None
                live.append((seq, rec, row))
        if dropped:
            self._count("dropped", dropped)
        for seq, rec, row in live:
            value = self._codec.value(rec.qid, row, rec.tokens, rec.truncated)
            self._produce(out_topic, rec.qid.encode("utf-8"), value, headers, seq)

    def _on_batch_error(self, seqs: Sequence[int], exc: BaseException) -> None:
        self._backend_failures += 1
        log.error("inference failed for a batch", size=len(seqs), error=repr(exc),
                  consecutive=self._backend_failures)
        if self._backend_failures >= MAX_CONSECUTIVE_BACKEND_FAILURES:
            self._fatal = WorkerError(f"the backend failed {self._backend_failures} batches in a row; last: {exc!r}")
            self._stop.set()
            return
        for seq in seqs:
            with self._inflight_lock:
                rec = self._inflight.get(seq)
            if rec is not None and rec.msg is not None and not rec.part.revoked:
                self._dead_letter(seq, rec.msg, Rejection("inference_error", f"the backend failed: {exc!r}"))

    def _produce(self, topic: str, key: bytes | None, value: bytes, headers: Any, seq: int, attempt: int = 0) -> None:
        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            self._delivered(seq, err, msg, attempt)

        while True:
            try:
                self._producer.produce(topic, key=key, value=value, headers=headers, on_delivery=on_delivery)
                return
            except BufferError:
                # The local queue is full: the delivery thread drains it; wait for room.
                time.sleep(0.005)
            except KafkaException as exc:
                # librdkafka refuses at once a topic its metadata already says is not ours to write.
                reason = self._failures.decide(exc.args[0], topic=topic, op="write")
                if reason is None:
                    raise
                self._producer_ok = False
                self._fail(reason)
                return

    def _delivered(self, seq: int, err: KafkaError | None, msg: Message, attempt: int) -> None:
        """Delivery thread: the broker acknowledged (or finally refused) one record."""
        if err is not None:
            reason = self._failures.decide(err, topic=msg.topic(), op="write")
            if reason is not None:
                self._producer_ok = False
                self._fail(reason)
                return
            if attempt < MAX_REPRODUCE and not err.fatal():
                log.warning("delivery failed; producing again", error=str(err), topic=msg.topic(), attempt=attempt + 1)
                self._produce(msg.topic(), msg.key(), msg.value(), msg.headers(), seq, attempt + 1)
                return
            self._producer_ok = False
            self._fatal = WorkerError(f"could not deliver to {msg.topic()}: {err}")
            self._stop.set()
            return
        self._failures.connected()
        with self._inflight_lock:
            rec = self._inflight.pop(seq, None)
        if rec is None:
            return
        rec.part.done(rec.offset)
        if msg.topic() == self.settings.output_topic:
            self._count("produced")
            if self._metrics is not None:
                self._metrics.count_produced()
                if rec.timestamp_ms is not None:
                    self._metrics.observe_end_to_end(rec.timestamp_ms)

    # ------------------------------------------------------------------ offsets
    def _committable(self, parts: Sequence[PartitionOffsets]) -> list[TopicPartition]:
        offsets = []
        for part in parts:
            off = part.committable()
            # Nothing finished yet: committing would only restate where the group stood, and a
            # worker stopped by a fatal error must leave the group's offsets as they were.
            if off is not None and not (part.committed is None and off == part.first):
                offsets.append(TopicPartition(part.topic, part.partition, off))
        return offsets

    def _maybe_commit(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_commit < self.settings.commit_interval_ms / 1000.0:
            return
        self._last_commit = now
        pending = [tp for tp in self._committable(self._tracker.partitions()) if self._needs_commit(tp)]
        if not pending:
            return
        try:
            self._consumer.commit(offsets=pending, asynchronous=True)
        except KafkaException as exc:
            # No coordinator right now (broker restart, rebalance): the next round retries.
            log.warning("commit failed; will retry", error=str(exc))

    def _needs_commit(self, tp: TopicPartition) -> bool:
        part = self._tracker.get(tp.topic, tp.partition)
        return part is not None and part.uncommitted() > 0 and (part.committed is None or tp.offset > part.committed)

    def _commit_sync(self, parts: Sequence[PartitionOffsets]) -> None:
        offsets = self._committable(parts)
        if not offsets:
            return
        try:
            result = self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            log.warning("synchronous commit failed", error=str(exc))
            return
        self._confirm(result or [])

    def _on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        if err is not None:
            log.warning("commit failed", error=str(err))
            return
        self._confirm(partitions)

    def _confirm(self, partitions: Sequence[TopicPartition]) -> None:
        for tp in partitions:
            if tp.error is None and tp.offset >= 0:
                part = self._tracker.get(tp.topic, tp.partition)
                if part is not None:
                    part.confirm_commit(tp.offset)

    # ------------------------------------------------------------------ rebalances
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._failures.connected()
        for tp in partitions:
            self._tracker.assign(tp.topic, tp.partition)
        log.info("partitions assigned", partitions=[f"{tp.topic}[{tp.partition}]" for tp in partitions])
        if self._metrics is not None:
            self._metrics.count_rebalance("assign")
        if partitions:
            # Assigning here replaces the library's own assign, so the pause state can be set
            # right after it: a paused member takes new partitions paused (resumed with the rest
            # once the in-flight bound drains); otherwise they are resumed explicitly, because
            # librdkafka keeps a partition's pause flag across a lost/re-assigned cycle and a
            # partition paused before a broker outage would otherwise never fetch again.
            consumer.incremental_assign(partitions)
            (consumer.pause if self._paused else consumer.resume)(partitions)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        parts = [p for tp in partitions if (p := self._tracker.get(tp.topic, tp.partition)) is not None]
        # Closing after an abort or a fatal error: nothing more will finish, so do not wait.
        wait_s = 0.0 if (self._abort.is_set() or self._fatal is not None) else self.settings.revoke_timeout_s
        deadline = time.monotonic() + wait_s
        while any(p.unfinished() for p in parts) and time.monotonic() < deadline and self._fatal is None:
            time.sleep(0.01)
        unfinished = sum(p.unfinished() for p in parts)
        self._commit_sync(parts)
        for tp in partitions:
            self._tracker.revoke(tp.topic, tp.partition)
            if self._metrics is not None:
                self._metrics.forget_partition(tp.topic, tp.partition)
        log.info("partitions revoked", partitions=[f"{tp.topic}[{tp.partition}]" for tp in partitions],
                 dropped_unfinished=unfinished)
        if self._metrics is not None:
            self._metrics.count_rebalance("revoke")

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost, not revoked: another member may already own them, so commit nothing.
        for tp in partitions:
            self._tracker.revoke(tp.topic, tp.partition)
            if self._metrics is not None:
                self._metrics.forget_partition(tp.topic, tp.partition)
        log.warning("partitions lost", partitions=[f"{tp.topic}[{tp.partition}]" for tp in partitions])
        if self._metrics is not None:
            self._metrics.count_rebalance("lost")

    # ------------------------------------------------------------------ errors, stats
    def _fail(self, reason: str) -> None:
        """Stop the worker without draining; the first reason is the one reported."""
        if self._fatal is None:
            self._fatal = WorkerError(reason)
        self._stop.set()

    def _on_consumer_error(self, err: KafkaError) -> None:
        reason = self._failures.decide(err, group=self.settings.group_id)
        if reason is not None:
            self._fail(reason)
        elif err.fatal():
            self._fatal = WorkerError(f"fatal consumer error: {err}")
            self._stop.set()
        else:
            self._client_errors.warn("consumer error", err)

    def _on_producer_error(self, err: KafkaError) -> None:
        reason = self._failures.decide(err, op="write")
        if reason is not None:
            self._producer_ok = False
            self._fail(reason)
        elif err.fatal():
            self._producer_ok = False
            self._fatal = WorkerError(f"fatal producer error: {err}")
            self._stop.set()
        else:
            self._client_errors.warn("producer error", err)

    def _on_stats(self, raw: str) -> None:
        if self._metrics is None:
            return
        try:
            # Only partitions still ours: a revoked partition's lag must not come back.
            self._metrics.update_from_stats(raw, owned=_Owned(self._tracker))
        except ValueError as exc:
            log.debug("bad librdkafka stats", error=str(exc))

    # ------------------------------------------------------------------ shutdown
    def _drain(self) -> None:
        """Stop taking new keywords, finish what is in flight, commit it."""
        s = self.settings
        assignment = self._consumer.assignment()
        if assignment:
            self._consumer.pause(assignment)
        start = time.monotonic()
        log.info("draining", in_flight=self.in_flight(), timeout_s=s.shutdown_timeout_s)
        while self.in_flight() and time.monotonic() - start < s.shutdown_timeout_s and not self._abort.is_set() \
                and self._fatal is None:
            # Keep serving the group (heartbeats, commit callbacks) while paused; anything
            # still returned is neither tracked nor committed, so it is redelivered later.
            self._consumer.consume(num_messages=1, timeout=0.05)
            self._maybe_commit()
        log.info("drained", in_flight=self.in_flight(), seconds=round(time.monotonic() - start, 3))

    def _shutdown(self) -> None:
        drain = not self._abort.is_set() and self._fatal is None
        dropped = self._bucketer.stop(drain=drain, timeout=5.0 if drain else 0.5)
        # No callback runs after the bucketer stopped, so the sentinel is the outbox's last item.
        self._outbox.put(None)
        self._output.join()
        self._producer.flush(10.0 if drain else 1.0)
        self._delivery.stop(timeout=5.0)
        self._commit_sync(self._tracker.partitions())
        try:
            self._consumer.close()  # leaves the group: its partitions move without waiting for a timeout
        except (KafkaException, RuntimeError) as exc:
            log.warning("consumer close failed", error=str(exc))
        log.info("worker stopped", **self.counts, never_completed=len(dropped or []))
