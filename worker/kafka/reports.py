"""Each produced record's delivery callback, and the produce loop over a batch's records: the
compiled `worker/kafka/_reports.c` where setup.py could build it, else the same in Python
(`_PythonSink`); `keyword-embedder run` logs which (`delivery_reports`). The types the producer and
its writers share (`Headers`, `Failed`) live here, below worker/kafka/producer.py, which uses it.

Threads: a sink's reports are made on the writing threads (the output thread's `produce_many`, a
dead letter's or an exactly-once write's `report`) and called on the delivery thread, where its
delivery count is read after each poll; `interrupted` is set by whichever thread aborts. All of it
under the interpreter lock, as the Python form's plain attributes are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from confluent_kafka import KafkaError, Message

try:  # compiled by setup.py where a C compiler is found; else the same callbacks in Python (_PythonSink)
    from worker.kafka import _reports
except ImportError:  # pragma: no cover - exercised by tests/test_reports.py's Python form
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

    # Set by the producer's interrupt(): produce_many queues nothing more.
    interrupted: bool

    def produce_many(self, produce: Callable[..., Any], topic: str, keys: list[bytes | None], values: list[bytes],
                     headers: Headers, on_delivered: list[Callable[[], None]], on_failed: Failed | None,
                     start: int, /) -> tuple[int, BaseException | None]:
        """produce(topic, value, key, PARTITION_UNASSIGNED, report, None, 0, headers) for records
        start, start + 1, ..., each with its report: (len(values), None) when all were queued, else the
        index of the record it stopped before and the exception its call raised (None: interrupted)."""
        ...


class _PythonSink:
    """`worker/kafka/_reports.c`'s Sink, in Python: two frames a record on the delivery thread where
    the compiled one runs none (tests/test_reports.py holds the two against each other)."""

    def __init__(self, refused: Callable[[str, KafkaError, Failed | None], object],
                 broken: Callable[[str, Exception], object]) -> None:
        self._refused = refused
        self._broken = broken
        self._delivered = 0
        self.interrupted = False

    def report(self, topic: str, on_delivered: Callable[[], None],
               on_failed: Failed | None, /) -> Callable[[KafkaError | None, Message], None]:
        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                self._refused(topic, err, on_failed)
                return
            self._delivered += 1
            try:
                on_delivered()
            except Exception as exc:  # noqa: BLE001 - the sink's owner stops the worker on it
                self._broken(topic, exc)
        return delivered

    def take_delivered(self) -> int:
        n, self._delivered = self._delivered, 0
        return n

    def produce_many(self, produce: Callable[..., Any], topic: str, keys: list[bytes | None], values: list[bytes],
                     headers: Headers, on_delivered: list[Callable[[], None]], on_failed: Failed | None,
                     start: int, /) -> tuple[int, BaseException | None]:
        if not (len(keys) == len(values) == len(on_delivered)):
            raise ValueError("keys, values and on_delivered must be of one length")
        if not 0 <= start <= len(values):
            raise ValueError("start must be within the records")
        report = self.report
        for i in range(start, len(values)):
            if self.interrupted:
                return i, None
            try:
                produce(topic, values[i], keys[i], PARTITION_UNASSIGNED, report(topic, on_delivered[i], on_failed),
                        None, 0, headers)
            except Exception as exc:  # noqa: BLE001 - handed back: the caller waits for room, or refuses the record
                return i, exc
        return len(values), None


def report_sink(refused: Callable[[str, KafkaError, Failed | None], object],
                broken: Callable[[str, Exception], object], *, compiled: bool = True) -> ReportSink:
    """The compiled sink where it was built (and `compiled`), else the Python one."""
    if compiled and _reports is not None:
        return _reports.Sink(refused, broken)  # type: ignore[no-any-return]
    return _PythonSink(refused, broken)


