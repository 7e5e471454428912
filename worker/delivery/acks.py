"""Acknowledgement: what happens when the broker has a record's output (or its dead letter).

Runs on the delivery thread. The record leaves the in-flight table and its input offset is
marked done at once, which is what lets the committer move that partition's commit point. What
the metrics learn of it (counts, produce-to-ack and end-to-end latencies) is gathered per record
and handed to them once per producer poll (`flush`, the delivery thread's too): one bulk update
instead of a counter and two histogram observations per keyword.
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
        # Gathered since the last flush (delivery thread only).
        self._produced = 0
        self._produce_to_ack: list[float] = []
        self._timestamps_ms: list[int] = []
        self._dead: dict[str, int] = {}

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
            self._produced += 1
            if rec.t_produced:
                self._produce_to_ack.append(time.monotonic() - rec.t_produced)
            if rec.timestamp_ms is not None:
                self._timestamps_ms.append(rec.timestamp_ms)
        return ack

    def dead_lettered(self, seq: int, reason: str) -> Callable[[], None]:
        def ack() -> None:
            if self._done(seq) is not None:
                self.dead_lettered_count += 1
                self._dead[reason] = self._dead.get(reason, 0) + 1
        return ack

    def flush(self) -> None:
        """Hands what was acknowledged since the last call to the metrics (after each producer poll)."""
        if self._produced:
            self._metrics.count_produced(self._produced)
            self._produced = 0
        if self._produce_to_ack:
            self._metrics.observe_hops("produce_to_ack", self._produce_to_ack)
            self._produce_to_ack = []
        if self._timestamps_ms:
            self._metrics.observe_end_to_end_many(self._timestamps_ms)
            self._timestamps_ms = []
        if self._dead:
            for reason, n in self._dead.items():
                self._metrics.count_dead_lettered(reason, n)
            self._dead = {}
