"""Acknowledgement: what happens when the broker has a record's output (or its dead letter).

Runs on the delivery thread. An embedding's acknowledgement only notes its in-flight number
(`embedded` hands the producer a C-level append, so a delivery report runs no Python of ours
beyond the producer's own callback); after each producer poll, `flush` (the delivery thread's
too) takes the noted records out of the in-flight table under one lock, marks their offsets done
a partition at a time, and hands the metrics one bulk update. That is what lets the committer
move a partition's commit point: a poll's acknowledgements reach it together, a moment after the
poll, never before the broker had them. A dead letter (rare) is done at once, as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Literal

from worker.ledger.inflight import InFlight, InFlightTable
from worker.ledger.offsets import PartitionOffsets
from worker.operations.metrics import Metrics

Outcome = Literal["embedded", "dead_lettered"]


class Acknowledger:
    def __init__(self, inflight: InFlightTable, metrics: Metrics) -> None:
        self._inflight = inflight
        self._metrics = metrics
        # Written by the delivery thread only; read for the final log line after it stopped.
        self.embedded_count = 0
        self.dead_lettered_count = 0
        # Gathered since the last flush (delivery thread only). `_acked` is emptied in place, never
        # replaced: every `embedded` callback holds its append.
        self._acked: list[int] = []
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
        """Record `seq`'s acknowledgement, finished by the next `flush`."""
        return partial(self._acked.append, seq)

    def dead_lettered(self, seq: int, reason: str) -> Callable[[], None]:
        def ack() -> None:
            if self._done(seq) is not None:
                self.dead_lettered_count += 1
                self._dead[reason] = self._dead.get(reason, 0) + 1
        return ack

    def flush(self) -> None:
        """Finishes the embeddings acknowledged since the last call, and hands the metrics what was
        acknowledged (after each producer poll)."""
        if self._acked:
            self._finish_embedded()
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

    def _finish_embedded(self) -> None:
        recs = self._inflight.finish_many(self._acked)
        self._acked.clear()
        now = time.monotonic()
        by_part: dict[PartitionOffsets, list[int]] = {}
        produce_to_ack, timestamps = self._produce_to_ack, self._timestamps_ms
        part: PartitionOffsets | None = None
        offsets: list[int] = []
        for rec in recs:
            if rec.part is not part:  # a batch's records mostly share a partition: one lookup a run
                part = rec.part
                offsets = by_part.setdefault(part, [])
            offsets.append(rec.offset)
            if rec.t_produced:
                produce_to_ack.append(now - rec.t_produced)
            if rec.timestamp_ms is not None:
                timestamps.append(rec.timestamp_ms)
        for part, offsets in by_part.items():
            part.done_many(offsets)
        self.embedded_count += len(recs)
        self._produced += len(recs)
