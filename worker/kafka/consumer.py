"""The group member: owns the librdkafka Consumer (configuration, consume, pause, rebalances, close).

Threads: everything here runs on the poll thread. librdkafka serves the rebalance, commit and
error callbacks inside consume() and close(), so they run on the poll thread too, except
`close`, which runs on a helper thread (worker/kafka/bounded_calls.py) so that a leave that never
completes (a coordinator in flux, a JoinGroup parked until a vanished member's session ends)
cannot hold the process past its shutdown deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import structlog
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from worker.deadline import Deadline
from worker.errors import WorkerError
from worker.kafka.bounded_calls import BoundedCall
from worker.kafka.errors import FailurePolicy, KafkaSetupError
from worker.kafka.throttle import ThrottledLog
from worker.latch import FatalLatch
from worker.operations.metrics import Metrics

log = structlog.get_logger(__name__)

# How long an assignment waits for the group's committed offsets of partitions this member lost and
# gets back (one OffsetFetch; Committer.resume_lost): past it they start from the group's offset.
RESUME_CHECK_S = 5.0


def _names(partitions: Sequence[TopicPartition]) -> list[str]:
    return [f"{tp.topic}[{tp.partition}]" for tp in partitions]


# The group member hands its partitions to the ledger above it (worker/ledger/: the committer, its
# offsets per partition) through these protocols: kafka/ stays thin wrappers and imports nothing of it.
class Tracker(Protocol):
    """The current assignment's offsets (worker/ledger/offsets.py, OffsetTracker)."""

    @property
    def epoch(self) -> int: ...

    def get(self, topic: str, partition: int) -> Any: ...

    def replaced_since(self, topic: str, partition: int, epoch: int) -> bool: ...


class Ledger(Protocol):
    """Where the member's partitions and commits go (worker/ledger/committer.py, Committer)."""

    @property
    def tracker(self) -> Tracker: ...

    def bind(self, consumer: Any) -> None: ...

    def on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None: ...

    def resume_lost(self, partitions: Sequence[TopicPartition], timeout_s: float) -> list[str]: ...

    def assign(self, partitions: Sequence[TopicPartition]) -> None: ...

    def owned(self, partitions: Sequence[TopicPartition]) -> list[Any]: ...

    def forget(self, partitions: Sequence[TopicPartition]) -> None: ...

    def remember_lost(self, partitions: Sequence[TopicPartition]) -> None: ...


class _Owned:
    """`(topic, partition) in owned`: whether the partition is in the current assignment."""

    def __init__(self, committer: Ledger) -> None:
        self._committer = committer

    def __contains__(self, key: object) -> bool:
        topic, partition = key  # type: ignore[misc]
        return self._committer.tracker.get(topic, partition) is not None


class Rebalances(Protocol):
    """What the processing guarantee does when partitions go (worker/ledger/guarantees.py)."""

    def on_revoke(self, parts: list[Any], wait_s: float) -> bool:
        """Inside the revoke callback: commit the finished work of `parts` (waiting at most
        wait_s for more to finish); True when committed or nothing was left to commit."""
        ...

    def on_lost(self) -> bool:
        """Inside the lost callback: commit nothing; True when what the lost partitions finished
        stays written (at-least-once), so the member may resume after it if they come back."""
        ...


