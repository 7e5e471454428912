"""The exactly-once producer: the output producer (worker/kafka/producer.py) with what only
exactly-once needs around it. The plain producer knows nothing of transactions; at-least-once uses
it as it is.

What this adds:
- `write_gate`: the output thread holds it while it takes a batch's live records and produces
  them (`gated`, wrapped around the output stage's batch handler); the transaction loop holds it
  while it replaces the offset state and aborts, so no record of an aborted transaction can be
  produced after the abort, into the next one.
- failed-write routing (`fail_writes_into`): a failed write fails its transaction, not the worker.
  librdkafka has then made the transaction abortable (an OUT_OF_ORDER_SEQUENCE_NUMBER after a
  broker restart, a record the broker refused): it sends nothing more of it, and a produce into it
  fails with _STATE. The record is given up (`given_up`: it leaves the in-flight table with its
  offset left unfinished), the transaction loop aborts at once and consumes the records again, so
  nothing is written twice; it bounds how often (worker/ledger/exactly_once/transactions.py). The failure is
  reported before the record leaves the table: the poll thread commits once nothing is in flight,
  so it must not see the table without the record while the failure is not yet known (issue 32,
  finding 4). Authorisation and missing-topic errors, and fatal ones, still stop the worker
  (the plain producer decides those first); except _FENCED and INVALID_TXN_STATE
  (errors.py `TAKEN_OVER_FATAL`), raised from poll, which go to the transaction loop like a failed
  write: the broker may have timed the transaction out, or its coordinator moved (an outage), and a
  new producer may take over (worker/ledger/exactly_once/transactional_calls.py `fatal` decides).
  Records an abort_transaction purged from the queue (PURGED) are given up too, failing nothing.
- the client take-over (`replace_client`, under the write gate): a transactional call hung inside
  librdkafka (a coordinator's node died). A new librdkafka producer with the same configuration
  takes over, and its init_transactions fences the old one. The old one is abandoned, not closed: a
  thread is still blocked inside it. It is never polled again, so none of its callbacks run (its
  records' reports, its fenced error), and its error callback is muted in case one already queued
  runs. Once the blocked call returns, a short-lived thread of its own ("kwe-retire-producer")
  drops the last reference (librdkafka's destroy can block; never on the delivery thread).

Threads: `write`/`produce` from the producing threads (poll thread for dead letters, output
thread for embeddings); failure reports from the thread that saw them (a producing thread, or the
delivery thread for delivery reports and poll errors); `replace_client` and `drop_revoked` from
the poll thread (the transaction loop), under the write gate. The counters are counts only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, TypeVar

import structlog
from confluent_kafka import KafkaError

from worker.ledger.exactly_once.errors import TAKEN_OVER_FATAL
from worker.ledger.offsets import PartitionOffsets
from worker.kafka.producer import Headers, OutputProducer, describe

log = structlog.get_logger(__name__)

# Delivery reports of records an abort_transaction purged from the queue: not failures (the
# records belonged to the aborted transaction, their input offsets stay unfinished).
PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})

# Releases a record that will never be delivered; the callable it is given (the failed write's
# report) runs first when the record belongs to the open transaction. True if it did.
GiveUp = Callable[[Callable[[], None]], bool]
T = TypeVar("T")
# How often a retiring thread looks whether the delivery thread has moved on to the new client.
RETIRE_POLL_S = 0.01


class InFlightRecord(Protocol):
    part: PartitionOffsets


class InFlightRecords(Protocol):
    """The in-flight table (worker/ledger/inflight.py `InFlightTable`), as far as releasing records goes."""

    def get(self, seq: int) -> InFlightRecord | None: ...
    def finish(self, seq: int) -> InFlightRecord | None: ...
    def remove_revoked(self) -> int: ...


def nothing() -> None:
    """What a released record reports when its release fails nothing (purged by an abort)."""


class ExactlyOnceProducer:
    def __init__(self, producer: OutputProducer, inflight: InFlightRecords) -> None:
        self._producer = producer
        self._inflight = inflight
        self.write_gate = threading.Lock()
        # Where a failed write goes instead of the latch (set once, before start).
        self._fail_transaction: Callable[[str], None] | None = None
        # Records purged by an aborted transaction, and given up after a failed write.
        self.purged = 0
        self.given_up = 0
        # Clients replaced after a hung call: the threads retiring them, and how many were replaced.
        self._retiring: list[threading.Thread] = []
        self.replaced = 0
        producer.route_fatal(self._fatal)

    # ------------------------------------------------------------------ the plain producer's surface
    @property
    def client(self) -> Any:
        """The librdkafka producer, for the transactional calls (poll thread only)."""
        return self._producer.client

    @property
    def thread(self) -> threading.Thread:
        return self._producer.thread

    def start(self) -> None:
        self._producer.start()

    def flush(self, deadline: Any) -> int:
        return self._producer.flush(deadline)

    def interrupt(self) -> None:
        self._producer.interrupt()

    def stop(self, timeout_s: float) -> None:
        self._producer.stop(timeout_s)

    # ------------------------------------------------------------------ writes
    def gated(self, handle: Callable[[T], None]) -> Callable[[T], None]:
        """`handle` run under the write gate: an abort cannot fall between choosing a batch's live
        records and producing them."""
        def under_gate(item: T) -> None:
            with self.write_gate:
                handle(item)
        return under_gate

    def write(self, seq: int, topic: str, key: bytes | None, value: bytes, headers: Headers,
              on_delivered: Callable[[], None]) -> bool:
        """The output stage's and dead letters' write of in-flight record `seq`."""
        # One bound method a record, its release made only if the write fails: two closures a
        # record here were part of what exactly-once cost over at-least-once at host-path speed.
        return self._producer.produce(topic, key, value, headers, on_delivered, partial(self._failed_record, seq))

    def _failed_record(self, seq: int, err: KafkaError, why: str) -> bool:
        return self._failed(err, why, self.release(seq))

    def produce(self, topic: str, key: bytes | None, value: bytes, headers: Headers,
                on_delivered: Callable[[], None], on_given_up: GiveUp = lambda fail: False) -> bool:
        """OutputProducer.produce, with a failed write given up (`on_given_up`) instead of stopping
        the worker where it only fails the open transaction. True for a record given up so: it is
        accounted for."""
        return self._producer.produce(topic, key, value, headers, on_delivered,
                                      lambda err, why: self._failed(err, why, on_given_up))

    def release(self, seq: int) -> GiveUp:
        """The release of in-flight record `seq`, which will never be delivered: it leaves the
        table with its offset not done; True if it belonged to a live offset state (the open
        transaction), False if that state was already replaced (an aborted transaction's). `fail`
        runs for a live record before the record leaves the table (see the module docstring)."""
        def release(fail: Callable[[], None] = nothing) -> bool:
            rec = self._inflight.get(seq)
            live = rec is not None and not rec.part.revoked
            if live:
                fail()
            self._inflight.finish(seq)
            return live
        return release

    def fail_writes_into(self, fail_transaction: Callable[[str], None]) -> None:
        """A failed write calls `fail_transaction(reason)`, from the thread that saw it, instead of
        stopping the worker. Set before `start`."""
        self._fail_transaction = fail_transaction

    def _failed(self, err: KafkaError, why: str, on_given_up: GiveUp) -> bool:
        """A write failed (not for a reason that stops the worker anyway): True when it only fails
        the open transaction, or belonged to an aborted one."""
        if err.code() in PURGED:
            self.purged += 1
            on_given_up(nothing)
            return True
        if self._fail_transaction is None or err.fatal():
            return False
        self.given_up += 1
        # Reported before the record leaves the in-flight table (see GiveUp); a record of an
        # already aborted transaction (its state was replaced) fails nothing.
        fail = self._fail_transaction
        on_given_up(lambda: fail(why))
        return True

    def _fatal(self, err: KafkaError) -> bool:
        """The delivery thread's poll raised a fatal error: one the coordinator may explain
        (`TAKEN_OVER_FATAL`) goes to the transaction loop."""
        if self._fail_transaction is None or err.code() not in TAKEN_OVER_FATAL:
            return False
        # The transaction loop tells a broker-side timeout from a zombie, and a new producer may take
        # over (worker/ledger/exactly_once/take_over.py); its calls raise the same error. Failing the open
        # transaction makes it look now, not after a drain that cannot end.
        log.warning("producer fenced or its transaction ended by the coordinator; the transaction loop "
                    "decides whether a new producer takes over", error=describe(err))
        self._fail_transaction(f"the producer's transaction cannot go on: {describe(err)}")
        return True

    # ------------------------------------------------------------------ take-over
    def replace_client(self, stuck: threading.Thread) -> Any:
        """A new librdkafka producer replaces the current one, which a transactional call (running on
        `stuck`) never returned from; returns the new one. The caller holds `write_gate` (no produce
        races the swap) and calls init_transactions on it next. The old client goes from the swap
        straight into the retiring thread's arguments: no name here holds it, so its last reference
        ends on that thread, whichever thread finishes first."""
        retire = threading.Thread(target=_retire, args=(self._producer.renew_client(), stuck, self._producer),
                                  name="kwe-retire-producer", daemon=True)
        self._retiring = [t for t in self._retiring if t.is_alive()] + [retire]
        retire.start()
        self.replaced += 1
        return self._producer.client

    @property
    def abandoned(self) -> int:
        """Replaced clients not yet retired (their blocked call still running)."""
        return sum(t.is_alive() for t in self._retiring)

    def drop_revoked(self) -> int:
        """The in-flight records handed to a replaced client, whose reports will never come (their
        partitions are consumed again)."""
        return self._inflight.remove_revoked()


def _retire(client: Any, stuck: threading.Thread, producer: OutputProducer) -> None:
    """Waits for the call blocked in `client` to return, and for the delivery thread to be done with
    it (a poll of it under way when it was replaced); the last reference goes with this thread
    (rd_kafka_destroy may wait on the dead broker's connections: never on the delivery thread)."""
    if stuck.ident is not None:  # (a fenced producer's take-over may name a call never started)
        stuck.join()
    renewed = producer.generation
    while producer.served_generation < renewed and producer.thread.is_alive():
        time.sleep(RETIRE_POLL_S)
    del client
