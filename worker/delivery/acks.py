"""Acknowledgement: what happens when the broker has a record's output (or its dead letter).

Runs on the delivery thread. The record leaves the in-flight table and its input offset is
marked done, which is what lets the committer move that partition's commit point.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from worker.delivery.inflight import InFlight, InFlightTable
from worker.operations.metrics import Metrics

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

    def dead_lettered(self, seq: int, reason: str) -> Callable[[], None]:
        def ack() -> None:
            if self._done(seq) is not None:
                self.dead_lettered_count += 1
                self._metrics.count_dead_lettered(reason)
        return ack
