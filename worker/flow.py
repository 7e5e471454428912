"""Flow control: when to pause and resume the assigned partitions.

Two bounds, each with hysteresis: records consumed but not yet committed (`max_in_flight`,
which also bounds the duplicates a crash can cause) and bytes held in memory by in-flight
records (`max_in_flight_bytes`, which bounds RSS when records are large). Pause when either
reaches its bound; resume when both are back under 3/4 of theirs, well before the buckets
run dry, because the fetch that refills them takes a round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

# A fetch brings up to this many records at once; the poll thread asks for fewer near the bound.
CONSUME_BATCH = 500


@dataclass
class FlowControl:
    max_records: int
    max_bytes: int
    paused: bool = False

    def update(self, records: int, nbytes: int) -> bool:
        """The paused state for the current load (the caller applies a change)."""
        if not self.paused and (records >= self.max_records or nbytes >= self.max_bytes):
            self.paused = True
        elif self.paused and records <= self.max_records * 3 // 4 and nbytes <= self.max_bytes * 3 // 4:
            self.paused = False
        return self.paused

    def room(self, records: int) -> int:
        """How many records the next consume may take (at least 1, so the group is served)."""
        if self.paused:
            return 1
        return max(1, min(CONSUME_BATCH, self.max_records - records))
