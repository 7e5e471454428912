"""The in-flight table: every consumed record from intake until its output is acknowledged.

A record enters on the poll thread (intake), is read by the output thread when its batch
finishes, and leaves on the delivery thread when the broker acknowledged its output or
dead-letter record (or on the output thread when its partition was revoked meanwhile).
One lock guards the table and its byte count; the per-partition offset state has its own.

The byte count is what the record holds in memory (key, value and headers of the input
message, kept for a possible dead letter), so flow control can bound memory, not only
the number of records.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from confluent_kafka import Message

from worker.formats.headers import InputHeaders
from worker.ledger.offsets import PartitionOffsets


@dataclass(slots=True)
class InFlight:
    part: PartitionOffsets
    offset: int
    qid: str
    tokens: int
    truncated: bool
    timestamp_ms: int | None
    nbytes: int
    # The input, kept until the output is produced, for a dead letter after an inference error;
    # headers read once and safely (a header name need not be UTF-8).
    msg: Message | None
    headers: InputHeaders
    cache_key: bytes | None = None  # the embedding cache's key, set when the cache is on
    # time.monotonic() when its output was handed to the producer (for the produce_to_ack hop).
    t_produced: float = 0.0


class InFlightTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[int, InFlight] = {}
        self._bytes = 0

    def add(self, seq: int, rec: InFlight) -> None:
        with self._lock:
            self._items[seq] = rec
            self._bytes += rec.nbytes

    def add_many(self, seqs: Sequence[int], recs: Sequence[InFlight]) -> None:
        """add() of a poll's records under one lock."""
        with self._lock:
            self._items.update(zip(seqs, recs))
            self._bytes += sum(rec.nbytes for rec in recs)

    def get(self, seq: int) -> InFlight | None:
        with self._lock:
            return self._items.get(seq)

    def finish(self, seq: int) -> InFlight | None:
        """Removes the record (acknowledged, or dropped after a revoke); None if it was gone."""
        recs = self.finish_many((seq,))
        return recs[0] if recs else None

    def finish_many(self, seqs: Iterable[int]) -> list[InFlight]:
        """finish() of many records under one lock; the ones that were still here, in `seqs`' order."""
        with self._lock:
            pop = self._items.pop
            recs = [rec for seq in seqs if (rec := pop(seq, None)) is not None]
            self._bytes -= sum(rec.nbytes for rec in recs)
        return recs

    def take_live(self, seqs: Iterable[int]) -> tuple[list[tuple[int, InFlight]], int]:
        """The records of a finished batch still worth producing, and how many were dropped.

        A record whose partition was revoked meanwhile is dropped here: the new owner redoes
        it, and producing it too would only make a duplicate.
        """
        live: list[tuple[int, InFlight]] = []
        dropped = 0
        with self._lock:
            items = self._items
            got = [(seq, items.get(seq)) for seq in seqs]
            # Nearly always: every record still here and its partition still ours.
            if all(rec is not None and not rec.part.revoked for _, rec in got):
                return got, 0  # type: ignore[return-value]  # no None left, checked above
            for seq, rec in got:
                if rec is None:
                    continue
                if rec.part.revoked:
                    del items[seq]
                    self._bytes -= rec.nbytes
                    dropped += 1
                    continue
                live.append((seq, rec))
        return live, dropped

    def remove_revoked(self) -> int:
        """Removes every record of a revoked offset state; returns how many. For records whose
        reports will never come (handed to a client that was replaced), and whose partitions are
        consumed again."""
        with self._lock:
            gone = [seq for seq, rec in self._items.items() if rec.part.revoked]
            for seq in gone:
                self._bytes -= self._items.pop(seq).nbytes
        return len(gone)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes
