"""The worker: wiring of intake -> bucketer -> output, and its start and shutdown.

Threads and what each one owns:
- the poll thread (the caller of `Pipeline.run`): the group member (consume, pause/resume,
  rebalance callbacks), intake (decode, validate, tokenize, submit) and the committer.
- the bucketer's former and dispatcher threads: bucket state, one backend context each.
- the output thread (`OutputStage`): encodes finished batches and produces them.
- the delivery thread (`OutputProducer`): serves delivery callbacks, which acknowledge.
- the metrics server thread, when enabled (reads only).
Cross-thread state: the in-flight table (one lock), each partition's offsets (one lock each),
and the fatal latch, which every thread reports to and the poll thread watches.

Delivery (processing_guarantee) is a `Delivery` (worker/delivery.py), called at fixed points of
the loop; this module never asks which guarantee runs. At-least-once (default): an input offset
is committed only after its output (or its dead-letter record) is acknowledged, and never past
a partition's lowest unfinished offset. Exactly-once: outputs, dead letters and offsets commit
in one transaction, closed only once nothing consumed into it is in flight.
A fatal error anywhere stops the worker with that error and exit code 1; nothing past the
failed record is committed. Shutdown (SIGTERM) drains, flushes, commits and leaves the group
within one `Deadline` (shutdown_timeout_s), which every step re-reads; a second signal aborts
and shortens it to 2 s for all of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
from confluent_kafka import Consumer, Producer

from worker.acks import Acknowledger
from worker.backends.isolating import IsolatingBackend
from worker.cache import EmbeddingCache
from worker.config import Settings
from worker.cost_model import CostModel
from worker.dead_letters import DeadLetters
from worker.deadline import Deadline
from worker.delivery import Delivery, build_delivery, producer_config_for
from worker.errors import ThreadDiedError, WorkerError
from worker.flow import FlowControl
from worker.health import Liveness
from worker.inflight import InFlightTable
from worker.intake import Decode, Intake
from worker.kafka.committer import Committer
from worker.kafka.consumer import GroupMember, consumer_config
from worker.kafka.errors import FailurePolicy
from worker.kafka.messages import OutputCodec, ValueEncoder
from worker.kafka.propagation import Propagation
from worker.kafka.producer import OutputProducer, producer_config
from worker.latch import FatalLatch, guarded
from worker.metrics import Metrics
from worker.output import OutputStage
from worker.tracing import BatchSpans

log = structlog.get_logger(__name__)

# A known-good input for telling a poison keyword from a broken backend (see IsolatingBackend).
CANARY_TEXT = "keyword embedder canary"
# Of the shutdown deadline, what is kept back after draining for flush + final commit, and
# after those for leaving the group.
AFTER_DRAIN_S = 6.0
LEAVE_S = 3.0
# A second stop request: everything still running gets at most this long.
ABORT_S = 2.0


class Pipeline:
    def __init__(self, settings: Settings, *, tokenizer: Any, backend: Any, profile: Any, model_name: str,
                 metrics: Metrics | None = None, bucketer_factory: Any = None, costs: CostModel | None = None,
                 consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
                 producer_factory: Callable[[dict[str, Any]], Any] = Producer,
                 codec: ValueEncoder | None = None, decode: Decode | None = None,
                 spans: BatchSpans | None = None) -> None:
        from worker.bucketing import Bucketer

        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        self.latch = FatalLatch()
        self._stop = threading.Event()
        self._abort = threading.Event()
        # The one shutdown deadline; its views end earlier by what later steps need.
        self.deadline = Deadline()
        self._drain_by = self.deadline.before(AFTER_DRAIN_S)
        self._commit_by = self.deadline.before(LEAVE_S)
        self.left_group = True

        self._inflight = InFlightTable()
        # What is in flight must drain within a third of the shutdown deadline (see FlowControl).
        self._flow = FlowControl(settings.max_in_flight, settings.max_in_flight_bytes,
                                 drain_target_s=max(1.0, settings.shutdown_timeout_s / 3))
        failures = FailurePolicy()
        self._producer = OutputProducer(producer_config_for(settings, producer_config(settings)), self.latch,
                                        failures=failures, producer_factory=producer_factory)
        self._acks = acks = Acknowledger(self._inflight, self.metrics)
        self._committer = Committer(None, interval_s=settings.commit_interval_ms / 1000.0)
        self._member = GroupMember(consumer_config(settings), self._committer, self.latch, self.metrics,
                                   revoke_wait_s=self._revoke_wait_s, group=settings.group_id, failures=failures,
                                   consumer_factory=consumer_factory)
        self._delivery: Delivery = build_delivery(settings, self._committer, self._producer, self._member.client,
                                                  self.latch, self._inflight, self.metrics, self._commit_by)
        # Records are written through the delivery's writer (exactly-once wraps the producer).
        dead_letters = DeadLetters(settings.dead_letter_topic, settings.dead_letter_max_bytes,
                                   self._delivery.writer, acks)
        # worker.app.output_codec adds truncate_dim, the prompt and the int8 range (and
        # worker.app.output_encoder the registry formats); decode is a registry format's decoder.
        codec = codec or OutputCodec(model=model_name, dim=backend.dim, encoding=settings.output_encoding)  # type: ignore[arg-type]
        # One span per batch when an OTLP endpoint is set (the otel extra, imported only then).
        if spans is None and settings.otel_exporter_otlp_endpoint:
            from worker.tracing import batch_spans

            spans = batch_spans(settings.otel_exporter_otlp_endpoint, model=model_name)
        self._spans = spans
        # Repeated keywords are answered from here without the model (0 bytes: off).
        cache = EmbeddingCache(settings.cache_bytes, backend.dim, observer=self.metrics) if settings.cache_bytes else None
        self._output = OutputStage(settings.output_topic, codec, self._delivery.writer, self._inflight, acks,
                                   dead_letters, self.metrics, self.latch, cache=cache,
                                   propagation=Propagation.of(settings.pass_headers, settings.trace_context),
                                   spans=spans, around_batch=self._delivery.around_batch)
        canary = tokenizer.encode([CANARY_TEXT])[0].ids
        self._bucketer = (bucketer_factory or Bucketer)(
            profile, IsolatingBackend(backend, canary), self._output.on_batch, on_error=self._output.on_batch_error,
            max_queue_delay_ms=settings.max_queue_delay_ms, dispatchers=settings.dispatchers,
            pad_to=settings.pad_to, costs=costs, guard=lambda name, body: guarded(self.latch, name, body))
        self._intake = Intake(settings, tokenizer, self._committer.tracker, self._inflight, self._bucketer.submit,
                              dead_letters, self.metrics, cache=cache, answer=self._output.on_cached, decode=decode,
                              watermarks=self._member.watermarks)
        self.liveness = Liveness(self.latch, lambda: [self._output.thread, self._producer.thread,
                                                      *self._bucketer.threads],
                                 self._committer.stalled_for, settings.stall_timeout_s)

    # ------------------------------------------------------------------ state for probes
    def ready(self) -> tuple[bool, dict[str, bool]]:
        checks = {"assigned": bool(self._committer.tracker.partitions()), "no_fatal_error": not self.latch.is_set()}
        return all(checks.values()), checks

    @property
    def backend_calls_running(self) -> bool:
        """After run(): a dispatcher was still inside a backend call when the bucketer stopped."""
        return bool(self._bucketer.stuck)

    def in_flight(self) -> int:
        return len(self._inflight)

    def uncommitted(self) -> int:
        return self._committer.uncommitted()

    def request_stop(self) -> None:
        """First call: drain, commit and leave within shutdown_timeout_s. Second call: abort now."""
        if self._stop.is_set():
            self._abort.set()
            self._producer.interrupt()
            self.deadline.shorten(ABORT_S)
            log.warning("second stop request: aborting without draining")
            return
        self.deadline.start(self.settings.shutdown_timeout_s)
        self._stop.set()

    def _revoke_wait_s(self) -> float:
        if self._abort.is_set() or self.latch.is_set():
            return 0.0
        return min(self.settings.revoke_timeout_s, self._drain_by.left())

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        """Runs until stopped; returns the process exit code (0, 1 on a fatal error, 130 aborted)."""
        s = self.settings
        try:
            # Inside the try: a bucketer that cannot create its backend contexts is a fatal
            # error like any other (exit 1, one line), and the shutdown below still runs.
            self._bucketer.start()
            self._output.start()
            self._producer.start()
            log.info("worker started", processing_guarantee=s.processing_guarantee, group=s.group_id,
                     input_topic=s.input_topic, output_topic=s.output_topic, dead_letter_topic=s.dead_letter_topic,
                     max_in_flight=s.max_in_flight, max_in_flight_bytes=s.max_in_flight_bytes)
            self._delivery.start()
            self._member.subscribe(s.input_topic, self._delivery)
            while not self._stop.is_set() and not self.latch.is_set():
                self._poll_once()
            if not self.latch.is_set() and not self._abort.is_set():
                self._drain()
        except WorkerError as exc:
            self.latch.trip(exc)
        except Exception as exc:  # noqa: BLE001 - a bug on the poll thread stops the worker like any other
            self.latch.trip(ThreadDiedError(f"the poll thread failed: {exc!r}"))
            log.exception("poll thread failed")
        finally:
            # Stopping on a fatal error: the same deadline applies (a no-op after a stop request).
            self.deadline.start(s.shutdown_timeout_s)
            self._shutdown()
        error = self.latch.error
        if error is not None:
            log.error("worker stopped on a fatal error", error=str(error))
            return 1
        return 130 if self._abort.is_set() else 0

    def _poll_once(self) -> None:
        pending = self._committer.uncommitted()
        self._flow.observe(time.monotonic(), self._acks.embedded_count + self._acks.dead_lettered_count,
                           busy=pending > 0)
        pause = self._delivery.poll_step(flow_paused=self._flow.update(pending, self._inflight.bytes))
        if pause is not None:
            self._member.set_paused(True, reason=pause)
        else:
            self._member.set_paused(False)
        self.metrics.set_in_flight(pending)
        msgs = self._member.consume(self._flow.room(pending) if pause is None else 1, 0.05)
        if msgs:
            self._delivery.before_intake()
            self._intake.handle(msgs)

    # ------------------------------------------------------------------ shutdown
    def _drain(self) -> None:
        """Stop taking new keywords, finish what is in flight, commit it."""
        self._member.pause_all()
        start = time.monotonic()
        log.info("draining", in_flight=self.in_flight(), timeout_s=round(self._drain_by.left(), 3))
        while self.in_flight() and not self._drain_by.expired() and not self._abort.is_set() \
                and not self.latch.is_set():
            # Keep serving the group (heartbeats, commit callbacks) while paused.
            self._member.serve(0.05)
            self._delivery.drain_step()
        log.info("drained", in_flight=self.in_flight(), seconds=round(time.monotonic() - start, 3))

    def _shutdown(self) -> None:
        clean = not self._abort.is_set() and not self.latch.is_set()
        # The drain's own deadline: a second signal that shortens it shortens this drain too.
        never_run = self._bucketer.stop(self._drain_by if clean else Deadline.after(0.5), drain=clean)
        self._output.stop(self._commit_by if clean else Deadline.after(0.5))
        if clean:
            unacked = self._producer.flush(self._commit_by)
            if unacked:
                log.warning("records still unacknowledged at the deadline", records=unacked)
        self._delivery.finish(self._commit_by, self._member.serve, drained=clean, aborted=self._abort.is_set())
        self.left_group = self._member.close(self.deadline)
        self._producer.stop(timeout_s=1.0)
        if self._spans is not None:
            # Spans of what was produced, exported within what is left (a collector that is
            # down costs at most this, never the commit, which is done).
            self._spans.close(timeout_s=max(0.5, min(2.0, self.deadline.left())))
        log.info("worker stopped", consumed=self._intake.consumed, produced=self._acks.embedded_count,
                 dead_lettered=self._acks.dead_lettered_count, in_flight=self.in_flight(),
                 dropped_after_revoke=self._output.dropped, never_run=len(never_run or []),
                 left_group=self.left_group, processing_guarantee=self.settings.processing_guarantee,
                 **self._delivery.summary())
