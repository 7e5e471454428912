"""The exactly-once delivery: the transaction loop (worker/ledger/exactly_once/transactions.py) behind the
`Delivery` interface (worker/ledger/guarantees.py), and the exactly-once producer its writes go through
(worker/ledger/exactly_once/producer.py).

States:
    created --start--> running --finish--> finished
  start: init_transactions (bounded by the stop deadline: a SIGTERM during it ends it);
  running: poll_step steps the transaction (closing when the interval is up, commit once drained,
  abort when asked) and pauses intake while one closes; flow control bounds the records not yet
  acknowledged, so acknowledgements, not commits, bring room back;
  before_intake opens a transaction; on_revoke commits or aborts it; on_lost aborts a young one
  or stops a zombie; finish commits if it drains within the deadline, else stops all writes and
  aborts.

Threads: the poll thread calls every method (the revoke callback runs inside consume).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

from worker.deadline import Deadline
from worker.ledger.base import AroundBatch, BoundCounts, Phase, Serve
from worker.ledger.exactly_once.loss_bound import check_session
from worker.ledger.exactly_once.producer import ExactlyOnceProducer
from worker.ledger.exactly_once.transactions import Transactions, drained_waiter
from worker.ledger.inflight import InFlightTable
from worker.ledger.committer import Committer
from worker.ledger.offsets import PartitionOffsets
from worker.kafka.producer import OutputProducer, RecordWriter
from worker.latch import FatalLatch
from worker.operations.metrics import Metrics
from worker.settings.schema import Settings

log = structlog.get_logger(__name__)


class ExactlyOnce:
    guarantee = "exactly-once"

    def __init__(self, txn: Transactions, in_flight: Callable[[], int], producer: ExactlyOnceProducer) -> None:
        self.txn = txn
        self._in_flight = in_flight
        self._producer = producer
        self.writer: RecordWriter = producer
        self.around_batch: AroundBatch | None = producer.gated
        # Counting uncommitted records closed a transaction (and drained the pipeline) every
        # max_in_flight records: 0.2x at-least-once's backlog speed on a static model (issue 59).
        self.bound_counts: BoundCounts = "unacknowledged"
        self.phase: Phase = "created"

    @classmethod
    def build(cls, settings: Settings, committer: Committer, plain: OutputProducer, consumer: Any,
              latch: FatalLatch, in_flight: InFlightTable, metrics: Metrics, stop: Deadline) -> ExactlyOnce:
        count = in_flight.__len__
        producer = ExactlyOnceProducer(plain, in_flight)
        txn = Transactions(producer.client, consumer, committer.tracker, latch, count,
                           interval_s=settings.transaction_interval_ms / 1000.0,
                           transaction_timeout_s=settings.transaction_timeout_ms / 1000.0,
                           on_outcome=metrics.observe_transaction, on_progress=committer.progressed, stop=stop,
                           write_gate=producer.write_gate,
                           # A hung transactional call: a new producer takes over (librdkafka 5456/5511).
                           replace_producer=producer.replace_client, forget_revoked=producer.drop_revoked,
                           on_take_over=metrics.count_take_over)
        # A failed write fails the transaction (aborted, its records consumed again), not the worker.
        producer.fail_writes_into(txn.write_failed)
        # Refused before anything is consumed (`run` checks it before the model loads, too).
        if (warning := check_session(settings)) is not None:
            log.warning("an outage past the session will stop this member", reason=warning)
        return cls(txn, count, producer)

    def start(self) -> None:
        if self.txn.init():
            self.phase = "running"

    def poll_step(self, *, flow_paused: bool) -> str | None:
        self.txn.step()
        if self.txn.closing:
            return "closing a transaction"
        return "flow control" if flow_paused else None

    def relieve(self, target: int) -> bool:
        # Hold, at the bound (acknowledgements bring the room back) and while a transaction closes
        # (its commit does): a pause drops the prefetched records and librdkafka fetches again up to
        # a second later, once per transaction. Paired on a static model's backlog (issue 59),
        # exactly-once / at-least-once keywords/s went from 0.70 pausing to 0.84 holding.
        return True

    def before_intake(self) -> None:
        self.txn.ensure_open()

    def on_revoke(self, parts: list[PartitionOffsets], wait_s: float) -> bool:
        # Inside the rebalance callback: no consume, so plain sleeps while the pipeline drains.
        return self.txn.on_revoke(drained_waiter(self._in_flight, time.sleep), wait_s)

    def on_lost(self) -> bool:
        self.txn.lost()
        return False  # what the lost partitions finished is in a transaction that never commits

    def drain_step(self) -> None:
        pass  # the open transaction is closed by finish, once drained

    def finish(self, deadline: Deadline, serve: Serve, *, drained: bool, aborted: bool) -> None:
        # Committed if it drained, else aborted: an open transaction would hold back
        # read_committed readers until transaction_timeout_ms.
        if self.phase == "running":
            self.txn.finish(drained_waiter(self._in_flight, serve, deadline),
                            deadline.left() if drained and not aborted else 0.0, stop_writes=self._producer.interrupt)
        self.phase = "finished"

    def summary(self) -> dict[str, Any]:
        return {"transactions_committed": self.txn.committed, "transactions_aborted": self.txn.aborted,
                "producers_taken_over": self.txn.taken_over, "producers_taken_over_fenced": self.txn.taken_over_fenced,
                "purged_by_abort": self._producer.purged, "writes_given_up": self._producer.given_up}
