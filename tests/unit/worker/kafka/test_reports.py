"""A produced record's delivery callback (worker/kafka/_reports.c, and its Python form in
worker/kafka/reports.py): what each outcome calls, returns and raises, alike in both forms; the
delivery count the delivery thread reads after a poll; that the compiled one holds no reference too
many, and that confluent-kafka's own C code calls it as it calls a Python function. Then the
producer's waits and refusals with either form, and an interrupt from another thread through the
output stage."""

from __future__ import annotations

import gc
import os
import sys
import time
import weakref
from functools import partial
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from worker.kafka import reports as reports_module
from worker.kafka.producer import OutputProducer
from worker.kafka.reports import report_sink
from worker.latch import FatalLatch

FORMS = ["compiled", "python"]


class Owner:
    """What the producer hands a sink: where refused writes and failed accounting go."""

    def __init__(self) -> None:
        self.refused: list[tuple[str, Any, Any]] = []
        self.broken: list[tuple[str, Exception]] = []

    def on_refused(self, topic: str, err: Any, on_failed: Any) -> None:
        self.refused.append((topic, err, on_failed))

    def on_broken(self, topic: str, exc: Exception) -> None:
        self.broken.append((topic, exc))


def sink_of(form: str, owner: Owner) -> Any:
    if form == "compiled" and reports_module._reports is None:
        pytest.skip("worker/kafka/_reports.c is not built (test_the_compiled_sink_is_built says why)")
    return report_sink(owner.on_refused, owner.on_broken, compiled=form == "compiled")


def test_the_compiled_sink_is_built() -> None:
    if reports_module._reports is None:
        reason = os.environ.get("KWE_COMPILED_UNAVAILABLE")
        if reason:
            pytest.skip(reason)
        pytest.fail("worker/kafka/_reports.c was not built (no C compiler at install?); "
                    "set KWE_COMPILED_UNAVAILABLE to say why when that is expected")
    assert type(report_sink(print, print)).__module__ == "worker.kafka._reports"


@pytest.mark.parametrize("form", FORMS)
def test_a_delivery_calls_on_delivered_and_is_counted_once(form: str) -> None:
    owner, acked = Owner(), []
    sink = sink_of(form, owner)
    reports = [sink.report("out", lambda i=i: acked.append(i), None) for i in range(3)]
    assert sink.take_delivered() == 0
    for r in reversed(reports):
        assert r(None, object()) is None
    assert acked == [2, 1, 0]
    assert sink.take_delivered() == 3
    assert sink.take_delivered() == 0  # read and reset by each poll
    assert owner.refused == [] and owner.broken == []


@pytest.mark.parametrize("form", FORMS)
def test_a_failed_write_goes_to_refused_with_the_topic_and_the_records_on_failed(form: str) -> None:
    owner, acked = Owner(), []
    sink = sink_of(form, owner)
    err = KafkaError(KafkaError._MSG_TIMED_OUT)

    def take_over(e: KafkaError, why: str) -> bool:
        return True

    sink.report("out-a", lambda: acked.append(1), take_over)(err, None)
    sink.report("out-b", lambda: acked.append(2), None)(err, None)
    assert owner.refused == [("out-a", err, take_over), ("out-b", err, None)]
    assert acked == [] and sink.take_delivered() == 0 and owner.broken == []


@pytest.mark.parametrize("form", FORMS)
def test_accounting_that_raises_goes_to_broken_and_anything_else_propagates(form: str) -> None:
    owner = Owner()
    sink = sink_of(form, owner)
    bug = KeyError(7)

    def raises() -> None:
        raise bug

    sink.report("out", raises, None)(None, None)
    assert owner.broken == [("out", bug)]
    assert bug.__traceback__ is not None  # the trace of where accounting failed stays with it
    assert sink.take_delivered() == 1  # the broker had it; the worker stops on the bug

    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sink.report("out", interrupted, None)(None, None)
    assert len(owner.broken) == 1


def test_the_compiled_callback_holds_its_references_until_it_is_gone() -> None:
    owner = Owner()
    sink = sink_of("compiled", owner)

    def on_delivered() -> None:
        pass

    topic = "out-refcount-" + str(os.getpid())  # not interned: its count is this test's alone
    before = sys.getrefcount(on_delivered), sys.getrefcount(topic), sys.getrefcount(sink)
    reports = [sink.report(topic, on_delivered, None) for _ in range(1000)]
    for r in reports:
        r(None, None)
    assert sys.getrefcount(on_delivered) == before[0] + 1000
    del reports, r
    assert (sys.getrefcount(on_delivered), sys.getrefcount(topic), sys.getrefcount(sink)) == before


