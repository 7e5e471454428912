"""The backfill's gate on the poll loop: records past the range stay out, and the run ends at its end.

`Pipeline` calls it at three points of each poll turn (its `PollGate` hooks): `room` before consuming
(the `--max-rate` token bucket), `admit` on what was consumed, and `finished` after. Everything
else is `run`'s pipeline unchanged: the same intake, batching, output, guarantees and dead letters.

- A record at or past its partition's end is not processed: dropped before intake, so it is never
  tracked, and the group's offset can never be committed past the end; the partition is paused (the
  live group embeds those records). Flow control's resume wakes it again now and then; its next
  record past the end pauses it again.
- A partition is done when the consumer's position has reached its end (librdkafka moves the
  position past transaction markers and aborted records too, so a transactional input finishes)
  and everything read from it is finished and committed. Its end is then committed for the group
  as well: a restart, another member and `kafka-consumer-groups` see it done, marker or not.
- The run is finished when every partition of the range is done: here, or (a partition this
  member does not own) by the group's committed offset.

Threads: the poll thread only (the Pipeline's caller); the offset states it reads have locks of
their own (worker/ledger/offsets.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from confluent_kafka import KafkaException, Message, TopicPartition

from worker.backfill.range import Plan
from worker.backfill.rate import TokenBucket
from worker.ledger.offsets import OffsetTracker

log = structlog.get_logger(__name__)

# How often `finished` looks at the partitions, and how often at the group's offsets of those this
# member does not own (a request each time).
CHECK_EVERY_S = 0.1
GROUP_CHECK_EVERY_S = 2.0
COMMITTED_TIMEOUT_S = 5.0
# How often the progress callback is called.
PROGRESS_EVERY_S = 0.5


class RangeGate:
    def __init__(self, plan: Plan, consumer: Any, tracker: OffsetTracker, *, limiter: TokenBucket | None = None,
                 on_progress: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._plan = plan
        self._topic = plan.range.topic
        self._consumer = consumer
        self._tracker = tracker
        self._limiter = limiter
        self._on_progress = on_progress
        self._clock = clock
        self._ends = {p.partition: p.end for p in plan.range.parts}
        self._starts = {p.partition: p.start for p in plan.range.parts}
        # The lowest offset not yet done, per partition, as last seen (the plan's until then).
        self._reached = dict(plan.resume)
        self._done = {p for p, at in plan.resume.items() if at >= self._ends[p]}
        self._held: set[int] = set()  # partitions paused here because they reached their end
        self.dropped = 0  # records past their partition's end, left to the live group
        self._next_check = 0.0
        self._next_group_check = 0.0
        self._next_progress = 0.0
        # When the first record of the range came and the last partition was done: the run's own
        # time, for its rate (not the model load, the join or the shutdown).
        self._first_at: float | None = None
        self._done_at: float | None = None

    # ------------------------------------------------------------------ the poll loop's hooks
    def room(self, want: int) -> int:
        """How many records the poll turn may consume (0: none this turn; the limiter waited)."""
        return want if self._limiter is None else self._limiter.allow(want)

    def admit(self, msgs: Sequence[Message]) -> list[Message]:
        """The records within the range; the others are dropped and their partitions paused."""
        if self._limiter is not None and msgs:
            self._limiter.take(len(msgs))
        kept: list[Message] = []
        for msg in msgs:
            p = msg.partition()
            end = self._ends.get(p) if msg.topic() == self._topic else None
            if end is not None and msg.offset() < end:
                kept.append(msg)
                if self._first_at is None:
                    self._first_at = self._clock()
                continue
            self.dropped += 1
            self._hold(p, msg.topic(), why="a record past the end of the range")
        return kept

    def finished(self) -> bool:
        """True once every partition of the range is done and committed (at most every CHECK_EVERY_S)."""
        now = self._clock()
        if now >= self._next_progress and self._on_progress is not None:
            self._next_progress = now + PROGRESS_EVERY_S
            self._on_progress(self.progress())
        if now < self._next_check:
            return False
        self._next_check = now + CHECK_EVERY_S
        for p, end in self._ends.items():
            if p not in self._done:
                self._look_at(p, end)
        if len(self._done) == len(self._ends):
            self._done_at = self._done_at or now
            return True
        if now >= self._next_group_check and all(self._tracker.get(self._topic, p) is None
                                                 for p in self._ends if p not in self._done):
            # Nothing left here: the rest belongs to other members (or is not assigned yet).
            self._next_group_check = now + GROUP_CHECK_EVERY_S
            self._look_at_group()
        return len(self._done) == len(self._ends)

    # ------------------------------------------------------------------ state for the report
    def progress(self) -> int:
        """Offsets of the range done, earlier runs included."""
        total = 0
        for p, end in self._ends.items():
            if p in self._done:
                self._reached[p] = end
            else:
                part = self._tracker.get(self._topic, p)
                at = part.committable() if part is not None else None
                if at is not None:
                    self._reached[p] = max(self._reached[p], min(at, end))
            total += self._reached[p] - self._starts[p]
        return total

    def left(self) -> dict[int, int]:
        """Offsets not done, by partition (those with any)."""
        self.progress()
        return {p: end - self._reached[p] for p, end in self._ends.items() if p not in self._done
                and end > self._reached[p]}

    @property
    def complete(self) -> bool:
        return len(self._done) == len(self._ends)

    def busy_seconds(self) -> float:
        """From the first record of the range to the end of the work (or now, when stopped first)."""
        if self._first_at is None:
            return 0.0
        return max(0.0, (self._done_at or self._clock()) - self._first_at)

    # ------------------------------------------------------------------ partitions
    def _hold(self, partition: int, topic: str, *, why: str) -> None:
        try:
            self._consumer.pause([TopicPartition(topic, partition)])
        except KafkaException as exc:  # revoked meanwhile: nothing to pause
            log.debug("cannot pause a partition past its end", partition=partition, error=str(exc))
        if partition not in self._held:
            self._held.add(partition)
            log.info("partition paused: later records are the live group's", topic=topic, partition=partition,
                     end=self._ends.get(partition), why=why)

    def _look_at(self, p: int, end: int) -> None:
        part = self._tracker.get(self._topic, p)
        if part is None or part.unfinished() or part.uncommitted():
            return
        try:
            [pos] = self._consumer.position([TopicPartition(self._topic, p)])
        except KafkaException:
            return
        if pos.offset < end:  # not there yet (or no position yet: -1001)
            return
        self._done.add(p)
        committed = part.committed if part.committed is not None else self._plan.resume[p]
        if committed < end:
            # The records are committed up to the last one; what lies between it and the end
            # (transaction markers) is committed too, so the group shows the partition done.
            try:
                self._consumer.commit(offsets=[TopicPartition(self._topic, p, end)], asynchronous=True)
            except KafkaException as exc:
                log.warning("cannot commit a finished partition's end; a restart reads past it again",
                            partition=p, error=str(exc))
        log.info("partition done", topic=self._topic, partition=p, end=end)
        self._hold(p, self._topic, why="done")

    def _look_at_group(self) -> None:
        rest = [TopicPartition(self._topic, p) for p in self._ends if p not in self._done]
        try:
            answer = self._consumer.committed(rest, timeout=COMMITTED_TIMEOUT_S)
        except KafkaException as exc:
            log.debug("cannot read the group's offsets", error=str(exc))
            return
        for tp in answer:
            if tp.error is None and tp.offset >= self._ends[tp.partition]:
                self._done.add(tp.partition)
