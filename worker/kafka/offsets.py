"""Per-partition offset tracking for commit-after-write.

Messages of one partition are consumed in offset order but finish out of order (buckets
flush independently, deliveries ack independently). A partition may only commit up to
its lowest unfinished offset: committing further would lose the unfinished messages on
a crash. Each assignment of a partition gets a fresh `PartitionOffsets` (a new epoch),
so completions that arrive after a revoke land on the old object and are never
committed on behalf of the next owner. Commit confirmations are tagged the same way: an
offset is confirmed only on the object that asked for it (`request_commit`), so a late
confirmation of an earlier assignment's commit never moves the new assignment's state.

Thread-safety: `track` is called by the poll thread, `done` by the delivery thread and
`committable` by the poll thread; one lock per partition keeps them consistent.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field


class OffsetWentBack(ValueError):
    """A partition's offsets went back within one assignment, to records this state never saw:
    its log was reset under us."""


class Refetched(ValueError):
    """A record this state already tracked, delivered again by the client; `first` on the record
    that showed the re-fetch, not on the ones after it."""

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
    _first_record: Hashable = None  # what the caller says identifies that record (see `track`)
    _refetch_at: int | None = None  # during a re-fetch: the lowest offset it may deliver next
    _committed: int | None = None  # the highest offset the broker confirmed as committed
    _requested: set[int] = field(default_factory=set, repr=False)  # commits asked for, not yet confirmed
    revoked: bool = False

    def track(self, offset: int, record: Hashable = None) -> None:
        """`record` identifies the record at `offset` (the worker passes its timestamp, key and
        value); it tells a re-fetch from a reset when the offsets go back."""
        with self._lock:
            if self._next is not None and offset < self._next:
                # The position went back with no new assignment and no rewind of ours (both give
                # a fresh state, and records fetched before them are dropped: GroupMember.consume).
                # Two causes. librdkafka may fetch a partition again from where this state began:
                # seen in CI, a member consumed offsets 0-217 of a partition a second time a second
                # after committing them, with no seek and no rebalance; those records are ours
                # already and are skipped. Or it reset the position because the log no longer
                # holds it (the input topic was deleted and recreated, or an unclean leader
                # election truncated the partition): the lower offsets hold new records. Only the
                # first record can be compared, so a re-fetch is recognised where it starts there.
                if self._refetch_at is not None and offset >= self._refetch_at:
                    self._refetch_at = offset + 1
                    raise Refetched(f"{self.topic}[{self.partition}]: offset {offset} delivered again",
                                    first=False)
                if offset == self._first and record is not None and record == self._first_record:
                    self._refetch_at = offset + 1
                    raise Refetched(f"{self.topic}[{self.partition}]: delivered again from offset {offset}, "
                                    f"where this owner began (next new offset {self._next})", first=True)
                raise OffsetWentBack(f"{self.topic}[{self.partition}]: offset {offset} tracked out of order "
                                     f"(next expected >= {self._next}), and not the record this owner began with")
            self._refetch_at = None
            if self._first is None:
                self._first = offset
                self._first_record = record
            cell = [offset, False]
            self._order.append(cell)
            self._cells[offset] = cell
            self._next = offset + 1

    def done(self, offset: int) -> None:
        with self._lock:
            cell = self._cells.pop(offset, None)
            if cell is None:
                return
            cell[1] = True
            while self._order and self._order[0][1]:
                self._order.popleft()

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
        with self._lock:
            self._epoch += 1
            old = self._parts.get((topic, partition))
            if old is not None:
                old.revoked = True
            state = PartitionOffsets(topic, partition, self._epoch)
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