@pytest.mark.parametrize("form", FORMS)
def test_a_sink_and_the_producer_that_owns_it_are_collected_together(form: str) -> None:
    class Holder(Owner):
        sink: Any

    holder = Holder()
    holder.sink = sink_of(form, holder)  # holder -> sink -> bound methods -> holder
    pending = holder.sink.report("out", holder.on_refused, None)  # a report not yet called
    gone = weakref.ref(holder)
    del holder, pending
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("form", FORMS)
def test_confluent_kafka_calls_the_callback_with_a_real_delivery_failure(form: str) -> None:
    # A producer with no broker to reach (loopback port 1): librdkafka times the record out and
    # confluent-kafka's C code calls the record's callback, as it would for a broker's answer.
    owner, acked = Owner(), []
    sink = sink_of(form, owner)
    client = Producer({"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 300,
                       "socket.connection.setup.timeout.ms": 1000, "log_level": 0})
    client.produce("out", b"v", b"k", -1, sink.report("out", lambda: acked.append(1), None))
    deadline = time.monotonic() + 20
    while not owner.refused and time.monotonic() < deadline:
        client.poll(0.1)
    assert len(owner.refused) == 1
    topic, err, on_failed = owner.refused[0]
    assert (topic, on_failed, acked) == ("out", None, [])
    assert err.code() == KafkaError._MSG_TIMED_OUT
    assert client.flush(5) == 0


class Client:
    """confluent-kafka's Producer.produce as OutputProducer calls it (every argument by position),
    refusing the calls it is told to: `full` raises BufferError that many times first,
    `refuse` a KafkaException for those values."""

    def __init__(self, full: int = 0, refuse: tuple[bytes, ...] = ()) -> None:
        self.queued: list[tuple[Any, ...]] = []
        self.full = full
        self.refuse = refuse

    def produce(self, topic: str, value: bytes, key: bytes, partition: int, callback: Any, on_delivery: Any,
                timestamp: int, headers: Any) -> None:
        if self.full:
            self.full -= 1
            raise BufferError("queue full")
        if value in self.refuse:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        self.queued.append((topic, value, key, partition, callback, on_delivery, timestamp, headers))

    def deliver(self) -> None:
        for entry in self.queued:
            entry[4](None, None)
        self.queued.clear()


def batch(n: int) -> tuple[list[bytes], list[bytes], list[int], list[Any]]:
    acked: list[int] = []
    return ([f"k{i}".encode() for i in range(n)], [f"v{i}".encode() for i in range(n)], acked,
            [partial(acked.append, i) for i in range(n)])


@pytest.mark.parametrize("form", FORMS)
def test_the_producer_waits_out_a_full_queue_and_refuses_a_record_with_either_form(form: str) -> None:
    if form == "compiled" and reports_module._reports is None:
        pytest.skip("worker/kafka/_reports.c is not built")
    client = Client(full=3, refuse=(b"v3",))
    latch = FatalLatch()
    producer = OutputProducer({}, latch, producer_factory=lambda config: client, compiled_reports=form == "compiled")
    keys, values, acked, on_delivered = batch(6)
    taken: list[str] = []

    def take_over(err: KafkaError, why: str) -> bool:
        taken.append(why)
        return True

    # A full queue three times, then a record too large that the wrapper takes over: all accounted for.
    assert all(producer.produce("out", k, v, [], d, take_over) for k, v, d in zip(keys, values, on_delivered))
    assert [q[1] for q in client.queued] == [b"v0", b"v1", b"v2", b"v4", b"v5"] and len(taken) == 1
    assert not latch.is_set()
    client.deliver()
    assert acked == [0, 1, 2, 4, 5]
    # Without a taker the refusal stops the worker.
    assert not producer.write(3, "out", keys[3], values[3], [], on_delivered[3])
    assert latch.is_set() and "cannot write to topic" in str(latch.error)
    # Interrupted: nothing more is queued.
    producer.interrupt()
    assert not producer.write(4, "out", keys[4], values[4], [], on_delivered[4])
    assert client.queued == []