class GroupMember:
    def __init__(self, config: dict[str, Any], committer: Ledger, latch: FatalLatch, metrics: Metrics, *,
                 revoke_wait_s: Callable[[], float], group: str = "", topic: str = "",
                 failures: FailurePolicy | None = None,
                 consumer_factory: Callable[[dict[str, Any]], Any] = Consumer) -> None:
        self._committer = committer
        # What the processing guarantee does on a revoke and a loss (set by `subscribe`).
        self._rebalances: Rebalances | None = None
        self._group = group
        self.topic = topic  # what `subscribe` joins the group for
        # Authentication, TLS and ACL errors: which stop the worker, with which message.
        self._failures = failures if failures is not None else FailurePolicy()
        self._latch = latch
        self._metrics = metrics
        self._revoke_wait_s = revoke_wait_s
        self._errors = ThrottledLog()
        self._paused = False
        self._consumer = consumer_factory({**config, "error_cb": self._on_error, "on_commit": committer.on_commit,
                                           "stats_cb": self._on_stats})
        committer.bind(self._consumer)

    @property
    def client(self) -> Any:
        """The librdkafka consumer, for the transaction loop (group metadata, seek; poll thread)."""
        return self._consumer

    # ------------------------------------------------------------------ consuming
    @property
    def group(self) -> str:
        return self._group

    def subscribe(self, topic: str, rebalances: Rebalances) -> None:
        self._rebalances = rebalances
        self._consumer.subscribe([topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_lost)

    def consume(self, max_records: int, timeout_s: float) -> list[Message]:
        """Records to process, as soon as there is one (waiting up to timeout_s for it); error
        events are logged (throttled) and left out."""
        # consume(n, timeout) returns early only once it has n records: under a light load it
        # would hold every record for the whole timeout. So wait for the first one, then take
        # what else is already fetched without waiting.
        msgs = self._consumer.consume(num_messages=1, timeout=timeout_s)
        if msgs and max_records > 1:
            tracker = self._committer.tracker
            epoch = tracker.epoch
            more = self._consumer.consume(num_messages=max_records - 1, timeout=0)
            if tracker.epoch != epoch:
                # A rebalance callback ran inside the second call (its op was queued behind the
                # records of the first): a partition rewound or re-assigned there starts fetching
                # again from its committed offset, so a record of the first call is from before
                # the rewind. Tracked by the fresh state, it would make the re-fetched records
                # below it look like duplicates (librdkafka's seek barrier only purges records
                # gathered by the same call). It is fetched again; drop it here.
                msgs = [m for m in msgs if m.error() is not None
                        or not tracker.replaced_since(m.topic(), m.partition(), epoch)]
            msgs += more
        out = []
        for msg in msgs:
            err = msg.error()
            if err is None:
                out.append(msg)
            elif (reason := self._failures.decide(err, topic=msg.topic(), op="read", group=self._group)) is not None:
                self._latch.trip(KafkaSetupError(reason))
            elif err.fatal():
                self._latch.trip(WorkerError(f"fatal consumer error: {err.str()} ({err.name()})"))
            elif err.code() != KafkaError._PARTITION_EOF:
                self._errors.warn("consume error", err, topic=msg.topic())
        return out

    def watermarks(self, topic: str, partition: int) -> tuple[int, int] | None:
        """The partition's log start and end as the last fetch response gave them (librdkafka's
        cached LogStartOffset and HighwaterMarkOffset; no request), or None when unknown."""
        try:
            low, high = self._consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=True)
        except KafkaException:
            return None
        return (low, high) if low >= 0 and high >= 0 else None

    def serve(self, timeout_s: float) -> None:
        """Serves the group (heartbeats, callbacks) without taking records (all paused)."""
        self._consumer.consume(num_messages=1, timeout=timeout_s)

    # ------------------------------------------------------------------ flow control
    @property
    def paused(self) -> bool:
        return self._paused

    def set_paused(self, paused: bool, *, reason: str = "flow control") -> None:
        if paused == self._paused:
            return
        assignment = self._consumer.assignment()
        if assignment:
            (self._consumer.pause if paused else self._consumer.resume)(assignment)
        self._paused = paused
        log.info("partitions paused" if paused else "partitions resumed", partitions=len(assignment), reason=reason)
        self._metrics.set_paused_partitions(len(assignment) if paused else 0)

    # ------------------------------------------------------------------ rebalances
    def _on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        self._failures.connected()
        if not self._latch.is_set():
            # Before the fetch starts from the group's offset: a partition lost and given back unmoved
            # starts from what this member had finished instead (Committer.resume_lost).
            self._committer.resume_lost(partitions, RESUME_CHECK_S)
        self._committer.assign(partitions)
        log.info("partitions assigned", partitions=_names(partitions))
        self._metrics.count_rebalance("assign")
        if partitions:
            # Assigning here replaces the library's own assign, so the pause state can be set
            # right after it: a paused member takes new partitions paused (resumed with the rest
            # once the in-flight bounds drain); otherwise they are resumed explicitly, because
            # librdkafka keeps a partition's pause flag across a lost/re-assigned cycle and a
            # partition paused before a broker outage would otherwise never fetch again.
            consumer.incremental_assign(partitions)
            (consumer.pause if self._paused else consumer.resume)(partitions)

    def _on_revoke(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        parts = self._committer.owned(partitions)
        start = time.monotonic()

        def left() -> float:
            # Re-read each turn: a stop request or a second signal shortens the wait under way.
            return 0.0 if self._latch.is_set() else max(0.0, start + self._revoke_wait_s() - time.monotonic())

        while any(p.unfinished() for p in parts) and left() > 0:
            time.sleep(0.01)
        unfinished = sum(p.unfinished() for p in parts)
        # Commit what is finished while this generation still owns the partitions; after a
        # fatal error nothing more is committed (the failed record may sit below finished ones
        # of another partition, but never below these: each partition commits only up to its
        # own lowest unfinished offset).
        if self._latch.is_set() or self._rebalances is None:
            committed = True
        else:
            committed = self._rebalances.on_revoke(parts, left())
        self._committer.forget(partitions)
        for tp in partitions:
            self._metrics.forget_partition(tp.topic, tp.partition)
        log.info("partitions revoked", partitions=_names(partitions), dropped_unfinished=unfinished,
                 committed=committed)
        self._metrics.count_rebalance("revoke")

    def _on_lost(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        # Lost, not revoked: another member may already own them, so commit nothing.
        if self._rebalances is not None and self._rebalances.on_lost() and not self._latch.is_set():
            self._committer.remember_lost(partitions)
        self._committer.forget(partitions)
        for tp in partitions:
            self._metrics.forget_partition(tp.topic, tp.partition)
        log.warning("partitions lost", partitions=_names(partitions))
        self._metrics.count_rebalance("lost")

    # ------------------------------------------------------------------ errors, stats
    def _on_error(self, err: KafkaError) -> None:
        stop = self._failures.client_error(err, WorkerError(f"fatal consumer error: {err.str()} ({err.name()})"),
                                           group=self._group)
        if stop is not None:
            self._latch.trip(stop)
        else:
            self._errors.warn("consumer error", err)

    def _on_stats(self, raw: str) -> None:
        try:
            # Only partitions still ours: a revoked partition's lag must not come back.
            self._metrics.update_from_stats(raw, owned=_Owned(self._committer))
        except ValueError as exc:
            log.debug("bad librdkafka stats", error=str(exc))

    # ------------------------------------------------------------------ leaving
    def pause_all(self) -> None:
        assignment = self._consumer.assignment()
        if assignment:
            self._consumer.pause(assignment)
        self._paused = True

    def close(self, deadline: Deadline) -> bool:
        """Leaves the group (revoking, and so committing, what is still assigned); False if it
        did not finish by the deadline (the caller then exits without waiting for it: the call
        stays on its helper thread, and what it would still commit is finished work only)."""
        answer = BoundedCall("kwe-consumer-close").run(self._consumer.close, deadline)
        if answer is None:
            log.warning("leaving the group did not finish in time; exiting without it")
            return False
        if answer.error is not None:  # leaving is best effort; the final commit came before
            log.warning("consumer close failed", error=str(answer.error))
        return True
