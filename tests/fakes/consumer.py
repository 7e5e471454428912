"""A librdkafka consumer, as far as the group member can tell: one queue that holds fetched
records and rebalance ops in arrival order, served by consume().

What it models of librdkafka (rdkafka_queue.c, rdkafka_partition.c):
- a rebalance op queued behind prefetched records runs only when a consume() call reaches it,
  inside that call (so under a backlog, inside the second call of a two-call consume);
- a seek (and an assignment) bumps the partition's fetch version: queued records of older
  versions are dropped, and so are records of older versions gathered by the *same* consume()
  call before the op ran (the "seek barrier"); records returned by an earlier call are the
  caller's;
- fetching restarts from the sought (or committed) offset;
- each record carries its leader epoch (Message.leader_epoch()), and get_watermark_offsets(cached=True)
  answers the log start and end as the last fetch response gave them (rdkafka_fetcher.c stores
  LogStartOffset and HighwaterMarkOffset per partition; rd_kafka_get_watermark_offsets reads them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import TopicPartition


@dataclass
class FakeMessage:
    _topic: str
    _partition: int
    _offset: int
    _value: bytes
    version: int = 0
    _key: bytes | None = None  # None: "<partition>-<offset>"
    _epoch: int | None = 0

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes:
        return self._key if self._key is not None else f"{self._partition}-{self._offset}".encode()

    def leader_epoch(self) -> int | None:
        return self._epoch

    def error(self) -> None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return (0, 0)

    def headers(self) -> None:
        return None


class FakeGroupConsumer:
    """One member's consumer over in-memory partition logs of one topic."""

    def __init__(self, config: dict[str, Any], *, topic: str = "in", partitions: int = 2, records: int = 20) -> None:
        self.config = config
        self.topic = topic
        self.logs = {p: [f"{p}-{o}".encode() for o in range(records)] for p in range(partitions)}
        # Per partition: keys (default "<partition>-<offset>") and leader epochs (default 0) by offset,
        # and the log start (default 0).
        self.keys: dict[int, dict[int, bytes]] = {p: {} for p in range(partitions)}
        self.epochs: dict[int, dict[int, int]] = {p: {} for p in range(partitions)}
        self.log_start: dict[int, int] = {}
        self.committed: dict[int, int] = {}
        self.fetch_at: dict[int, int] = {}
        self.version: dict[int, int] = {}
        self.paused: set[int] = set()
        self.queue: deque[FakeMessage | Callable[[], None]] = deque()
        self.callbacks: dict[str, Callable[..., None]] = {}
        self.seeks: list[tuple[int, int]] = []
        self.calls = 0

    # ------------------------------------------------------------------ the test's controls
    def queue_op(self, op: Callable[[], None], *, behind: int) -> None:
        """Queues `op` behind the first `behind` records already queued (after a fetch)."""
        self._fetch()
        self.queue.insert(behind, op)

    def revoke(self, partitions: list[int]) -> Callable[[], None]:
        def op() -> None:
            tps = [TopicPartition(self.topic, p) for p in partitions]
            self.callbacks["on_revoke"](self, tps)
            for p in partitions:
                self.fetch_at.pop(p, None)
                self.version[p] = self.version.get(p, 0) + 1
        return op

    def assign_op(self, partitions: list[int]) -> Callable[[], None]:
        return lambda: self.callbacks["on_assign"](self, [TopicPartition(self.topic, p) for p in partitions])

    # ------------------------------------------------------------------ confluent-kafka's API
    def subscribe(self, topics: list[str], on_assign: Any = None, on_revoke: Any = None, on_lost: Any = None) -> None:
        self.callbacks = {"on_assign": on_assign, "on_revoke": on_revoke, "on_lost": on_lost}

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self.version[tp.partition] = self.version.get(tp.partition, 0) + 1
            self.fetch_at[tp.partition] = self.committed.get(tp.partition, 0)

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(self.topic, p) for p in self.fetch_at]

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused |= {tp.partition for tp in partitions}

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused -= {tp.partition for tp in partitions}

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append((tp.partition, tp.offset))
        self.version[tp.partition] = self.version.get(tp.partition, 0) + 1
        self.fetch_at[tp.partition] = tp.offset

    def consumer_group_metadata(self) -> str:
        return "group-metadata"

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float | None = None,
                              cached: bool = False) -> tuple[int, int]:
        return self.log_start.get(tp.partition, 0), len(self.logs[tp.partition])

    def _fetch(self) -> None:
        for p, at in sorted(self.fetch_at.items()):
            if p in self.paused:
                continue
            log = self.logs[p]
            for off in range(max(at, self.log_start.get(p, 0)), len(log)):
                self.queue.append(FakeMessage(self.topic, p, off, log[off], self.version.get(p, 0),
                                              self.keys[p].get(off), self.epochs[p].get(off, 0)))
            self.fetch_at[p] = len(log)

    def _current(self, msg: FakeMessage) -> bool:
        return msg.partition() in self.fetch_at and msg.version == self.version.get(msg.partition(), 0)

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[FakeMessage]:
        self.calls += 1
        if not self.queue:
            self._fetch()
        out: list[FakeMessage] = []
        while self.queue and len(out) < num_messages:
            item = self.queue.popleft()
            if isinstance(item, FakeMessage):
                if self._current(item):
                    out.append(item)
                continue
            item()
            out = [m for m in out if self._current(m)]  # the barrier: this call's records only
        return out

    def close(self) -> None:
        self.fetch_at.clear()