@pytest.mark.parametrize("form", FORMS)
def test_an_interrupt_from_another_thread_stops_the_output_stage_between_two_records(form: str) -> None:
    # confluent-kafka's produce holds the interpreter lock throughout, so an interrupt() from
    # another thread lands between two records (docs/performance.md): the output stage queues the
    # record in hand at most and none after it. A compiled loop over the batch ran to its end first.
    import threading

    import numpy as np

    from worker.ledger.inflight import InFlight, InFlightTable
    from worker.formats.headers import InputHeaders
    from worker.ledger.offsets import PartitionOffsets
    from worker.operations.metrics import Metrics
    from worker.output.stage import OutputStage, _Finished

    if form == "compiled" and reports_module._reports is None:
        pytest.skip("worker/kafka/_reports.c is not built")

    class Acks:
        def embedded(self, seq: int) -> Any:
            return nothing

    class Codec:
        headers: list[Any] = []

        def values(self, qids: list[str], rows: Any, tokens: Any, truncated: Any) -> list[bytes]:
            return [b"{}"] * len(qids)

    n = 100_000
    latch = FatalLatch()
    # No broker to reach, and room for every record: only the interrupt stops the batch.
    producer = OutputProducer({"bootstrap.servers": "127.0.0.1:1", "queue.buffering.max.messages": 2 * n,
                               "log_level": 0}, latch, compiled_reports=form == "compiled")

    class Counting:
        """The producer, counting the records the stage's writes queued."""

        def __init__(self) -> None:
            self.entered = self.queued = 0

        def write(self, *args: Any) -> bool:
            self.entered += 1
            written = producer.write(*args)
            self.queued += written
            return written

    writer = Counting()
    table = InFlightTable()
    stage = OutputStage("out", Codec(), writer, table, Acks(), None, Metrics(), latch)  # type: ignore[arg-type]
    part = PartitionOffsets("in", 0, 0)
    recs = [InFlight(part, seq, f"q-{seq}", 3, False, None, 10, b"msg", InputHeaders([]))  # type: ignore[arg-type]
            for seq in range(n)]
    table.add_many(range(n), recs)

    def interrupt_once_writing() -> None:
        while not writer.entered:
            time.sleep(0.0005)
        producer.interrupt()

    interrupter = threading.Thread(target=interrupt_once_writing)
    interrupter.start()
    try:
        stage._emit(_Finished(list(range(n)), np.zeros((n, 4), np.float32), None))
    finally:
        producer.interrupt()
        interrupter.join(10)
    queued = writer.queued
    handed = sum(rec.msg is None for rec in recs)  # given to write(): the records queued and the one in hand
    producer.client.purge()
    assert queued < n, f"{queued} of {n} queued: the interrupt did not stop the batch part-way"
    assert handed == queued + 1 and not latch.is_set()


def nothing() -> None:
    pass


@pytest.mark.parametrize("form", FORMS)
def test_a_report_returns_none_whatever_its_callees_return(form: str) -> None:
    sink = report_sink(lambda topic, err, on_failed: "refused", lambda topic, exc: "broken",
                       compiled=form == "compiled") if form == "python" or reports_module._reports else None
    if sink is None:
        pytest.skip("worker/kafka/_reports.c is not built")

    def raises() -> int:
        raise KeyError(1)

    assert sink.report("out", lambda: 5, None)(None, None) is None
    assert sink.report("out", lambda: 5, None)(KafkaError(KafkaError._MSG_TIMED_OUT), None) is None
    assert sink.report("out", raises, None)(None, None) is None
    assert sink.take_delivered() == 2


@pytest.mark.parametrize("form", FORMS)
def test_what_the_owner_raises_propagates_alike(form: str) -> None:
    class Raising(Owner):
        def on_refused(self, topic: str, err: Any, on_failed: Any) -> None:
            raise ValueError(f"refused {topic}")

        def on_broken(self, topic: str, exc: Exception) -> None:
            raise LookupError(f"broken {topic}: {exc!r}")

    sink = sink_of(form, Raising())

    def raises() -> None:
        raise KeyError(1)

    with pytest.raises(ValueError, match="refused out") as refused:
        sink.report("out", nothing, None)(KafkaError(KafkaError._MSG_TIMED_OUT), None)
    with pytest.raises(LookupError, match="broken out: KeyError") as broken:
        sink.report("out", raises, None)(None, None)
    # Raised where no other exception is being handled: nothing chained to either.
    assert (refused.value.__context__, broken.value.__context__) == (None, None)
    assert sink.take_delivered() == 1  # the broker had the second; the first was refused


@pytest.mark.parametrize("form", FORMS)
def test_both_forms_refuse_other_arguments_alike(form: str) -> None:
    sink = sink_of(form, Owner())
    report = sink.report("out", nothing, None)
    for args, kwargs in (((None,), {}), ((None, None, None), {}), ((None,), {"msg": None}),
                         ((), {"err": None, "msg": None})):
        with pytest.raises(TypeError):
            report(*args, **kwargs)
    for args in (("out", nothing), ("out", nothing, None, None)):
        with pytest.raises(TypeError):
            sink.report(*args)
    with pytest.raises(TypeError):
        report_sink(print, "not callable", compiled=form == "compiled")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        report_sink("not callable", print, compiled=form == "compiled")  # type: ignore[arg-type]
    assert sink.take_delivered() == 0
    # Any err but None is a failed write, as confluent-kafka only ever passes None or a KafkaError.
    owner = Owner()
    sink = sink_of(form, owner)
    sink.report("out", nothing, None)(0, None)
    assert owner.refused == [("out", 0, None)] and sink.take_delivered() == 0
