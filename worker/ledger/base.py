"""The `Delivery` interface the pipeline calls (worker/ledger/guarantees.py says when each method runs), and
the types its two implementations share: at-least-once (worker/ledger/at_least_once.py) and exactly-once
(worker/ledger/exactly_once/loop.py) both import them from here, so neither imports the other's module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

from worker.deadline import Deadline
from worker.ledger.offsets import PartitionOffsets
from worker.kafka.producer import RecordWriter

Serve = Callable[[float], None]
Phase = Literal["created", "running", "finished"]
# Wraps the output thread's handling of one queued item (exactly-once: in the write gate; None: handled
# as it is). The one definition: the output stage takes it, each guarantee gives it.
AroundBatch = Callable[[Callable[[Any], None]], Callable[[Any], None]]
# What counts against max_in_flight: records consumed but not committed (at least once: all of them
# are redone after a crash), or only those not yet acknowledged (exactly once: an abort redoes the
# whole transaction whatever the bound, and a commit needs nothing more of them than the call).
BoundCounts = Literal["uncommitted", "unacknowledged"]


class Delivery(Protocol):
    guarantee: str  # the processing_guarantee setting it carries out
    phase: Phase
    writer: RecordWriter
    around_batch: AroundBatch | None
    bound_counts: BoundCounts

    def start(self) -> None: ...
    def poll_step(self, *, flow_paused: bool) -> str | None: ...
    def relieve(self, target: int) -> bool: ...
    def before_intake(self) -> None: ...
    def on_revoke(self, parts: list[PartitionOffsets], wait_s: float) -> bool: ...
    def on_lost(self) -> bool: ...
    def drain_step(self) -> None: ...
    def finish(self, deadline: Deadline, serve: Serve, *, drained: bool, aborted: bool) -> None: ...
    def summary(self) -> dict[str, Any]: ...
