"""Where a transaction's partitions start again: fresh offset state for an aborted or taken-over
transaction, the group's committed offsets read after a take-over, and the seeks.

Used by the transaction loop (worker/ledger/exactly_once/transactions.py) and the producer take-over
(worker/ledger/exactly_once/take_over.py). Threads: the poll thread only (the consumer is not thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import structlog
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from worker.deadline import Deadline
from worker.ledger.offsets import OffsetTracker

log = structlog.get_logger(__name__)


class GroupConsumer(Protocol):
    def consumer_group_metadata(self) -> Any: ...
    def seek(self, partition: TopicPartition) -> None: ...
    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]: ...


def fresh_state(tracker: OffsetTracker) -> dict[tuple[str, int], int]:
    """Fresh offset state (the old one marked revoked, so a late completion of a record of the
    aborted transaction is dropped) for every partition with work in the transaction; returns
    where each began. The others keep their state and fetch position (a record already
    fetched for them is still the next one). Called under the write gate."""
    starts: dict[tuple[str, int], int] = {}
    for p in tracker.partitions():
        start = p.committed if p.committed is not None else p.first
        if start is not None:
            starts[(p.topic, p.partition)] = start
            tracker.replace(p.topic, p.partition)
    return starts


def seek(consumer: GroupConsumer, tracker: OffsetTracker, positions: list[TopicPartition]) -> None:
    """Rewinds each partition's fetch position, its fresh state beginning there
    (`PartitionOffsets.begin_at`: a reset to the log start that comes before the first record from
    there is then a re-fetch); one not (or no longer) assigned is skipped."""
    for tp in positions:
        state = tracker.get(tp.topic, tp.partition)
        if state is not None:
            state.begin_at(tp.offset)
        try:
            consumer.seek(tp)
        except KafkaException as exc:
            # Not (or no longer) assigned: its next owner starts from the committed offset anyway.
            log.warning("could not rewind a partition", partition=f"{tp.topic}[{tp.partition}]",
                        error=str(exc.args[0]))


def committed_offsets(consumer: GroupConsumer, partitions: list[tuple[str, int]], *, limit: Deadline,
                      stop: Deadline, timeout_s: float, sleep: Callable[[float], None]) -> list[TopicPartition] | None:
    """The group's committed offsets, read from the broker; retried while the group coordinator
    moves (until `limit`). None when a stop came first."""
    while partitions:
        if stop.started:
            return None
        try:
            answer = consumer.committed([TopicPartition(t, p) for t, p in partitions],
                                        timeout=max(0.5, limit.capped(timeout_s)))
            failed = next((tp.error for tp in answer if tp.error is not None), None)
            if failed is None:
                return answer
            raise KafkaException(failed)
        except KafkaException as exc:
            # Only a read: anything but a fatal error is worth another try (a timeout raised by
            # committed() is not flagged retriable, unlike the transactional calls' errors).
            err = exc.args[0] if exc.args else None
            if (isinstance(err, KafkaError) and err.fatal()) or limit.expired():
                raise
            log.warning("committed offsets not read; retrying", error=str(exc.args[0]))
            sleep(0.5)
    return []
