"""Flow control: when intake stops taking records and when it goes on.

Two bounds, each with hysteresis: records consumed but not yet committed, and bytes held in
memory by in-flight records (`max_in_flight_bytes`, which bounds RSS when records are large).
Stop when either reaches its bound; go on when both are back under 3/4 of theirs, well before
the buckets run dry. How intake stops is the poll loop's (worker/pipeline.py): it holds, consuming
nothing while the partitions keep their prefetched records, and pauses them only when a hold
lasts (a pause drops the prefetch, and librdkafka fetches again up to a second later).

The record bound is a time budget as much as a count: what is in flight when SIGTERM comes
must finish inside the shutdown deadline, or the next owner redoes it and every output
already written above the first unfinished offset becomes a duplicate. So the bound follows
the measured throughput: `drain_target_s` seconds of work, never above `max_records` (the
setting) and never below `min_records` (enough to fill batches). On a fast box it is the
setting; on a starved one (many members on few cores) it shrinks, and so do drains.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# A fetch brings up to this many records at once; the poll thread asks for fewer near the bound.
CONSUME_BATCH = 500
# The window over which throughput is measured.
RATE_WINDOW_S = 10.0
# Idle this long (nothing waiting, nothing paused) before the measurement window is cleared:
# a worker at its bound empties briefly between fetches, which says nothing about capacity.
IDLE_RESET_S = 1.0


@dataclass
class FlowControl:
    max_records: int
    max_bytes: int
    drain_target_s: float = float("inf")
    min_records: int = 256
    paused: bool = False
    limit: int = 0  # the record bound in force (set from the measured rate)
    _samples: deque[tuple[float, int]] = field(default_factory=deque, repr=False)
    _idle_since: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.min_records = min(self.min_records, self.max_records)
        self.limit = self.min_records if self.drain_target_s != float("inf") else self.max_records

    def observe(self, now: float, finished_total: int, *, busy: bool = True) -> None:
        """Records finished so far (a running count): updates the measured rate and the bound.

        Only busy time measures capacity: an idle stretch (nothing waiting or paused for
        IDLE_RESET_S) clears the window and keeps the bound, so a burst after a quiet minute starts
        at the bound it had, not at one computed from a trickle.
        """
        if not busy and not self.paused:
            if self._idle_since is None:
                self._idle_since = now
            elif now - self._idle_since >= IDLE_RESET_S:
                self._samples.clear()
            return
        self._idle_since = None
        self._samples.append((now, finished_total))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()
        if self.drain_target_s == float("inf"):
            return
        t0, n0 = self._samples[0]
        if now - t0 < 1.0:
            return  # too short a window to measure; keep the bound
        rate = (finished_total - n0) / (now - t0)
        self.limit = max(self.min_records, min(self.max_records, int(rate * self.drain_target_s)))

    @property
    def resume_at(self) -> int:
        """The record count at or below which intake goes on again."""
        return self.limit * 3 // 4

    def update(self, records: int, nbytes: int) -> bool:
        """Whether intake stops for the current load (the caller holds or pauses)."""
        if not self.paused and (records >= self.limit or nbytes >= self.max_bytes):
            self.paused = True
        elif self.paused and records <= self.resume_at and nbytes <= self.max_bytes * 3 // 4:
            self.paused = False
        return self.paused

    def room(self, records: int) -> int:
        """How many records the next consume may take (at least 1, so the group is served)."""
        if self.paused:
            return 1
        return max(1, min(CONSUME_BATCH, self.limit - records))
