"""Delivery: everything that differs between the two processing guarantees, behind one interface.

`Pipeline` calls a `Delivery` at fixed points of its loop and never asks which guarantee runs
(the model is Quix Streams' Checkpoint: the loop commits, only the checkpoint knows how):

    start()              before intake: exactly-once fences an older incarnation (init_transactions)
    poll_step(paused)    each poll-loop turn, before consuming: commit when due; returns why intake
                         pauses (flow control, a transaction closing), or None
    before_intake()      records were consumed: exactly-once opens a transaction for them
    on_revoke(parts, s)  inside the revoke callback: commit what is finished (True) or give up
    on_lost()            partitions lost: commit nothing of theirs
    drain_step()         each turn of the final drain
    finish(...)          at exit, within the shutdown deadline
    summary()            for the final log line

AtLeastOnce (the committer; worker/kafka/committer.py) states:
    running --finish--> finished
  running: poll_step commits asynchronously at most once per commit interval; on_revoke commits
  the revoked partitions' finished work synchronously; on_lost drops nothing but the state.
  finish: commits all finished work, retrying until confirmed or the deadline (after an abort:
  nothing); finished: no more commits.

ExactlyOnce (the transaction loop; worker/kafka/transactions.py has its states idle -> open ->
closing -> idle, and the abort path) states here:
    created --start--> running --finish--> finished
  start: init_transactions (bounded by the stop deadline: a SIGTERM during it ends it);
  running: poll_step steps the transaction (closing when the interval is up or flow control
  pauses, commit once drained, abort when asked) and pauses intake while one closes;
  before_intake opens a transaction; on_revoke commits or aborts it; on_lost aborts a young one
  or stops a zombie; finish commits if it drains within the deadline, else stops all writes and
  aborts.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

from worker.config import Settings
from worker.deadline import Deadline
from worker.inflight import InFlightTable
from worker.kafka.committer import Committer
from worker.kafka.offsets import PartitionOffsets
from worker.kafka.producer import OutputProducer
from worker.kafka.transactions import Transactions, drained_waiter, transactional_config
from worker.latch import FatalLatch
from worker.metrics import Metrics

Serve = Callable[[float], None]
Phase = Literal["created", "running", "finished"]
# The at-least-once revoke commit: at most this long inside the callback.
REVOKE_COMMIT_S = 5.0


class Delivery(Protocol):
    phase: Phase

    def start(self) -> None: ...
    def poll_step(self, *, flow_paused: bool) -> str | None: ...
    def before_intake(self) -> None: ...
    def on_revoke(self, parts: list[PartitionOffsets], wait_s: float) -> bool: ...
    def on_lost(self) -> None: ...
    def drain_step(self) -> None: ...
    def finish(self, deadline: Deadline, serve: Serve, *, drained: bool, aborted: bool) -> None: ...
    def summary(self) -> dict[str, Any]: ...


class AtLeastOnce:
    def __init__(self, committer: Committer) -> None:
        self._committer = committer
        self.phase: Phase = "created"

    @classmethod
    def build(cls, settings: Settings, committer: Committer, producer: OutputProducer, consumer: Any,
              latch: FatalLatch, in_flight: InFlightTable, metrics: Metrics, stop: Deadline) -> AtLeastOnce:
        return cls(committer)

    @staticmethod
    def producer_config(config: dict[str, Any], settings: Settings) -> dict[str, Any]:
        return config

    def start(self) -> None:
        self.phase = "running"

    def poll_step(self, *, flow_paused: bool) -> str | None:
        self._committer.maybe_commit()
        return "flow control" if flow_paused else None

    def before_intake(self) -> None:
        pass

    def on_revoke(self, parts: list[PartitionOffsets], wait_s: float) -> bool:
        return self._committer.commit_sync(parts, timeout_s=REVOKE_COMMIT_S, in_callback=True)

    def on_lost(self) -> None:
        pass  # another member may own them already: nothing is committed for them

    def drain_step(self) -> None:
        self._committer.maybe_commit()

    def finish(self, deadline: Deadline, serve: Serve, *, drained: bool, aborted: bool) -> None:
        # Finished work is committed even after a fatal error: each partition commits only up
        # to its lowest unfinished offset, and the failed record is never finished.
        if not aborted and self.phase == "running":
            self._committer.commit_until(deadline, serve)
        self.phase = "finished"

    def summary(self) -> dict[str, Any]:
        return {}


class ExactlyOnce:
    def __init__(self, txn: Transactions, in_flight: Callable[[], int], stop_writes: Callable[[], None]) -> None:
        self.txn = txn
        self._in_flight = in_flight
        self._stop_writes = stop_writes
        self.phase: Phase = "created"

    @classmethod
    def build(cls, settings: Settings, committer: Committer, producer: OutputProducer, consumer: Any,
              latch: FatalLatch, in_flight: InFlightTable, metrics: Metrics, stop: Deadline) -> ExactlyOnce:
        count = in_flight.__len__
        txn = Transactions(producer.client, consumer, committer.tracker, latch, count,
                           interval_s=settings.transaction_interval_ms / 1000.0,
                           transaction_timeout_s=settings.transaction_timeout_ms / 1000.0,
                           on_outcome=metrics.observe_transaction, on_progress=committer.progressed, stop=stop,
                           write_gate=producer.write_gate,
                           # A hung transactional call: a new producer takes over (librdkafka 5456/5511).
                           replace_producer=producer.replace_client, forget_revoked=in_flight.drop_revoked,
                           on_take_over=metrics.count_take_over)
        # A failed write fails the transaction (aborted, its records consumed again), not the worker.
        producer.fail_writes_into(txn.write_failed)
        return cls(txn, count, producer.interrupt)

    @staticmethod
    def producer_config(config: dict[str, Any], settings: Settings) -> dict[str, Any]:
        return transactional_config(config, group=settings.group_id,
                                    member=settings.member_id or socket.gethostname(),
                                    transaction_timeout_ms=settings.transaction_timeout_ms)

    def start(self) -> None:
        if self.txn.init():
            self.phase = "running"

    def poll_step(self, *, flow_paused: bool) -> str | None:
        self.txn.step(flow_paused=flow_paused)
        if self.txn.closing:
            return "closing a transaction"
        return "flow control" if flow_paused else None

    def before_intake(self) -> None:
        self.txn.ensure_open()

    def on_revoke(self, parts: list[PartitionOffsets], wait_s: float) -> bool:
        # Inside the rebalance callback: no consume, so plain sleeps while the pipeline drains.
        return self.txn.on_revoke(drained_waiter(self._in_flight, time.sleep), wait_s)

    def on_lost(self) -> None:
        self.txn.lost()

    def drain_step(self) -> None:
        pass  # the open transaction is closed by finish, once drained

    def finish(self, deadline: Deadline, serve: Serve, *, drained: bool, aborted: bool) -> None:
        # Committed if it drained, else aborted: an open transaction would hold back
        # read_committed readers until transaction_timeout_ms.
        if self.phase == "running":
            self.txn.finish(drained_waiter(self._in_flight, serve, deadline),
                            deadline.left() if drained and not aborted else 0.0, stop_writes=self._stop_writes)
        self.phase = "finished"

    def summary(self) -> dict[str, Any]:
        return {"transactions_committed": self.txn.committed, "transactions_aborted": self.txn.aborted,
                "producers_taken_over": self.txn.taken_over, "producers_taken_over_fenced": self.txn.taken_over_fenced}


def delivery_kind(settings: Settings) -> type[AtLeastOnce] | type[ExactlyOnce]:
    return ExactlyOnce if settings.processing_guarantee == "exactly-once" else AtLeastOnce
