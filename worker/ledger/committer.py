"""The committer: owns the offsets of the current assignment and every commit of them.

Threads: the poll thread calls everything here, and librdkafka serves asynchronous commit
results on it (inside consume). The delivery thread only marks offsets done, through each
`PartitionOffsets`' own lock. A synchronous commit runs on a helper thread
(worker/kafka/bounded_calls.py) and is waited for with a timeout, so a coordinator that never
answers (a rebalance in flux, a broker gone) cannot hold a revoke or a shutdown past its deadline;
one such commit at a time: one that got no answer in time is still blocked in librdkafka, and the
next waits for it (within its own timeout) instead of starting beside it.

What is committed: per partition, the lowest unfinished offset (everything below it has its
output acknowledged), and only while this assignment is the partition's owner. Each commit is
tagged with the assignment it was made for, so a late answer never confirms a newer one.

Lost partitions (at-least-once): the lost state is remembered (`remember_lost`), and when the
group gives the partition back to this member with its committed offset not moved past what that
state has finished by then, that finished offset is committed before fetching starts
(`resume_lost`), instead of redoing the finished window. Safe whoever held the partition in
between: everything below that offset has its output acknowledged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from worker.deadline import Deadline
from worker.kafka.bounded_calls import BoundedCall
from worker.ledger.offsets import OffsetTracker, PartitionOffsets
from worker.kafka.throttle import ThrottledLog

log = structlog.get_logger(__name__)

# After a commit at the in-flight bound that was confirmed, none again for this long. Each frees at
# least a quarter of the record bound (intake stops at the bound and goes on at 3/4 of it), so 50 a
# second cap a hold's backlog at 12.5 bounds a second (51,000 records at the default 4,096); without
# it, a bound held by bytes while the records sat under the target committed every 5 ms turn.
RELIEVE_GAP_S = 0.02


class Committer:
    def __init__(self, consumer: Any, *, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.tracker = OffsetTracker()
        self._consumer = consumer
        self._interval = interval_s
        self._clock = clock
        self._last_commit = float("-inf")
        # No commit_to_relieve before this: after a failure, the commit interval; after a success,
        # RELIEVE_GAP_S (poll thread only).
        self._relieve_after = float("-inf")
        # The helper thread of the synchronous commits: one at a time (poll thread only).
        self._sync = BoundedCall("kwe-commit")
        self._errors = ThrottledLog()
        # When the commit point last moved, or nothing was waiting to be committed. Written on
        # the poll thread only; the liveness probe reads it (a float read is atomic).
        self._progress_at = clock()
        # Lost partitions: (topic, partition) -> (the group's offset as this member last knew it, the
        # lost state, whose records already written still finish on it). Poll thread only.
        self._lost: dict[tuple[str, int], tuple[int, PartitionOffsets]] = {}

    def bind(self, consumer: Any) -> None:
        """The consumer is built after the committer (its commit callback is ours)."""
        self._consumer = consumer

    # ------------------------------------------------------------------ state
    def uncommitted(self) -> int:
        pending = sum(p.uncommitted() for p in self.tracker.partitions())
        if pending == 0:
            self._progress_at = self._clock()
        return pending

    def progressed(self) -> None:
        """The commit point moved by other means (exactly-once: a committed transaction)."""
        self._progress_at = self._clock()

    def stalled_for(self) -> float:
        """Seconds the commit point has not moved while work waited to be committed."""
        return max(0.0, self._clock() - self._progress_at)

    # ------------------------------------------------------------------ commits
    def _wanted(self, parts: Sequence[PartitionOffsets]) -> list[TopicPartition]:
        """Offsets worth committing: finished work beyond what the broker already confirmed."""
        return [TopicPartition(part.topic, part.partition, off) for part in parts
                if (off := part.to_commit()) is not None]

    def _request(self, offsets: Sequence[TopicPartition]) -> None:
        for tp in offsets:
            part = self.tracker.get(tp.topic, tp.partition)
            if part is not None:
                part.request_commit(tp.offset)

    def maybe_commit(self, *, force: bool = False) -> None:
        """Asynchronous commit, at most once per interval; the answer comes to `on_commit`."""
        now = self._clock()
        if not force and now - self._last_commit < self._interval:
            return
        self._last_commit = now
        offsets = self._wanted(self.tracker.partitions())
        if not offsets:
            return
        self._request(offsets)
        try:
            self._consumer.commit(offsets=offsets, asynchronous=True)
        except KafkaException as exc:
            # No coordinator right now (broker restart, rebalance): the next round retries.
            self._errors.warn("commit failed; will retry", exc.args[0])

    def on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """librdkafka's commit callback (poll thread)."""
        if err is not None and err.code() != KafkaError._NO_OFFSET:
            # ILLEGAL_GENERATION / REBALANCE_IN_PROGRESS during a rebalance: the next round
            # commits with the new generation, if the partition is still ours.
            self._errors.warn("commit failed; will retry", err)
        self._confirm(partitions)

    def _confirm(self, partitions: Sequence[TopicPartition]) -> bool:
        """Applies confirmed offsets; True when every partition was confirmed."""
        ok = True
        for tp in partitions:
            if tp.error is not None or tp.offset < 0:
                ok = False
                continue
            part = self.tracker.get(tp.topic, tp.partition)
            if part is not None and part.confirm_commit(tp.offset):
                self._progress_at = self._clock()
        return ok

    def commit_sync(self, parts: Sequence[PartitionOffsets], timeout_s: float, *, in_callback: bool = False) -> bool:
        """Commits the finished work of `parts` and waits for the answer, at most timeout_s.

        True when there was nothing to commit or the broker confirmed all of it. Inside a
        rebalance callback the commit runs on the calling thread: librdkafka answers a commit
        made from another thread only after the callback returned (measured: a revoke's
        commit then times out and the moved partitions' finished work is redone). The caller
        of such a callback (consume, or close on its own thread) bounds it instead.
        """
        return self._commit_sync(parts, Deadline.after(timeout_s), in_callback=in_callback)

    def _commit_sync(self, parts: Sequence[PartitionOffsets], wait: Deadline, *, in_callback: bool = False) -> bool:
        """`commit_sync`, waiting until `wait` (re-read while waiting: a shutdown's, which a second
        signal shortens)."""
        offsets = self._wanted(parts)
        if not offsets:
            return True
        if wait.expired():
            return False
        self._request(offsets)
        if in_callback:
            try:
                result = self._consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as exc:
                log.warning("synchronous commit failed", error=str(exc))
                return False
            return self._confirm(result or []) and len(result or []) == len(offsets)
        waited_from = time.monotonic()
        answer = self._sync.run(lambda: self._consumer.commit(offsets=offsets, asynchronous=False), wait)
        if answer is None:
            log.warning("synchronous commit got no answer in time", waited_s=round(time.monotonic() - waited_from, 3),
                        partitions=len(offsets))
            return False
        if answer.error is not None:
            # A KafkaException, or a RuntimeError: the consumer was closed meanwhile.
            log.warning("synchronous commit failed", error=str(answer.error))
            return False
        result = answer.value or []
        return self._confirm(result) and len(result) == len(offsets)

    def commit_to_relieve(self, target: int, timeout_s: float) -> bool:
        """At the in-flight bound (poll thread, outside a callback, partitions not paused): commits
        the finished work synchronously once confirming it brings the uncommitted records to `target`
        or below, so intake goes on without pausing (a pause throws away the prefetched records, and
        librdkafka fetches again only at its broker thread's next wake-up, up to a second later:
        measured, every 4,096 records of a backlog waited 0.6-0.7 s). True when it committed and the
        broker confirmed; False when that would not reach the target yet, would free nothing (the
        records are at or under it already: the byte bound holds, and only acknowledgements free
        bytes), the last such commit is still unanswered (a coordinator outage: one commit blocked in
        librdkafka, not one per try), or it came too soon after the last (RELIEVE_GAP_S after a
        success, the commit interval after a failure)."""
        now = self._clock()
        if now < self._relieve_after or self._sync.busy:
            return False
        parts = self.tracker.partitions()
        if sum(p.uncommitted() for p in parts) <= target or sum(p.uncommitted_after_commit() for p in parts) > target:
            return False
        self._last_commit = now
        if self.commit_sync(parts, timeout_s):
            self._relieve_after = self._clock() + RELIEVE_GAP_S
            return True
        # Not again before the next regular commit would be due: no burst of failing commits.
        self._relieve_after = self._clock() + self._interval
        return False

    def commit_until(self, deadline: Deadline, serve: Callable[[float], None]) -> bool:
        """Commits all finished work, retrying until confirmed or the deadline (re-read each
        attempt, so a second signal shortens it).

        Between attempts `serve` polls the consumer, so a member that must rejoin (the commit
        was refused with a stale generation during a rebalance) can do so and commit again.
        """
        while True:
            if self._commit_sync(self.tracker.partitions(), deadline.limited(5.0)):
                return True
            if deadline.left() <= 0.2:
                return False
            # Not while the last commit is still unanswered: consume() then blocked until librdkafka
            # gave that commit up (measured: 20 s, a rebalance parked by a member gone silent), past
            # every deadline. The next attempt waits for it instead (BoundedCall).
            if not self._sync.busy:
                serve(0.1)

    # ------------------------------------------------------------------ lost and given back
    def remember_lost(self, partitions: Sequence[TopicPartition]) -> None:
        """Partitions lost (poll thread, inside the lost callback, before `forget`): where the group's
        offset stood as far as this member knows, and the lost state itself. What it finished is read
        when the partition comes back, not now: a loss comes while outputs wait in the producer (a
        dead broker still in the ISR holds every acks=all write until it is fenced), and those still
        finish on this state afterwards; records not produced yet are dropped (the output stage drops
        a revoked state's records), so its lowest unfinished offset never passes one of them."""
        for part in self.owned(partitions):
            base = part.committed if part.committed is not None else part.first
            if base is not None:
                self._lost[(part.topic, part.partition)] = (base, part)

    def resume_lost(self, partitions: Sequence[TopicPartition], timeout_s: float) -> list[str]:
        """Inside the assign callback, before the partitions are assigned: for those this member lost
        with finished work, reads the group's committed offsets and, where they have not moved past
        it (nor below where this member left them), commits the finished offset (this generation owns
        them), so fetching starts there. Returns the partitions resumed so. Any failure leaves the
        group's offset as it is (the work is redone)."""
        wanted: dict[tuple[str, int], tuple[int, int]] = {}
        for tp in partitions:
            memo = self._lost.pop((tp.topic, tp.partition), None)
            finished = memo[1].committable() if memo is not None else None
            if memo is not None and finished is not None and finished > memo[0]:
                wanted[(tp.topic, tp.partition)] = (memo[0], finished)
        if not wanted:
            return []
        try:
            now = self._consumer.committed([TopicPartition(t, p) for t, p in wanted], timeout=timeout_s)
            # Between where this member left the group's offset and what it finished: its own commits,
            # deferred by librdkafka for want of a coordinator, may land after the rejoin (a deferred
            # commit is sent with the generation current when it goes out: rdkafka_cgrp.c,
            # rd_kafka_cgrp_offsets_commit), and whoever committed there, everything below the finished
            # offset has its output. Below where it left it (an operator's reset) or past what it
            # finished: the group's offset stands.
            unmoved = [TopicPartition(tp.topic, tp.partition, wanted[(tp.topic, tp.partition)][1]) for tp in now
                       if tp.error is None and wanted[(tp.topic, tp.partition)][0] <= tp.offset
                       < wanted[(tp.topic, tp.partition)][1]]
            if unmoved:
                answer = self._consumer.commit(offsets=unmoved, asynchronous=False) or []
                unmoved = [tp for tp in answer if tp.error is None and tp.offset >= 0]
        except KafkaException as exc:
            log.warning("lost partitions given back: the group's offsets could not be read or committed; "
                        "their finished work is redone", error=str(exc))
            return []
        back = {(tp.topic, tp.partition) for tp in unmoved}
        resumed = [f"{tp.topic}[{tp.partition}]@{tp.offset}" for tp in unmoved]
        log.info("lost partitions given back: resumed from what this member had finished", resumed=resumed,
                 not_redone=sum(wanted[key][1] - wanted[key][0] for key in back),
                 moved_meanwhile=sorted(f"{t}[{p}]" for t, p in wanted if (t, p) not in back))
        return resumed

    # ------------------------------------------------------------------ assignment bookkeeping
    def assign(self, partitions: Sequence[TopicPartition]) -> None:
        for tp in partitions:
            self.tracker.assign(tp.topic, tp.partition)

    def owned(self, partitions: Sequence[TopicPartition]) -> list[PartitionOffsets]:
        return [p for tp in partitions if (p := self.tracker.get(tp.topic, tp.partition)) is not None]

    def forget(self, partitions: Sequence[TopicPartition]) -> None:
        for tp in partitions:
            self.tracker.revoke(tp.topic, tp.partition)
