"""Per-partition offset tracking for commit-after-write.

Messages of one partition are consumed in offset order but finish out of order (buckets
flush independently, deliveries ack independently). A partition may only commit up to
its lowest unfinished offset: committing further would lose the unfinished messages on
a crash. Each assignment of a partition gets a fresh `PartitionOffsets` (a new epoch),
so completions that arrive after a revoke land on the old object and are never
committed on behalf of the next owner. Commit confirmations are tagged the same way: an
offset is confirmed only on the object that asked for it (`request_commit`), so a late
confirmation of an earlier assignment's commit never moves the new assignment's state.

Offsets that go back within one state (no assignment, no rewind of ours) are librdkafka moving
the fetch position by itself; `track` decides from what librdkafka tells the consumer whether
the lower offsets are records already seen (skipped: `Refetched`) or new ones (`OffsetWentBack`):
docs/delivery.md, "Offsets that go back".

Thread-safety: `track` is called by the poll thread, `done` and `done_many` by the delivery thread and
`committable` by the poll thread; one lock per partition keeps them consistent.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

# (log start, log end) of a partition as the last fetch response gave them, or None when unknown
# (confluent-kafka's Consumer.get_watermark_offsets(tp, cached=True)).
Watermarks = Callable[[str, int], tuple[int, int] | None]
# The leader epoch of records without one (a broker or message format older than KIP-101).
NO_EPOCH = -1


class OffsetWentBack(ValueError):
    """A partition's offsets went back within one assignment, to records that are not the ones this
    state read: its log was reset under us (truncated and rewritten, or replaced)."""


class Refetched(ValueError):
    """A record this state (or its group, below where it began) already processed, delivered again
    by the client; `first` on the record that showed the re-fetch, not on the ones after it."""

    def __init__(self, message: str, *, first: bool) -> None:
        super().__init__(message)
        self.first = first


@dataclass(eq=False)
class PartitionOffsets:
    topic: str
    partition: int
    epoch: int
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Offsets in consumption order, each with its done flag: a list cell so `done` can flip it in O(1).
    _order: deque[list] = field(default_factory=deque, repr=False)
    _cells: dict[int, list] = field(default_factory=dict, repr=False)
    _next: int | None = None  # one past the highest offset tracked so far
    _first: int | None = None  # the first offset this owner consumed: where its group offset stood
    # The leader epoch of every offset tracked, as runs: (first offset of the run, epoch).
    _epochs: list[tuple[int, int]] = field(default_factory=list, repr=False)
    _refetch_at: int | None = None  # during a re-fetch: the lowest offset it may deliver next
    # The epoch runs of the state this one replaced (OffsetTracker.replace), for `begin_at`.
    _before: list[tuple[int, int]] = field(default_factory=list, repr=False)
    _committed: int | None = None  # the highest offset the broker confirmed as committed
    _requested: set[int] = field(default_factory=set, repr=False)  # commits asked for, not yet confirmed
    revoked: bool = False

    def track(self, offset: int, epoch: int | None = None, watermarks: Watermarks | None = None) -> None:
        """`epoch`: the record's leader epoch (Message.leader_epoch()); `watermarks`: where to read
        the partition's log end when the offsets go back. Raises Refetched for a record already
        processed, OffsetWentBack for a lower offset that holds a new record."""
        e = NO_EPOCH if epoch is None else epoch
        with self._lock:
            if self._next is not None and offset < self._next:
                self._went_back(offset, e, watermarks)
            self._add((offset,), e)

    def track_run(self, offsets: list[int], epoch: int | None) -> None:
        """track() of offsets that follow the last one tracked, each above the one before, all of
        one epoch (None: none), as the caller checked record by record against the last offset it
        tracked (worker/intake/stage.py: a poll's records of one partition come in runs). One lock
        and a few C-level calls for the run, where track() takes a lock and a method call a record."""
        if offsets:
            with self._lock:
                self._add(offsets, NO_EPOCH if epoch is None else epoch)

    def _add(self, offsets: Sequence[int], epoch: int) -> None:
        """Appends offsets that follow the last one tracked, of one epoch (under the lock)."""
        self._refetch_at = None
        if self._first is None:
            self._first = offsets[0]
        if not self._epochs or self._epochs[-1][1] != epoch:
            self._epochs.append((offsets[0], epoch))
        cells = [[offset, False] for offset in offsets]
        self._order.extend(cells)
        self._cells.update(zip(offsets, cells))
        self._next = offsets[-1] + 1

    def _went_back(self, offset: int, epoch: int, watermarks: Watermarks | None) -> None:
        """The position went back with no new assignment and no rewind of ours (both give a fresh
        state, and records fetched before them are dropped: GroupMember.consume). librdkafka moves
        it so in two ways (rdkafka_offset.c): an offset reset to auto.offset.reset, the log start
        (rd_kafka_offset_reset, after OFFSET_OUT_OF_RANGE or KIP-320's "No epoch found ... Reset
        using configured policy"), and KIP-320's truncation handling, a seek to where the leader's
        log diverges. Whether the records there are the ones already processed:
        - the log must still reach past everything this state consumed (its end, from the last fetch
          response, >= the next offset): a log that ends below it was truncated or replaced (a
          recreated topic), and what it holds is new;
        - and each record must carry the leader epoch it had: Kafka never writes two different
          records at one offset with one leader epoch, and a leader elected after a truncation
          writes in a higher epoch than any before it. Below where this state began (committed by
          the group before it) the epoch can be no higher than the first record's.
        The first record that fails either is a reset: it and what follows are processed as new."""
        assert self._first is not None and self._next is not None
        refetching = self._refetch_at is not None and offset >= self._refetch_at
        marks = None
        if not refetching:
            marks = watermarks(self.topic, self.partition) if watermarks is not None else None
            if marks is None or marks[1] < self._next:
                raise OffsetWentBack(
                    f"{self.topic}[{self.partition}]: offset {offset} after {self._next - 1}, and the log now ends at "
                    f"{'an unknown offset' if marks is None else marks[1]}, below what this owner consumed (truncated "
                    "or replaced)")
        seen = self._epoch_at(offset)
        same = epoch != NO_EPOCH and seen != NO_EPOCH and (epoch <= seen if offset < self._first else epoch == seen)
        if not same:
            raise OffsetWentBack(f"{self.topic}[{self.partition}]: offset {offset} again with leader epoch "
                                 f"{epoch if epoch != NO_EPOCH else 'unknown'}, this owner saw "
                                 f"{seen if seen != NO_EPOCH else 'none'} there: a record written after a "
                                 "truncation, or another log")
        self._refetch_at = offset + 1
        if refetching:
            raise Refetched(f"{self.topic}[{self.partition}]: offset {offset} delivered again", first=False)
        where = "the log start" if marks is not None and offset <= marks[0] else f"offset {offset}"
        raise Refetched(f"{self.topic}[{self.partition}]: delivered again from {where} (this owner began at "
                        f"{self._first}, next new offset {self._next}); same log, same leader epochs", first=True)

    def _epoch_at(self, offset: int) -> int:
        """The leader epoch this state tracked `offset` with (below its first offset: the first one's)."""
        for start, epoch in reversed(self._epochs):
            if start <= offset:
                return epoch
        return self._epochs[0][1] if self._epochs else NO_EPOCH

    def begin_at(self, offset: int) -> None:
        """A seek of ours sent this fresh state's partition to `offset` (where the group's position
        stands): the state begins there, as if it had consumed the records below, with the leader
        epochs the state it replaced tracked them with (`OffsetTracker.replace`). Without it, a
        reset of the fetch position to the log start before the first record from `offset` (an
        error-driven reset, `_went_back`) was taken for the state's first records, and records
        the group had committed were written again. A state that tracked a record is left alone."""
        with self._lock:
            if self._next is not None:
                return
            self._first = self._next = offset
            self._epochs = [(start, epoch) for start, epoch in self._before if start <= offset]

    def epoch_runs(self) -> list[tuple[int, int]]:
        """(first offset, leader epoch) of every run of offsets this state tracked, in order."""
        with self._lock:
            return list(self._epochs)

    def done(self, offset: int) -> None:
        self.done_many((offset,))

    def done_many(self, offsets: Iterable[int]) -> None:
        """done() of many offsets under one lock."""
        with self._lock:
            pop = self._cells.pop
            for offset in offsets:
                cell = pop(offset, None)
                if cell is not None:
                    cell[1] = True
            order = self._order
            while order and order[0][1]:
                order.popleft()

    def committable(self) -> int | None:
        """The offset to commit (the next message to read after a restart), or None before any message."""
        with self._lock:
            if self._order:
                return self._order[0][0]
            return self._next

    def to_commit(self) -> int | None:
        """The committable offset if committing it would move the group's position, else None."""
        with self._lock:
            off = self._order[0][0] if self._order else self._next
            base = self._committed if self._committed is not None else self._first
            return off if off is not None and base is not None and off > base else None

    def unfinished(self) -> int:
        with self._lock:
            return len(self._cells)

    @property
    def first(self) -> int | None:
        with self._lock:
            return self._first

    @property
    def committed(self) -> int | None:
        with self._lock:
            return self._committed

    def request_commit(self, offset: int) -> None:
        """This owner asked the broker to commit `offset`; only such offsets can be confirmed here."""
        with self._lock:
            self._requested.add(offset)

    def confirm_commit(self, offset: int) -> bool:
        """The broker confirmed `offset`; False (ignored) when this owner never asked for it."""
        with self._lock:
            if offset not in self._requested:
                return False
            self._requested = {o for o in self._requested if o > offset}
            if self._committed is None or offset > self._committed:
                self._committed = offset
            return True

    def uncommitted_after_commit(self) -> int:
        """What `uncommitted` would be once the committable offset is confirmed: the offsets from
        the lowest unfinished one (or none) up to the next to read."""
        with self._lock:
            if self._next is None:
                return 0
            return self._next - self._order[0][0] if self._order else 0

    def uncommitted(self) -> int:
        """Messages consumed but not yet confirmed committed: what a crash now would redeliver.

        Counted in offsets, so it over-counts across gaps (compaction, transaction markers),
        which only makes the in-flight bound stricter.
        """
        with self._lock:
            if self._next is None:
                return 0
            base = self._committed if self._committed is not None else self._first
            return max(0, self._next - (base if base is not None else self._next))


class OffsetTracker:
    """The `PartitionOffsets` of the current assignment, keyed by (topic, partition)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: dict[tuple[str, int], PartitionOffsets] = {}
        self._epoch = 0

    @property
    def epoch(self) -> int:
        """Grows with every change of any partition's state (assignment, rewind, revoke)."""
        with self._lock:
            return self._epoch

    def replaced_since(self, topic: str, partition: int, epoch: int) -> bool:
        """Whether the partition's state was replaced (or dropped) after `epoch`: a record fetched
        before then belongs to the old state and must not be tracked by the new one."""
        with self._lock:
            state = self._parts.get((topic, partition))
            return state is None or state.epoch > epoch

    def assign(self, topic: str, partition: int) -> PartitionOffsets:
        return self._fresh(topic, partition, keep_epochs=False)

    def replace(self, topic: str, partition: int) -> PartitionOffsets:
        """A fresh state, the old one marked revoked (as by `assign`), that keeps the old one's
        leader epochs for `PartitionOffsets.begin_at`: for a partition a seek of ours rewinds."""
        return self._fresh(topic, partition, keep_epochs=True)

    def _fresh(self, topic: str, partition: int, *, keep_epochs: bool) -> PartitionOffsets:
        with self._lock:
            self._epoch += 1
            old = self._parts.get((topic, partition))
            if old is not None:
                old.revoked = True
            before = old.epoch_runs() if keep_epochs and old is not None else []
            state = PartitionOffsets(topic, partition, self._epoch, _before=before)
            self._parts[(topic, partition)] = state
            return state

    def restart(self, topic: str, partition: int) -> PartitionOffsets:
        """A fresh state for a partition whose log went back under us (see `track`): unlike
        `assign`, the old state is not marked revoked, so its records still in flight are
        written (they were real records); its offsets, of a log that is gone, are never
        committed."""
        with self._lock:
            self._epoch += 1
            state = PartitionOffsets(topic, partition, self._epoch)
            self._parts[(topic, partition)] = state
            return state

    def revoke(self, topic: str, partition: int) -> PartitionOffsets | None:
        with self._lock:
            self._epoch += 1
            state = self._parts.pop((topic, partition), None)
        if state is not None:
            state.revoked = True
        return state

    def get(self, topic: str, partition: int) -> PartitionOffsets | None:
        with self._lock:
            return self._parts.get((topic, partition))

    def partitions(self) -> list[PartitionOffsets]:
        with self._lock:
            return list(self._parts.values())
