"""Acknowledgement: what happens when the broker has a record's output (or its dead letter).

Runs on the delivery thread. The record leaves the in-flight table and its input offset is
marked done, which is what lets the committer move that partition's commit point.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from worker.inflight import InFlight, InFlightTable
from worker.kafka.producer import GiveUp, nothing
from worker.metrics import Metrics

Outcome = Literal["embedded", "dead_lettered"]


class Acknowledger:
    def __init__(self, inflight: InFlightTable, metrics: Metrics) -> None:
        self._inflight = inflight
        self._metrics = metrics
        # Written by the delivery thread only; read for the final log line after it stopped.
        self.embedded_count = 0
        self.dead_lettered_count = 0

    def _done(self, seq: int) -> InFlight | None:
        """The record leaves the table and its offset is done; None if it had left already."""
        rec = self._inflight.finish(seq)
        if rec is not None:
            rec.part.done(rec.offset)
        return rec

    def embedded(self, seq: int) -> Callable[[], None]:
        def ack() -> None:
            rec = self._done(seq)
            if rec is None:
                return
            self.embedded_count += 1
            self._metrics.count_produced()
            if rec.t_produced:
                self._metrics.observe_hop("produce_to_ack", time.monotonic() - rec.t_produced)
            if rec.timestamp_ms is not None:
                self._metrics.observe_end_to_end(rec.timestamp_ms)
        return ack

    def given_up(self, seq: int) -> GiveUp:
        """The record will never be delivered (purged by an abort, or exactly-once: its write
        failed the transaction, which is aborted and the record consumed again). It leaves the
        in-flight table with its offset not done; True if it belonged to a live offset state (the
        open transaction), False if that state was already replaced (an aborted transaction's).

        `fail` (the failed write's report to the transaction loop) runs for a live record before the
        record leaves the table: the poll thread commits once nothing is in flight, so it must not
        see the table without the record while the failure is not yet known (issue 32, finding 4)."""
        def release(fail: Callable[[], None] = nothing) -> bool:
            rec = self._inflight.get(seq)
            live = rec is not None and not rec.part.revoked
            if live:
                fail()
            self._inflight.finish(seq)
            return live
        return release

    def dead_lettered(self, seq: int, reason: str) -> Callable[[], None]:
        def ack() -> None:
            if self._done(seq) is not None:
                self.dead_lettered_count += 1
                self._metrics.count_dead_lettered(reason)
        return ack
