"""The producer wrapper: owns the librdkafka Producer and the thread that serves its deliveries.

Threads:
- callers of `produce` (the poll thread for dead letters, the output thread for embeddings):
  produce() is thread-safe in librdkafka. A full local queue (BufferError) makes the caller
  wait for room; the caller is never the delivery thread, so the wait cannot deadlock.
- the delivery thread ("kwe-delivery"): the only caller of Producer.poll, so every delivery
  callback runs there. It never produces: a callback only acknowledges (success) or reports
  a fatal error (failure) to the latch.

Errors: librdkafka's idempotent producer retries everything retriable by itself, in order and
without duplicates, for up to message.timeout.ms (long enough to ride out a broker outage;
memory stays bounded because the in-flight bounds cap what is outstanding). So an error
that reaches a delivery callback is final (the topic is gone, not authorised, the record too
large, or the outage outlasted the timeout): the worker stops on it, and the record's input
offset is never committed. Producing a fresh copy instead would duplicate records, reorder a
compacted key and retry errors that cannot succeed.

Seams for a wrapper (exactly-once: worker/ledger/exactly_once/producer.py): a record's
`on_failed` gets a failed write first, after the failures that stop the worker anyway
(authorisation, a missing topic: FailurePolicy), and may take it over; `route_fatal` does the same
for a fatal error raised from poll; `renew_client` swaps in a new client with the same
configuration (the old one is never polled again and its error callback is muted) and hands the
old one to the caller.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import structlog
from confluent_kafka import KafkaError, KafkaException, Producer

from worker.deadline import Deadline
from worker.errors import DeliveryError, ThreadDiedError
from worker.kafka.errors import FailurePolicy, KafkaSetupError
from worker.kafka.reports import PARTITION_UNASSIGNED, Failed, Headers, report_sink
from worker.kafka.throttle import ThrottledLog
from worker.latch import FatalLatch, guarded

log = structlog.get_logger(__name__)

# How long a caller sleeps between produce() attempts while the local queue is full.
BUFFER_WAIT_S = 0.005


class RecordWriter(Protocol):
    """What the output stage and dead letters write through: OutputProducer, or a wrapper of it."""

    def write(self, seq: int, topic: str, key: bytes | None, value: bytes, headers: Headers,
              on_delivered: Callable[[], None]) -> bool: ...


def describe(err: KafkaError) -> str:
    return f"{err.str()} ({err.name()})"


class OutputProducer:
    def __init__(self, config: dict[str, Any], latch: FatalLatch, *, failures: FailurePolicy | None = None,
                 producer_factory: Callable[[dict[str, Any]], Any] = Producer, poll_interval_s: float = 0.05,
                 compiled_reports: bool = True) -> None:
        self._latch = latch
        # Authentication, TLS and ACL errors: which stop the worker, with which message.
        self._failures = failures if failures is not None else FailurePolicy()
        self._errors = ThrottledLog()
        self._config = config
        self._factory = producer_factory
        # Which client is current: the error callback of a renewed one is ignored.
        self._generation = 0
        # The generation of the last poll that returned (delivery thread): a renewed client is no
        # longer referenced by the delivery thread once this reaches a later generation.
        self.served_generation = 0
        self._producer = self._new_client()
        self._interval = poll_interval_s
        self._stop = threading.Event()
        # Set when the worker aborts: callers waiting for queue room give up instead.
        self._interrupt = threading.Event()
        # Where a fatal error raised from poll goes first (`route_fatal`); set once, before start.
        self._fatal_route: Callable[[KafkaError], bool] | None = None
        # Run after each poll on the delivery thread (the poll's acknowledgements, finished together).
        self._after_poll: Callable[[], None] | None = None
        # Each record's delivery callback (compiled where it could be built: no Python frame a record).
        self._sink = report_sink(self._refused_report, self._accounting_failed, compiled=compiled_reports)
        # Polls finished, after_poll hook included (delivery thread writes; flush reads).
        self._polls_done = 0
        self._thread = threading.Thread(target=guarded(latch, "kwe-delivery", self._serve), name="kwe-delivery")

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def client(self) -> Any:
        """The current librdkafka producer (for a wrapper's own calls on it)."""
        return self._producer

    def _new_client(self) -> Any:
        generation = self._generation
        return self._factory({**self._config, "error_cb": lambda err: self._on_error(err, generation)})

    @property
    def generation(self) -> int:
        """How many times the client was renewed."""
        return self._generation

    def renew_client(self) -> Any:
        """A new librdkafka producer with the same configuration replaces the current one, which is
        returned: never polled again, its error callback muted. The caller makes sure no produce
        races the swap, and owns the old client from here (librdkafka's destroy can block: where
        its last reference ends matters)."""
        old = self._producer
        self._generation += 1
        self._producer = self._new_client()
        return old

    def after_poll(self, hook: Callable[[], None]) -> None:
        """`hook` runs on the delivery thread after each poll, with the delivery callbacks that
        poll served behind it. Set before `start`."""
        self._after_poll = hook

    def route_fatal(self, route: Callable[[KafkaError], bool]) -> None:
        """A fatal error raised from poll goes to `route` first; True: taken over, the delivery
        thread serves on. Set before `start`."""
        self._fatal_route = route

    def start(self) -> None:
        self._thread.start()

    def write(self, seq: int, topic: str, key: bytes | None, value: bytes, headers: Headers,
              on_delivered: Callable[[], None]) -> bool:
        """The output stage's and dead letters' write (in-flight record `seq`, which a wrapper that
        releases records itself needs; unused here)."""
        return self.produce(topic, key, value, headers, on_delivered)

    def produce(self, topic: str, key: bytes | None, value: bytes, headers: Headers,
                on_delivered: Callable[[], None], on_failed: Failed | None = None) -> bool:
        """Queues one record; `on_delivered` runs on the delivery thread once the broker has it.

        False when the record was not queued (the worker is stopping on an error, or interrupted):
        its input offset then stays unfinished and is never committed. A failed write stops the
        worker, unless `on_failed` takes it over (see the module docstring); produce() returns
        True for a record taken over so: it is accounted for.
        """
        delivered = self._sink.report(topic, on_delivered, on_failed)
        while True:
            if self._interrupt.is_set():
                return False
            try:
                # Every argument by position, in the order of the C function's keyword list (topic,
                # value, key, partition, callback, on_delivery, timestamp, headers; unchanged since
                # confluent-kafka 0.11.4): given any keyword, it looks each of its eight up in the
                # dict by a string made for the lookup, 0.5 of the 2.6 us a record with four headers
                # costs (micro-timed; tests/unit/worker/kafka/test_producer_positional.py checks the order).
                self._producer.produce(topic, value, key, PARTITION_UNASSIGNED, delivered, None, 0, headers)
                return True
            except BufferError:
                if self._latch.is_set():
                    return False
                self._interrupt.wait(BUFFER_WAIT_S)
            except KafkaException as exc:
                # Refused before queueing: too large for the producer's limit, unknown topic, not
                # authorised (known from metadata), a state the client refuses writes in (_STATE), ...
                # None of these succeed on a retry of the same call.
                return self._refused(topic, exc.args[0], "cannot write to topic", on_failed)

    def _refused_report(self, topic: str, err: KafkaError, on_failed: Failed | None) -> None:
        """A delivery callback's failed write (delivery thread)."""
        self._refused(topic, err, "could not write to topic", on_failed)

    def _accounting_failed(self, topic: str, exc: Exception) -> None:
        """A record's on_delivered raised: a bug in accounting must stop the worker, visibly."""
        self._latch.trip(ThreadDiedError(f"delivery accounting failed for topic {topic!r}: {exc!r}"))

    def _refused(self, topic: str, err: KafkaError, what: str, on_failed: Failed | None) -> bool:
        """A failed write; True when `on_failed` took it over."""
        reason = self._failures.decide(err, topic=topic, op="write")
        if reason is not None:
            self._latch.trip(KafkaSetupError(reason))
            return False
        why = f"{what} {topic!r}: {describe(err)}"
        if on_failed is not None and on_failed(err, why):
            return True
        self._latch.trip(DeliveryError(why))
        return False

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._poll(self._interval):
                return
        # Serve what was acknowledged while stopping, so no callback is left unrun.
        self._poll(0)

    def _poll(self, timeout_s: float) -> bool:
        """One poll of the current client; False when its fatal error stops the worker."""
        generation = self._generation
        try:
            self._producer.poll(timeout_s)
            if self._sink.take_delivered():
                # The credentials work: told once per poll, not once per record (it takes a lock).
                self._failures.connected()
            if self._after_poll is not None:
                self._after_poll()
            self._polls_done += 1
            return True
        except KafkaException as exc:
            # librdkafka's fatal errors are raised from poll itself
            # (confluent-kafka's error_cb turns librdkafka's _FATAL event into an exception).
            err = exc.args[0]
            if generation != self._generation:
                return True  # a renewed client's, fenced by its successor on purpose
            if self._fatal_route is not None and self._fatal_route(err):
                return True
            self._latch.trip(DeliveryError(f"fatal producer error: {describe(err)}"))
            return False
        finally:
            self.served_generation = generation

    def _on_error(self, err: KafkaError, generation: int = 0) -> None:
        if generation != self._generation:
            # A renewed client (see renew_client): fenced by its successor, on purpose.
            log.debug("error of a replaced producer ignored", error=describe(err))
            return
        reason = self._failures.decide(err, op="write")
        if reason is not None:
            self._latch.trip(KafkaSetupError(reason))
        elif err.fatal():
            self._latch.trip(DeliveryError(f"fatal producer error: {describe(err)}"))
        else:
            self._errors.warn("producer error", err)

    def flush(self, deadline: Deadline) -> int:
        """Waits until the deadline for outstanding records; returns how many are still unacknowledged.

        Waits on the queue length instead of calling Producer.flush, which would serve delivery
        callbacks on this thread too; they belong to the delivery thread. The queue is empty once
        the last callbacks ran, but what they acknowledged is finished by the after_poll hook at the
        end of that poll (worker/ledger/acks.py): so it also waits for a poll to end after the
        queue was seen empty, or a final commit would miss the last poll's records.
        """
        while len(self._producer) and not deadline.expired() and self._thread.is_alive():
            time.sleep(0.01)
        left = len(self._producer)
        if not left:
            seen = self._polls_done
            while self._polls_done == seen and not deadline.expired() and self._thread.is_alive():
                time.sleep(0.002)
        return left

    def interrupt(self) -> None:
        """Nothing more is written (an abort, or a wrapper's shutdown step after which a write would
        fail): produce() returns False from its next check on, and one waiting for queue room gives up
        within BUFFER_WAIT_S. A produce() already past its check queues its record (the client's call
        holds the interpreter lock throughout: confluent-kafka's produce never releases it), so an
        interrupt lands between two records: the output stage, which writes a batch a record at a
        time, queues at most the one in hand and stops before the next."""
        self._interrupt.set()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(max(0.0, timeout_s))
        if self._thread.is_alive():
            log.warning("delivery thread did not stop in time", timeout_s=timeout_s)
