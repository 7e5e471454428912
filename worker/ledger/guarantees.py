"""Delivery: everything that differs between the two processing guarantees, behind one interface.

`Pipeline` calls a `Delivery` at fixed points of its loop and never asks which guarantee runs
(the model is Quix Streams' Checkpoint: the loop commits, only the checkpoint knows how):

    start()              before intake: exactly-once fences an older incarnation (init_transactions)
    poll_step(paused)    each poll-loop turn, before consuming: commit when due; returns why intake
                         pauses (flow control, a transaction closing), or None
    relieve(target)      at the in-flight bound, instead of pausing: whether intake may hold (consume
                         nothing for a while, partitions not paused) because room comes back without a
                         pause; at-least-once commits the finished work synchronously once that brings
                         the uncommitted records to `target`. Exactly-once: False (a transaction frees it)
    before_intake()      records were consumed: exactly-once opens a transaction for them
    on_revoke(parts, s)  inside the revoke callback: commit what is finished (True) or give up
    on_lost()            partitions lost: commit nothing of theirs; True when what they finished
                         stays written (the member may resume after it if given them back)
    drain_step()         each turn of the final drain
    finish(...)          at exit, within the shutdown deadline
    summary()            for the final log line
    writer, around_batch what the output stage and dead letters write through, and what wraps each
                         of the output thread's batches (at-least-once: the plain producer, nothing)

AtLeastOnce (the committer; worker/ledger/committer.py) states:
    running --finish--> finished
  running: poll_step commits asynchronously at most once per commit interval; on_revoke commits
  the revoked partitions' finished work synchronously; on_lost drops nothing but the state (the
  committer remembers what they finished: worker/ledger/committer.py, `remember_lost`).
  finish: commits all finished work, retrying until confirmed or the deadline (after an abort:
  nothing); finished: no more commits.

ExactlyOnce (worker/ledger/exactly_once/loop.py: the transaction loop;
worker/ledger/exactly_once/transactions.py has its states idle -> open -> closing -> idle, and the
abort path) states there:
    created --start--> running --finish--> finished
  (what each state does is written once, at the top of worker/ledger/exactly_once/loop.py). Its
  writes go through the exactly-once producer (worker/ledger/exactly_once/producer.py: the write gate around
  each batch, failed writes into the transaction, the client take-over).

`build_delivery` is the one place that picks the guarantee's delivery (its client configuration is
worker/kafka/client_config.py's); at-least-once is built from
only what it uses (the committer and the producer) and runs no exactly-once code.
"""

from __future__ import annotations

from typing import Any

from worker.deadline import Deadline
from worker.ledger.base import AroundBatch, BoundCounts, Delivery, Phase, Serve
from worker.ledger.inflight import InFlightTable
from worker.ledger.committer import Committer
from worker.ledger.offsets import PartitionOffsets
from worker.kafka.producer import OutputProducer, RecordWriter
from worker.latch import FatalLatch
from worker.operations.metrics import Metrics
from worker.settings.schema import Settings

__all__ = ["AroundBatch", "AtLeastOnce", "Delivery", "Phase", "Serve", "build_delivery"]
# The at-least-once revoke commit: at most this long inside the callback.
REVOKE_COMMIT_S = 5.0
# The commit that frees room at the in-flight bound: at most this long (the poll thread holds
# meanwhile; a coordinator that does not answer ends the hold in a pause instead).
RELIEVE_COMMIT_S = 1.0


class AtLeastOnce:
    def __init__(self, committer: Committer, writer: RecordWriter) -> None:
        self._committer = committer
        self.writer = writer
        self.around_batch: AroundBatch | None = None
        self.bound_counts: BoundCounts = "uncommitted"
        self.phase: Phase = "created"

    def start(self) -> None:
        self.phase = "running"

    def poll_step(self, *, flow_paused: bool) -> str | None:
        self._committer.maybe_commit()
        return "flow control" if flow_paused else None

    def relieve(self, target: int) -> bool:
        self._committer.commit_to_relieve(target, RELIEVE_COMMIT_S)
        return True

    def before_intake(self) -> None:
        pass

    def on_revoke(self, parts: list[PartitionOffsets], wait_s: float) -> bool:
        return self._committer.commit_sync(parts, timeout_s=REVOKE_COMMIT_S, in_callback=True)

    def on_lost(self) -> bool:
        # Another member may own them already: nothing is committed for them now. Their finished
        # records' outputs are acknowledged, so if they come back unmoved that work need not be redone.
        return True

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


def build_delivery(settings: Settings, committer: Committer, producer: OutputProducer, consumer: Any,
                   latch: FatalLatch, in_flight: InFlightTable, metrics: Metrics, stop: Deadline) -> Delivery:
    """The guarantee's delivery; at-least-once takes only the committer and the producer."""
    if settings.processing_guarantee != "exactly-once":
        return AtLeastOnce(committer, producer)
    from worker.ledger.exactly_once.loop import ExactlyOnce

    return ExactlyOnce.build(settings, committer, producer, consumer, latch, in_flight, metrics, stop)
