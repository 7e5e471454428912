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

Exactly-once is the exception (`fail_writes_into`): a failed write fails its transaction, not the
worker. librdkafka has then made the transaction abortable (an OUT_OF_ORDER_SEQUENCE_NUMBER after
a broker restart, a record the broker refused): it sends nothing more of it, and a produce into it
fails with _STATE. The record is given up (its in-flight slot released, its offset left
unfinished), the transaction loop aborts at once and consumes the records again, so nothing is
written twice; it bounds how often (worker/kafka/transactions.py). Authorisation and missing-topic
errors, and fatal ones, still stop the worker; except _FENCED, raised from poll, which goes to the
transaction loop like a failed write: the broker may have timed the transaction out (a coordinator
outage), and a new producer may take over (worker/kafka/transactions.py decides).

`write_gate`: the output thread holds it while it takes a batch's live records and produces them;
the transaction loop holds it while it replaces the offset state and aborts, so no record of an
aborted transaction can be produced after the abort, into the next one.

`replace_client` (exactly-once, under the write gate): a transactional call hung inside librdkafka
(a coordinator's node died; worker/kafka/transactions.py `take_over`). A new librdkafka producer
with the same configuration takes over, and its init_transactions fences the old one. The old one
is abandoned, not closed: a thread is still blocked inside it. It is never polled again, so none
of its callbacks run (its records' reports, its fenced error), and its error callback is muted in
case one already queued runs. Once the blocked call returns, the delivery thread hands the old
client to a short-lived thread that drops the last reference (librdkafka's destroy can block).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from worker.config import Settings
from worker.deadline import Deadline
from worker.kafka.client_config import client_config
from worker.kafka.errors import FailurePolicy, KafkaSetupError
from worker.errors import DeliveryError, ThreadDiedError
from worker.kafka.throttle import ThrottledLog
from worker.latch import FatalLatch, guarded

log = structlog.get_logger(__name__)

# An outage shorter than this is ridden out by librdkafka's own retries.
MESSAGE_TIMEOUT_MS = 3_600_000
# Delivery reports of records an abort_transaction purged from the queue: not failures (the
# records belonged to the aborted transaction, their input offsets stay unfinished).
PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
# How long a caller sleeps between produce() attempts while the local queue is full.
BUFFER_WAIT_S = 0.005

Headers = list[tuple[str, bytes | None]]
# Releases a record that will never be delivered (worker/acks.py `given_up`); the callable it is
# given (the failed write's report) runs first when the record belongs to the open transaction.
GiveUp = Callable[[Callable[[], None]], bool]


def nothing() -> None:
    """What a released record reports when its release fails nothing (purged by an abort)."""


def producer_config(settings: Settings) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap.servers": settings.bootstrap_servers,
        # Idempotent + acks=all: a broker restart neither loses nor duplicates an acknowledged write.
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        # Embeddings are float text or float bytes, which compress poorly; lz4 cost about 7% of
        # the throughput of a 2-core worker (benchmarks/kafka_vs_offline.py). Where bandwidth
        # matters more, pass --kafka-config compression.type=lz4 (or zstd).
        "compression.type": "none",
        # Room for every in-flight keyword plus dead letters: produce() should not meet a full
        # queue in steady state, because the in-flight bound already limits what is outstanding.
        "queue.buffering.max.messages": max(100000, 4 * settings.max_in_flight),
        "message.timeout.ms": MESSAGE_TIMEOUT_MS,
        "client.id": f"keyword-embedder-{settings.group_id}",
    }
    # librdkafka's own log lines go through the stdlib logger into the structured log stream,
    # instead of raw "%6|...|FAIL|..." lines on stderr.
    config["logger"] = logging.getLogger("librdkafka")
    # Security and --kafka-config / --kafka-config-file keys, merged in one place.
    config.update(client_config(settings))
    return config


def describe(err: KafkaError) -> str:
    return f"{err.str()} ({err.name()})"


class OutputProducer:
    def __init__(self, config: dict[str, Any], latch: FatalLatch, *, failures: FailurePolicy | None = None,
                 producer_factory: Callable[[dict[str, Any]], Any] = Producer, poll_interval_s: float = 0.05) -> None:
        self._latch = latch
        # Authentication, TLS and ACL errors: which stop the worker, with which message.
        self._failures = failures if failures is not None else FailurePolicy()
        self._errors = ThrottledLog()
        self._config = config
        self._factory = producer_factory
        # Which client is current: the error callback of a replaced one is ignored.
        self._generation = 0
        self._producer = self._new_client()
        # Replaced clients, each with the thread still blocked inside it (delivery thread retires them).
        self._abandoned: list[tuple[Any, threading.Thread]] = []
        self._abandoned_lock = threading.Lock()
        self.replaced = 0
        self._interval = poll_interval_s
        self._stop = threading.Event()
        # Set when the worker aborts: callers waiting for queue room give up instead.
        self._interrupt = threading.Event()
        # Exactly-once: where a failed write goes instead of the latch (set once, before start).
        self._fail_transaction: Callable[[str], None] | None = None
        self.write_gate = threading.Lock()
        # Records purged by an aborted transaction (delivery thread only).
        self.purged = 0
        # Records given up after a failed write (exactly-once; any producing thread, a count only).
        self.given_up = 0
        self._thread = threading.Thread(target=guarded(latch, "kwe-delivery", self._serve), name="kwe-delivery")

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def client(self) -> Any:
        """The librdkafka producer, for the transactional calls (poll thread only)."""
        return self._producer

    def _new_client(self) -> Any:
        generation = self._generation
        return self._factory({**self._config, "error_cb": lambda err: self._on_error(err, generation)})

    def replace_client(self, stuck: threading.Thread) -> Any:
        """A new librdkafka producer with the same configuration replaces the current one, which a
        transactional call (running on `stuck`) never returned from; returns the new one. The caller
        holds `write_gate` (no produce races the swap) and calls init_transactions on it next."""
        with self._abandoned_lock:
            self._abandoned.append((self._producer, stuck))
        self._generation += 1
        self._producer = self._new_client()
        self.replaced += 1
        return self._producer

    def _retire_abandoned(self) -> None:
        """Delivery thread: a replaced client whose blocked call has returned is destroyed, on a
        thread of its own (rd_kafka_destroy may wait on the dead broker's connections). The
        client goes from the list straight into that thread's arguments: no local name here holds
        it, so the last reference cannot end on this thread, whichever thread finishes first."""
        with self._abandoned_lock:
            if not self._abandoned:
                return
            done = [i for i, (_, stuck) in enumerate(self._abandoned) if not stuck.is_alive()]
            for i in reversed(done):
                threading.Thread(target=_drop, args=(self._abandoned.pop(i)[0],), name="kwe-retire-producer",
                                 daemon=True).start()

    @property
    def abandoned(self) -> int:
        """Replaced clients still blocked in a call."""
        with self._abandoned_lock:
            return len(self._abandoned)

    def fail_writes_into(self, fail_transaction: Callable[[str], None]) -> None:
        """Exactly-once: a failed write calls `fail_transaction(reason)`, from the thread that saw
        it, instead of stopping the worker. Set before `start`."""
        self._fail_transaction = fail_transaction

    def start(self) -> None:
        self._thread.start()

    def produce(self, topic: str, key: bytes | None, value: bytes, headers: Headers,
                on_delivered: Callable[[], None], on_given_up: GiveUp = lambda fail: False) -> bool:
        """Queues one record; `on_delivered` runs on the delivery thread once the broker has it.

        False when the record was not queued (the worker is stopping on an error, or aborting):
        its input offset then stays unfinished and is never committed. `on_given_up` releases a
        record that will never be delivered: purged by an abort, or (exactly-once) its write
        failed its transaction, whose failure it reports first if the record still belongs to the
        open transaction (worker/acks.py). produce() returns True for a record given up so: it is
        accounted for.
        """
        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                if err.code() in PURGED:
                    self.purged += 1
                    on_given_up(nothing)
                    return
                self._refused(topic, err, "could not write to topic", on_given_up)
                return
            self._failures.connected()
            try:
                on_delivered()
            except Exception as exc:  # noqa: BLE001 - a bug in accounting must stop the worker, visibly
                self._latch.trip(ThreadDiedError(f"delivery accounting failed for topic {topic!r}: {exc!r}"))

        while True:
            if self._interrupt.is_set():
                return False
            try:
                self._producer.produce(topic, key=key, value=value, headers=headers, on_delivery=delivered)
                return True
            except BufferError:
                if self._latch.is_set():
                    return False
                self._interrupt.wait(BUFFER_WAIT_S)
            except KafkaException as exc:
                # Refused before queueing: too large for the producer's limit, unknown topic, not
                # authorised (known from metadata), a transaction already failed (_STATE), ...
                # None of these succeed on a retry of the same call.
                return self._refused(topic, exc.args[0], "cannot write to topic", on_given_up)

    def _refused(self, topic: str, err: KafkaError, what: str, on_given_up: GiveUp) -> bool:
        """A failed write; True when it only failed the open transaction (exactly-once)."""
        reason = self._failures.decide(err, topic=topic, op="write")
        if reason is not None:
            self._latch.trip(KafkaSetupError(reason))
            return False
        if self._fail_transaction is None or err.fatal():
            self._latch.trip(DeliveryError(f"{what} {topic!r}: {describe(err)}"))
            return False
        self.given_up += 1
        # Reported before the record leaves the in-flight table (see GiveUp); a record of an
        # already aborted transaction (its state was replaced) fails nothing.
        fail, why = self._fail_transaction, f"{what} {topic!r}: {describe(err)}"
        on_given_up(lambda: fail(why))
        return True

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._poll(self._interval):
                return
            self._retire_abandoned()
        # Serve what was acknowledged while stopping, so no callback is left unrun.
        self._poll(0)

    def _poll(self, timeout_s: float) -> bool:
        """One poll of the current client; False when its fatal error stops the worker."""
        generation = self._generation
        try:
            self._producer.poll(timeout_s)
            return True
        except KafkaException as exc:
            # A transactional producer raises its fatal error (fenced) from poll itself
            # (confluent-kafka's error_cb turns librdkafka's _FATAL event into an exception).
            err = exc.args[0]
            if generation != self._generation:
                return True  # a replaced client's, fenced by its successor on purpose
            if self._fail_transaction is not None and err.code() == KafkaError._FENCED:
                # Exactly-once: the transaction loop tells a broker-side timeout from a zombie, and
                # a new producer may take over (transactions.py); its calls raise the same error.
                # Failing the open transaction makes it look now, not after a drain that cannot end.
                log.warning("producer fenced; the transaction loop decides whether a new producer takes over",
                            error=describe(err))
                self._fail_transaction(f"the producer was fenced: {describe(err)}")
                return True
            self._latch.trip(DeliveryError(f"fatal producer error: {describe(err)}"))
            return False

    def _on_error(self, err: KafkaError, generation: int = 0) -> None:
        if generation != self._generation:
            # A replaced client (see replace_client): fenced by its successor, on purpose.
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
        callbacks on this thread too; they belong to the delivery thread.
        """
        while len(self._producer) and not deadline.expired() and self._thread.is_alive():
            time.sleep(0.01)
        return len(self._producer)

    def interrupt(self) -> None:
        """Nothing more is written: produce() returns False from now on (an abort, or the
        exactly-once shutdown's abort of the open transaction, after which a write would fail)."""
        self._interrupt.set()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(max(0.0, timeout_s))
        if self._thread.is_alive():
            log.warning("delivery thread did not stop in time", timeout_s=timeout_s)


def _drop(client: Any) -> None:
    """The last reference to a replaced librdkafka client goes with this thread's arguments."""
    del client
