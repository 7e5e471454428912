"""Exactly-once: the transaction loop (KIP-447) around the pipeline's outputs and input offsets.

One transaction per `transaction_interval_ms`: it holds the output records and dead letters
of every record consumed into it, and the input offsets after them (send_offsets_to_transaction
with the consumer's group metadata, so the broker fences a member of an older generation).

Rule: a transaction is closed only when everything consumed into it is finished. When the
interval is up (or sooner, in a lull: LULL_CLOSE_S), intake pauses, the pipeline drains (the
in-flight table empties: every output acknowledged), then each partition's next offset is sent
and the transaction committed; the next one begins with the next consumed record. So the
outputs in a transaction are exactly those of the offsets it commits: there is no record whose
output is committed and whose offset is not, or the reverse. The cost is the drain bubble once
per interval (docs/delivery.md).

Errors of the transactional calls (worker/ledger/exactly_once/transactional_calls.py has the rules and why):
retriable: retried, or resumed (commit and abort); txn_requires_abort: abort, then rewind every
partition with work in the transaction to where it began, with fresh offset state; fatal: the
latch trips, except a `_FENCED` the broker's transaction timeout explains, or an INVALID_TXN_STATE
(errors.py `TAKEN_OVER_FATAL`), which a new producer
takes over (worker/ledger/exactly_once/take_over.py), as it does a hung call
(worker/ledger/exactly_once/bounded_calls.py).
A stop during a take-over or an unfinished call halts the member (`_halt`).

States (`state`), on the poll thread:

    idle --ensure_open--> open --interval up--> closing --drained: commit--> idle
    open|closing --abort (failed write, revoke, lost, commit refused)--> idle (rewound)
    open|closing --call hung / fenced past the timeout--> take-over --> idle (rewound)
    any --stop during a take-over or an unfinished call--> halted (nothing more begins)

Every wait is bounded by a `Deadline` on the injected clock, within the stop deadline.

A failed write (worker/ledger/exactly_once/producer.py: a delivery error, or a produce refused with
_STATE once librdkafka made the transaction abortable) arrives through `write_failed` from the
thread that saw it (into worker/ledger/exactly_once/write_failures.py's mailbox), before its record leaves the
in-flight table (ExactlyOnceProducer.release), so a commit, which waits for the table to empty,
always sees it. The next `step` (or a commit about to happen) aborts and rewinds at once, without
waiting for the pipeline to drain: librdkafka sends nothing more of an abortable transaction, so
its queued records would only come back when abort_transaction purges them. The abort holds the
producer's write gate, so no record of the aborted transaction is produced after it. Lost partitions
abort so too, at once (`lost`): waiting for their records, which may stay in flight up to
message.timeout.ms, let the abort land after the broker's own transaction timeout (issue 57). Intake then
waits 0.5, 1, 2 and 4 s before the next tries; the fifth failed transaction in a row stops the
worker (a write that keeps failing is not transient: a record the topic refuses, for instance).

Threads: everything here runs on the poll thread (including the rebalance callbacks, which
librdkafka serves inside consume), but `write_failed`, which only posts to the failed-write
mailbox (its own lock). The output and delivery threads only produce and acknowledge; `begin`
happens before any record of a transaction is consumed and `commit`/`abort` only once none is left
in flight, so no produce can race a state change of the transaction.

Over 400 lines because it is one state machine, every transition on one Deadline; its calls,
rewinds, take-overs and failed writes are in the modules beside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import structlog
from confluent_kafka import KafkaException, TopicPartition

from worker.deadline import Deadline
from worker.ledger.exactly_once.bounded_calls import BoundedCalls
from worker.ledger.exactly_once.errors import TransactionError, TransactionFencedError, TransactionHungError
from worker.ledger.exactly_once.loss_bound import abortable_after_loss_s
from worker.ledger.exactly_once.rewind import GroupConsumer, fresh_state, seek
from worker.ledger.exactly_once.take_over import FENCE_SETTLE_S, Fence, TakeOverReason, take_over
from worker.ledger.exactly_once.transactional_calls import (
    RETRIES,
    CallResult,
    TransactionalProducer,
    bounded,
    call,
    call_timeout,
    fatal,
    kind_of,
)
from worker.ledger.exactly_once.write_failures import WRITE_FAILURES, WRITE_RETRY_BACKOFF_S, WriteFailures
from worker.ledger.offsets import OffsetTracker, PartitionOffsets
from worker.latch import FatalLatch

log = structlog.get_logger(__name__)

State = Literal["idle", "open", "closing"]
# A transaction this old whose records are all finished closes before its interval: nothing is left
# to drain, so the close costs only its calls, and a backlog's last outputs become visible when
# done instead of up to transaction_interval_ms later. The age keeps a trickle (finished between
# polls) to ten transactions a second, as Kafka Streams' exactly-once default of 100 ms does.
LULL_CLOSE_S = 0.1
# taken_over: a hung call's transaction, ended by the producer that replaced the hung one (committed
# if its commit had reached the coordinator, else aborted).
Outcome = Literal["committed", "aborted", "taken_over"]
__all__ = ["FENCE_SETTLE_S", "RETRIES", "WRITE_FAILURES", "WRITE_RETRY_BACKOFF_S", "TransactionError",
           "TransactionFencedError", "TransactionHungError", "Transactions", "drained_waiter", "kind_of", "wait_until"]


@dataclass
class Transactions:
    producer: TransactionalProducer
    consumer: GroupConsumer
    tracker: OffsetTracker
    latch: FatalLatch
    in_flight: Callable[[], int]
    interval_s: float
    timeout_s: float = 10.0
    transaction_timeout_s: float = 60.0
    on_outcome: Callable[[Outcome, float], None] = lambda outcome, seconds: None
    # The commit point moved (for the stall check of /healthz).
    on_progress: Callable[[], None] = lambda: None
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    # The shutdown deadline (infinite until a stop): no transactional call, retry or wait runs past it.
    stop: Deadline = field(default_factory=Deadline)
    # Held while the offset state is replaced and the transaction aborted (ExactlyOnceProducer.write_gate).
    write_gate: AbstractContextManager[Any] = field(default_factory=nullcontext)
    # After a hung call: a new producer replaces `producer` (given the thread still blocked in the
    # old one; ExactlyOnceProducer.replace_client), and the in-flight records of revoked offset state
    # are forgotten (ExactlyOnceProducer.drop_revoked): the old producer will never report them. None:
    # a hung call stops the member.
    replace_producer: Callable[[threading.Thread], TransactionalProducer] | None = None
    forget_revoked: Callable[[], int] = lambda: 0
    # A new producer starts taking over, and why (kwe_producer_take_overs_total).
    on_take_over: Callable[[TakeOverReason], None] = lambda reason: None
    taken_over: int = 0
    taken_over_fenced: int = 0
    state: State = "idle"
    began_at: float = 0.0
    closing_at: float = 0.0  # when the open transaction began to close (its drain's start)
    committed: int = 0
    aborted: int = 0
    _abort_reason: str | None = field(default=None, repr=False)
    # A failed write, reported from the output or delivery thread, and the retry bookkeeping.
    _writes: WriteFailures = field(default_factory=WriteFailures, repr=False)
    # The threads still blocked in calls of replaced producers; the last hung call's error.
    _stuck: list[threading.Thread] = field(default_factory=list, repr=False)
    _hung: TransactionHungError | None = field(default=None, repr=False)
    # A stop came while a transaction could not be ended or rewound (`_halt`).
    _halted: bool = field(default=False, repr=False)
    # The open transaction's partitions were lost: its abort goes at once, its age checked again (`lost`).
    _lost: bool = field(default=False, repr=False)
    # The transactional calls, on helper threads (the last one's thread a take-over may hand on).
    _calls: BoundedCalls = field(default_factory=BoundedCalls, repr=False)
    # A fence waiting for its take-over, and when the recent fenced take-overs began.
    _fence: Fence | None = field(default=None, repr=False)
    _fenced_at: list[float] = field(default_factory=list, repr=False)

    # ------------------------------------------------------------------ lifecycle
    def init(self, timeout_s: float = 30.0) -> bool:
        """Fences an older incarnation of this member and aborts its open transaction. False when
        a stop came first (each try is short, so a SIGTERM during it is honoured within a second)."""
        limit = Deadline.after(timeout_s, self.clock)
        while True:
            if self.stop.started:
                log.info("stopped before transactions were initialised")
                return False
            try:
                self.producer.init_transactions(max(0.5, limit.capped(1.0)))
                return True
            except KafkaException as exc:
                if kind_of(exc) == "retry" and not limit.expired():
                    log.warning("init_transactions failed; retrying", error=str(exc.args[0]))
                    self.sleep(0.5)
                    continue
                error = TransactionFencedError if kind_of(exc) == "fatal" else TransactionError
                raise error(f"could not initialise transactions: {exc.args[0]}") from exc

    @property
    def closing(self) -> bool:
        """Intake must stay paused: the open transaction waits for its records to finish, or a
        failed write's abort, or the wait before its retry."""
        return (self.state == "closing" or self._abort_reason is not None or self._writes.pending() or self._halted
                or self._fence is not None or self.clock() < self._writes.resume_at)

    def write_failed(self, reason: str) -> None:
        """Any thread: a write of the open transaction failed; it is aborted at the next step."""
        self._writes.report(reason)

    def _aborted_on_failed_write(self) -> bool:
        """If a write failed the open transaction: aborts it now and returns True."""
        if (reason := self._writes.take()) is None:
            return False
        self._abort_failed_write(reason)
        return True

    def _abort_failed_write(self, reason: str) -> None:
        """Aborts and rewinds now (see the module docstring), or stops after WRITE_FAILURES in a row."""
        if not self._writes.count():
            self.latch.trip(TransactionError(
                f"writes failed {self._writes.in_row} transactions in a row; the last: {reason}"))
            return
        self.abort_and_rewind(reason)
        self._writes.back_off(self.clock())

    def ensure_open(self) -> None:
        """Called with consumed records before intake sees them: they belong to an open transaction."""
        if self.state == "idle" and not self.latch.is_set() and not self._halted:
            try:
                self.producer.begin_transaction()
            except KafkaException as exc:
                if kind_of(exc) != "fatal":
                    raise
                # Fenced with no transaction open: no broker timeout explains it (`_fatal`).
                fatal(self, "begin_transaction", exc)
                return
            self.state = "open"
            self.began_at = self.clock()

    def request_abort(self, reason: str) -> None:
        """Abort at the next `step` (its outputs must not commit)."""
        if self.state != "idle" and self._abort_reason is None:
            self._abort_reason = reason

    def abortable_after_loss_s(self) -> float:
        """How old an open transaction may be when the partitions are lost and still be aborted
        (worker/ledger/exactly_once/loss_bound.py: the abort's bound before the broker's timeout;
        the session and transaction timeout pair that leaves an outage past the session room for
        it is checked at start there)."""
        return abortable_after_loss_s(self.transaction_timeout_s, self.timeout_s)

    def lost(self) -> None:
        """Partitions lost (the group took them: this member looked dead, a session timeout or a
        broker outage). The open transaction must not commit. When the broker cannot have timed
        it out before the abort lands (`abortable_after_loss_s`): abort it at the next step and
        rewind, without waiting for the pipeline to drain (records can stay in flight up to
        message.timeout.ms, past the broker's timeout; abort_transaction purges them), its age
        checked again as it is sent. Otherwise stop: aborting a transaction the broker timed out
        makes librdkafka bump the producer epoch (KIP-588), which fences the successor that runs
        with the same transactional id (measured); the successor, or the broker, aborts what was
        left open."""
        if self.state == "idle":
            return
        # (A fenced producer waiting for its take-over has an old transaction: the group's verdict,
        # this member is a zombie, wins over the take-over.)
        if not self._too_old_after_loss():
            self._lost = True
            self.request_abort("partitions lost")

    def _too_old_after_loss(self) -> bool:
        """True, with the member stopped as a zombie (see `lost`), when the open transaction is too
        old for an abort after its partitions were lost."""
        age_s = self.clock() - self.began_at
        if age_s < self.abortable_after_loss_s():
            return False
        self.latch.trip(TransactionFencedError(
            f"partitions lost with a transaction open {age_s:.0f} s, too close to "
            f"transaction_timeout_ms ({self.transaction_timeout_s:.0f} s) for an abort: this member was "
            "considered dead (a zombie); it stops without aborting, its successor or the broker aborts "
            "the transaction"))
        return True

    def step(self) -> None:
        """One poll-loop turn: start closing when the interval is up, or LULL_CLOSE_S in with
        nothing in flight; commit once drained; abort when asked to. (Not when flow control
        pauses: its bound counts the records not yet acknowledged, which a commit does not free.)"""
        if self.latch.is_set():
            return
        if self._fence is not None:
            if self.clock() >= self._fence.take_over_at:
                self.take_over(self._fence.starts, reason="fenced")
            return
        if self.state == "idle":
            # A failure reported for an already aborted transaction's record fails nothing here.
            self._writes.take()
            return
        if self._aborted_on_failed_write():
            return
        if self._abort_reason is not None:
            if self._lost or self.in_flight() == 0:
                self.abort_and_rewind(self._abort_reason)
            return
        age_s = self.clock() - self.began_at
        if self.state == "open" and (age_s >= self.interval_s
                                     or (age_s >= min(LULL_CLOSE_S, self.interval_s) and self.in_flight() == 0)):
            self.state = "closing"
            self.closing_at = self.clock()
        if self.state == "closing" and self.in_flight() == 0:
            self.commit()

    # ------------------------------------------------------------------ closing
    def _offsets(self) -> list[tuple[PartitionOffsets, int]]:
        return [(p, off) for p in self.tracker.partitions() if (off := p.to_commit()) is not None]

    def commit(self) -> bool:
        """Sends the offsets and commits; everything consumed must be finished. True if committed."""
        assert self.in_flight() == 0, "a transaction is committed only when nothing is in flight"
        if self._aborted_on_failed_write():
            # Reported before its record left the in-flight table, so seen here at the latest.
            return False
        offsets = self._offsets()
        drained_at = self.clock()
        positions = [TopicPartition(p.topic, p.partition, off) for p, off in offsets]
        result: CallResult = "ok"
        if positions:
            metadata = self.consumer.consumer_group_metadata()
            # Not resumable (rd_kafka_send_offsets_to_transaction returns non-resumable): an
            # abort after its retries is allowed.
            result = call(self, "send_offsets_to_transaction",
                          lambda: self.producer.send_offsets_to_transaction(positions, metadata, call_timeout(self)))
        if result == "ok":
            # Resumed for as long as the coordinator may still complete it: past the transaction
            # timeout it aborts the transaction itself.
            result = call(self, "commit_transaction", lambda: self.producer.commit_transaction(call_timeout(self)),
                          resume_s=self.transaction_timeout_s)
        if result == "unfinished":
            self._halt("commit_transaction was still under way")
            return False
        if result == "abort":
            self.abort_and_rewind("the transaction could not be committed")
            return False
        if result == "hung":
            self.take_over()
            return False
        if result in ("fatal", "fenced"):
            return False
        for p, off in offsets:
            p.request_commit(off)
            p.confirm_commit(off)
        if offsets:
            self.on_progress()
        self._writes.committed()
        log.debug("transaction committed", offsets=[f"{p.topic}[{p.partition}]@{off}" for p, off in offsets],
                  drain_s=round(drained_at - self.closing_at, 4) if self.closing_at > self.began_at else None,
                  calls_s=round(self.clock() - drained_at, 4))
        self._finish("committed")
        return True

    def abort_and_rewind(self, reason: str) -> None:
        """Aborts the open transaction and sends every owned partition back to where it began.

        Fresh offset state per partition (the old one is marked revoked), so a late completion of
        a record of the aborted transaction is dropped instead of produced into the next one.
        """
        with self.write_gate:
            if self._lost and self._too_old_after_loss():
                return  # checked as the abort goes: the wait for the write gate counts too
            starts = fresh_state(self.tracker)
            aborted = call(self, "abort_transaction", lambda: self.producer.abort_transaction(call_timeout(self)),
                           resume_s=self.transaction_timeout_s)
        if aborted == "hung":
            self.take_over(starts)
            return
        if aborted == "unfinished":
            self._halt("abort_transaction was still under way")
            return
        if aborted == "fenced" and self._fence is not None:
            self._fence = replace(self._fence, starts=starts)
            return
        if aborted != "ok":
            # "fatal" tripped the latch already (fenced, or hung); otherwise the abort failed on its own.
            if not self.latch.is_set():
                self.latch.trip(TransactionError(f"the transaction could not be aborted ({reason})"))
            return
        rewind = [TopicPartition(topic, partition, start) for (topic, partition), start in starts.items()]
        seek(self.consumer, self.tracker, rewind)
        log.warning("transaction aborted; partitions rewound", reason=reason,
                    partitions=[f"{tp.topic}[{tp.partition}]@{tp.offset}" for tp in rewind])
        self._finish("aborted")

    def take_over(self, starts: dict[tuple[str, int], int] | None = None, *,
                  reason: TakeOverReason = "hung") -> None:
        """A new producer takes over (worker/ledger/exactly_once/take_over.py), or the member stops."""
        take_over(self, starts, reason)

    def _halt(self, during: str) -> None:
        """A stop came while the transaction could not be ended and the partitions rewound: during
        a take-over (issue 32, finding 1), or with a commit or abort still under way in librdkafka.
        The fetch positions are past the transaction's records, whose outputs may be aborted (or
        not yet ended), and the producer may not be initialised: a record consumed now and
        committed by the drain would commit offsets past records with no output. So nothing more
        is consumed or begun: every partition's offset state is dropped (intake skips records of a
        partition without one), no transaction is begun, intake stays paused, and the member exits
        as usual; the group's committed offsets are where its successor starts (its
        init_transactions ends what is still under way)."""
        self._halted = True
        dropped = [f"{p.topic}[{p.partition}]" for p in self.tracker.partitions()]
        for p in self.tracker.partitions():
            self.tracker.revoke(p.topic, p.partition)
        log.warning("stopping with the transaction unfinished: nothing more is consumed or committed; the "
                    "partitions resume from the group's committed offsets", during=during, partitions=dropped)

    def _give_up(self, hung: TransactionHungError, why: str) -> None:
        self.latch.trip(TransactionHungError(f"{hung}; {why}", hung.call))

    def _finish(self, outcome: Outcome) -> None:
        seconds = self.clock() - self.began_at
        self.state = "idle"
        self._abort_reason = None
        self._lost = False
        if outcome == "committed":
            self.committed += 1
        elif outcome == "aborted":
            self.aborted += 1
        else:
            self.taken_over += 1
        self.on_outcome(outcome, seconds)

    # ------------------------------------------------------------------ rebalances, shutdown
    def on_revoke(self, wait_drained: Callable[[float], bool], wait_s: float) -> bool:
        """Before partitions go: commit the open transaction if everything in it finishes within
        wait_s, else abort it (and rewind the partitions that stay). True if committed or idle."""
        if self.state == "idle":
            return True
        if self.latch.is_set() or self._fence is not None:
            # Fenced: nothing of it commits; the take-over rewinds the partitions that stay.
            return False
        if self._abort_reason is None and wait_drained(wait_s):
            return self.commit()
        if self._aborted_on_failed_write():
            # Its records wait in librdkafka until the abort: they would never drain.
            return False
        self._abort_after_drain(wait_drained, "partitions revoked before the transaction finished")
        return False

    def _abort_after_drain(self, wait_drained: Callable[[float], bool], reason: str) -> None:
        # Records still in flight would be produced into the next transaction otherwise: mark
        # their offset state revoked (the output stage drops them) and wait for the rest.
        for p in self.tracker.partitions():
            if p.first is not None:  # the ones `abort_and_rewind` gives fresh state
                p.revoked = True
        if not wait_drained(min(self.timeout_s, self.stop.left())):
            if self._aborted_on_failed_write():
                return
            if self.stop.started:
                # Stopping: `finish` aborts it (stopping all writes first), within the deadline.
                self._abort_reason = reason
                return
            self.latch.trip(TransactionError(
                f"the transaction could not be aborted cleanly ({reason}): records stayed in flight"))
            return
        self.abort_and_rewind(reason)

    def finish(self, wait_drained: Callable[[float], bool], wait_s: float,
               stop_writes: Callable[[], None] = lambda: None) -> None:
        """Shutdown: commit if everything drains within wait_s, else abort, so no open transaction
        holds back read_committed readers until it times out. After a fatal error: abort, best
        effort (a fenced producer cannot; the broker or the successor aborts it)."""
        if self.state == "idle":
            return
        if self._fence is not None:
            # The fenced producer can neither commit nor abort; the new producer was not made yet.
            self._halt("a fenced producer's take-over was pending")
            return
        drained = not self.latch.is_set() and self._abort_reason is None and wait_drained(wait_s)
        if self.state == "idle":
            # A revoke served while waiting (the group rebalanced during the drain) closed it.
            return
        if drained:
            self.commit()
            return
        if isinstance(self.latch.error, TransactionFencedError) or (self._lost and self._too_old_after_loss()):
            return  # a zombie does not abort (see `lost`): its successor or the broker does
        # Whatever is still in flight is not written after the abort (it would fail: no
        # transaction is open), and records it purges are not delivery errors (exactly_once_producer.PURGED).
        stop_writes()
        try:
            # No rewind and no wait for what is in flight: no later transaction follows, so a
            # straggler cannot be produced into one.
            bounded(self, "abort_transaction", lambda: self.producer.abort_transaction(min(call_timeout(self), 2.0)),
                    grace_s=1.0)
            self._finish("aborted")
        except (KafkaException, TransactionHungError) as exc:
            log.info("open transaction not aborted on the way out", error=str(exc))


def wait_until(check: Callable[[], bool], serve: Callable[[float], None], deadline: Deadline) -> bool:
    """Serves the group (or sleeps) until check() holds or `deadline` passes (re-read each turn)."""
    while not check():
        if deadline.expired():
            return False
        serve(0.01)
    return True


def drained_waiter(in_flight: Callable[[], int], serve: Callable[[float], None],
                   stop: Deadline | None = None, clock: Callable[[], float] = time.monotonic) -> Callable[[float], bool]:
    """A wait_drained for `Transactions`: until nothing is in flight, at most the given seconds
    (on `stop`'s clock, or `clock` without one) and never past `stop`, re-read while waiting."""
    within = stop if stop is not None else Deadline(clock)
    return lambda timeout_s: wait_until(lambda: in_flight() == 0, serve, within.limited(timeout_s))
