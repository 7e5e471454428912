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

AtLeastOnce (worker/ledger/at_least_once.py, over the committer) states:
    running --finish--> finished
  (what each state does is written at the top of worker/ledger/at_least_once.py).

ExactlyOnce (worker/ledger/exactly_once/loop.py: the transaction loop;
worker/ledger/exactly_once/transactions.py has its states idle -> open -> closing -> idle, and the
abort path) states there:
    created --start--> running --finish--> finished
  (what each state does is written once, at the top of worker/ledger/exactly_once/loop.py). Its
  writes go through the exactly-once producer (worker/ledger/exactly_once/producer.py: the write gate around
  each batch, failed writes into the transaction, the client take-over).

`build_delivery` is the one place that picks the guarantee's delivery, between the two peers (their
client configuration is worker/kafka/client_config.py's); at-least-once is built from only what it
uses (the committer and the producer) and loads no exactly-once code.
"""

from __future__ import annotations

from typing import Any

from worker.deadline import Deadline
from worker.ledger.at_least_once import AtLeastOnce
from worker.ledger.base import AroundBatch, Delivery, Phase, Serve
from worker.ledger.inflight import InFlightTable
from worker.ledger.committer import Committer
from worker.kafka.producer import OutputProducer
from worker.latch import FatalLatch
from worker.operations.metrics import Metrics
from worker.settings.schema import Settings

__all__ = ["AroundBatch", "Delivery", "Phase", "Serve", "build_delivery"]


def build_delivery(settings: Settings, committer: Committer, producer: OutputProducer, consumer: Any,
                   latch: FatalLatch, in_flight: InFlightTable, metrics: Metrics, stop: Deadline) -> Delivery:
    """The guarantee's delivery; at-least-once takes only the committer and the producer."""
    if settings.processing_guarantee != "exactly-once":
        return AtLeastOnce(committer, producer)
    from worker.ledger.exactly_once.loop import ExactlyOnce

    return ExactlyOnce.build(settings, committer, producer, consumer, latch, in_flight, metrics, stop)
