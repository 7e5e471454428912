"""Each produced record's delivery callback: the compiled `worker/kafka/_reports.c` where setup.py
could build it, else the same in Python (`_PythonSink`); `keyword-embedder run` logs which
(`delivery_reports`). The types the producer and its writers share (`Headers`, `Failed`) live
here, below worker/kafka/producer.py, which uses it.

Threads: a sink's reports are made on the writing threads (each produce() call: the output
thread's, a dead letter's, an exactly-once write's) and called on the delivery thread, where its
delivery count is read after each poll. All of it under the interpreter lock, as the Python
form's plain attributes are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from confluent_kafka import KafkaError, Message

try:  # compiled by setup.py where a C compiler is found; else the same callbacks in Python (_PythonSink)
    from worker.kafka import _reports
except ImportError:  # pragma: no cover - exercised by tests/unit/worker/kafka/test_reports.py's Python form
    _reports = None  # type: ignore[assignment]

# Whether each record's delivery callback is the compiled one (logged at start, beside the tokenizer's path).
REPORTS_COMPILED = _reports is not None

# RD_KAFKA_PARTITION_UA: librdkafka's partitioner picks the partition (by the key).
PARTITION_UNASSIGNED = -1

Headers = list[tuple[str, bytes | None]]
# A failed write (the error, and the message the worker would stop with): True when the wrapper
# took it over (the record is accounted for), False when the worker stops.
Failed = Callable[[KafkaError, str], bool]


class ReportSink(Protocol):
    """Makes each record's delivery callback and counts deliveries (delivery thread): the compiled
    `worker.kafka._reports.Sink`, or `_PythonSink` where it was not built. A callback of (err, msg)
    calls `on_delivered()` for a delivery, `refused(topic, err, on_failed)` for a failed write, and
    `broken(topic, exc)` when on_delivered raised an Exception."""

    def report(self, topic: str, on_delivered: Callable[[], None], on_failed: Failed | None, /) -> Callable[[KafkaError | None, Message], None]: ...

    def take_delivered(self) -> int: ...


class _PythonSink:
    """`worker/kafka/_reports.c`'s Sink, in Python: two frames a record on the delivery thread where
    the compiled one runs none (tests/unit/worker/kafka/test_reports.py holds the two against each other)."""

    def __init__(self, refused: Callable[[str, KafkaError, Failed | None], object],
                 broken: Callable[[str, Exception], object]) -> None:
        if not (callable(refused) and callable(broken)):
            raise TypeError("refused and broken must be callable")
        self._refused = refused
        self._broken = broken
        self._delivered = 0

    def report(self, topic: str, on_delivered: Callable[[], None],
               on_failed: Failed | None, /) -> Callable[[KafkaError | None, Message], None]:
        def delivered(err: KafkaError | None, msg: Message, /) -> None:
            if err is not None:
                self._refused(topic, err, on_failed)
                return
            self._delivered += 1
            try:
                on_delivered()
                return
            except Exception as exc:  # noqa: BLE001 - the sink's owner stops the worker on it
                failed = exc
            # Outside the handler, as the compiled form calls it: what `broken` raises chains nothing.
            self._broken(topic, failed)
        return delivered

    def take_delivered(self) -> int:
        n, self._delivered = self._delivered, 0
        return n


def report_sink(refused: Callable[[str, KafkaError, Failed | None], object],
                broken: Callable[[str, Exception], object], *, compiled: bool = True) -> ReportSink:
    """The compiled sink where it was built (and `compiled`), else the Python one."""
    if compiled and _reports is not None:
        return _reports.Sink(refused, broken)  # type: ignore[no-any-return]
    return _PythonSink(refused, broken)


