"""Doubles for measuring the worker's own cost with the model and the broker taken out.

- `NullBackend`: answers every batch with unit vectors at once (no compute). A benchmark and test
  double: no setting names it, so a user can never run it.
- `MemoryConsumer`: a group member's consumer over in-memory partitions: the whole topic is
  assigned at the first consume (on_assign, as librdkafka serves it inside consume), records come
  out round-robin across the partitions that are not paused, commits are answered on the next call.
- `AckingProducer`: every produced record is acknowledged at the next poll, in order.

They implement only what the worker calls (worker/kafka/consumer.py, committer.py, producer.py)
and import nothing of the worker, so the same file measures an older checkout too
(benchmarks/host/pipeline_bench.py --baseline-root). Threads: the consumer is the poll thread's
alone; the producer's `produce` (output thread) and `poll` (delivery thread) share one lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from confluent_kafka import TopicPartition


class NullContext:
    def __init__(self, unit: np.ndarray) -> None:
        self._unit = unit

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return self._unit[: input_ids.shape[0]]

    def close(self) -> None:
        pass


class NullBackend:
    """Unit vectors (1 in the first component), read-only and shared: nothing is computed.

    `vectors="random"`: random unit vectors instead, made once, still shared and computed by no
    call. A JSON encoding writes a real model's components at their full length; the default's
    zeros cost the float-list encoding a fraction of that, which a model's run would be charged
    for when paired against it."""

    name = "null"
    max_contexts: int | None = None
    requires_serial_dispatch = False

    def __init__(self, dim: int = 384, rows: int = 65536, vectors: str = "unit") -> None:
        self.dim = dim
        if vectors == "random":
            unit = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
            unit /= np.linalg.norm(unit, axis=1, keepdims=True)
        else:
            unit = np.zeros((rows, dim), dtype=np.float32)
            unit[:, 0] = 1.0
        unit.setflags(write=False)
        self._unit = unit

    def create_context(self, index: int) -> NullContext:
        return NullContext(self._unit)

    def close(self) -> None:
        pass


class MemoryMessage:
    """What the worker reads of a confluent_kafka.Message."""

    __slots__ = ("_topic", "_partition", "_offset", "_key", "_value", "_ts")

    def __init__(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                 ts_ms: int) -> None:
        self._topic, self._partition, self._offset = topic, partition, offset
        self._key, self._value, self._ts = key, value, ts_ms

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def headers(self) -> None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return (1, self._ts)  # TIMESTAMP_CREATE_TIME

    def leader_epoch(self) -> int:
        return 0

    def error(self) -> None:
        return None

    def __len__(self) -> int:
        return len(self._value or b"")


def partitioned(topic: str, records: Sequence[tuple[bytes, bytes]], partitions: int) -> list[list[MemoryMessage]]:
    """The records spread over `partitions` by position (a producer's round-robin), as messages."""
    now = int(time.time() * 1000)
    logs: list[list[MemoryMessage]] = [[] for _ in range(partitions)]
    for i, (key, value) in enumerate(records):
        log = logs[i % partitions]
        log.append(MemoryMessage(topic, i % partitions, len(log), key, value, now))
    return logs


class MemoryConsumer:
    def __init__(self, config: dict[str, Any], logs: list[list[MemoryMessage]], topic: str, *,
                 per_poll: int = 0) -> None:
        self._config = config
        # At most this many records a consume (0: what the worker asks for): a live stream's small
        # fetches, where a backlog's are full.
        self._per_poll = per_poll
        self._logs = logs
        self._topic = topic
        self._at = [0] * len(logs)
        self._assigned = False
        self._paused: set[int] = set()
        self._callbacks: dict[str, Any] = {}
        self._answers: deque[tuple[None, list[TopicPartition]]] = deque()
        self.committed: dict[int, int] = {}
        self.consumed = 0

    def subscribe(self, topics: list[str], on_assign: Any = None, on_revoke: Any = None,
                  on_lost: Any = None) -> None:
        self._callbacks = {"on_assign": on_assign, "on_revoke": on_revoke, "on_lost": on_lost}

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        pass

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(self._topic, p) for p in range(len(self._logs))] if self._assigned else []

    def pause(self, partitions: list[TopicPartition]) -> None:
        self._paused |= {tp.partition for tp in partitions}

    def resume(self, partitions: list[TopicPartition]) -> None:
        self._paused -= {tp.partition for tp in partitions}

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float | None = None,
                              cached: bool = False) -> tuple[int, int]:
        return 0, len(self._logs[tp.partition])

    def consumer_group_metadata(self) -> str:
        return "memory"

    def commit(self, offsets: list[TopicPartition] | None = None, asynchronous: bool = True) -> Any:
        for tp in offsets or []:
            self.committed[tp.partition] = tp.offset
        if asynchronous:
            self._answers.append((None, list(offsets or [])))
            return None
        return list(offsets or [])

    def remaining(self) -> int:
        return sum(len(log) - at for log, at in zip(self._logs, self._at))

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[MemoryMessage]:
        if not self._assigned:
            self._assigned = True
            self._callbacks["on_assign"](self, self.assignment())
        on_commit = self._config.get("on_commit")
        while self._answers and on_commit is not None:
            on_commit(*self._answers.popleft())
        out: list[MemoryMessage] = []
        if self._per_poll:
            num_messages = min(num_messages, self._per_poll)
        live = [p for p in range(len(self._logs)) if p not in self._paused and self._at[p] < len(self._logs[p])]
        while live and len(out) < num_messages:
            # A fetch's worth per partition in turn, as librdkafka's fetch queue hands them out.
            share = max(1, (num_messages - len(out)) // len(live))
            for p in list(live):
                at = self._at[p]
                take = self._logs[p][at:at + min(share, num_messages - len(out))]
                out += take
                self._at[p] = at + len(take)
                if self._at[p] >= len(self._logs[p]):
                    live.remove(p)
                if len(out) >= num_messages:
                    break
        if not out and timeout > 0:
            time.sleep(min(timeout, 0.01))
        self.consumed += len(out)
        return out

    def close(self) -> None:
        pass


class _Delivered:
    """The message a delivery report carries (the worker reads nothing of it)."""

    __slots__ = ()

    def error(self) -> None:
        return None


_DELIVERED = _Delivered()


class AckingProducer:
    """Acknowledges every record at the next poll. Counts records, value bytes and acknowledgements."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._pending: list[Callable[[Any, Any], None]] = []
        self._ready = threading.Event()
        self._waiting = False  # a poll is waiting for a record (produce wakes it)
        self.records = 0
        self.value_bytes = 0
        self.acked = 0  # delivery reports served (the delivery thread's)

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, partition: int = -1,
                callback: Callable[[Any, Any], None] | None = None,
                on_delivery: Callable[[Any, Any], None] | None = None, timestamp: int = 0, headers: Any = None) -> None:
        """confluent-kafka's order and names: this checkout passes every argument by position, an
        older one (a benchmark's baseline) by keyword."""
        report = callback if callback is not None else on_delivery
        with self._lock:
            self.records += 1
            self.value_bytes += len(value or b"")
            if report is not None:
                self._pending.append(report)
            wake = self._waiting
        if wake:  # only a poll that found nothing waits: most produces notify nobody
            self._ready.set()

    def poll(self, timeout: float = -1) -> int:
        with self._lock:
            pending, self._pending = self._pending, []
            self._waiting = not pending
            if not pending:
                self._ready.clear()
        if not pending:
            self._ready.wait(timeout if timeout >= 0 else None)
            with self._lock:
                self._waiting = False
            return 0
        for cb in pending:
            cb(None, _DELIVERED)
        self.acked += len(pending)
        return len(pending)

    def flush(self, timeout: float = -1) -> int:
        self.poll(0)
        return 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)
