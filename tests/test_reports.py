"""A produced record's delivery callback (worker/kafka/_reports.c, and its Python form in
worker/kafka/reports.py): what each outcome calls, the delivery count the delivery thread reads
after a poll, that the compiled one holds no reference too many, and that confluent-kafka's own C
code calls it as it calls a Python function."""

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


def test_the_compiled_callback_refuses_other_arguments() -> None:
    sink = sink_of("compiled", Owner())
    report = sink.report("out", lambda: None, None)
    for args, kwargs in (((None,), {}), ((None, None, None), {}), ((None,), {"msg": None})):
        with pytest.raises(TypeError):
            report(*args, **kwargs)
    with pytest.raises(TypeError):
        sink.report("out", lambda: None)
    with pytest.raises(TypeError):
        type(sink)(print, "not callable")


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
def test_produce_many_queues_each_record_in_order_with_its_own_report(form: str) -> None:
    owner, client = Owner(), Client()
    sink = sink_of(form, owner)
    keys, values, acked, on_delivered = batch(5)
    headers = [("kwe-model", b"m")]
    assert sink.produce_many(client.produce, "out", keys, values, headers, on_delivered, None, 0) == (5, None)
    assert [(q[0], q[1], q[2], q[3], q[5], q[6], q[7]) for q in client.queued] == \
        [("out", v, k, -1, None, 0, headers) for k, v in zip(keys, values)]
    assert len({id(q[4]) for q in client.queued}) == 5
    client.deliver()
    assert acked == [0, 1, 2, 3, 4] and sink.take_delivered() == 5
    assert sink.produce_many(client.produce, "out", keys, values, headers, on_delivered, None, 5) == (5, None)
    assert client.queued == []


@pytest.mark.parametrize("form", FORMS)
def test_produce_many_stops_at_a_call_that_raises_and_at_an_interrupt(form: str) -> None:
    owner = Owner()
    sink = sink_of(form, owner)
    keys, values, _, on_delivered = batch(4)
    client = Client(refuse=(b"v2",))
    done, exc = sink.produce_many(client.produce, "out", keys, values, [], on_delivered, None, 0)
    assert done == 2 and isinstance(exc, KafkaException) and exc.__traceback__ is not None
    assert sink.produce_many(client.produce, "out", keys, values, [], on_delivered, None, 3) == (4, None)
    assert [q[1] for q in client.queued] == [b"v0", b"v1", b"v3"]
    sink.interrupted = True
    assert sink.produce_many(client.produce, "out", keys, values, [], on_delivered, None, 0) == (0, None)
    with pytest.raises(ValueError):
        sink.produce_many(client.produce, "out", keys, values[:3], [], on_delivered, None, 0)
    with pytest.raises(ValueError):
        sink.produce_many(client.produce, "out", keys, values, [], on_delivered, None, 5)


@pytest.mark.parametrize("form", FORMS)
def test_the_producer_waits_out_a_full_queue_and_refuses_a_record_as_produce_does(form: str) -> None:
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
    assert producer.produce_many("out", keys, values, [], on_delivered, take_over) == 6
    assert [q[1] for q in client.queued] == [b"v0", b"v1", b"v2", b"v4", b"v5"] and len(taken) == 1
    assert not latch.is_set()
    client.deliver()
    assert acked == [0, 1, 2, 4, 5]
    # Without a taker the refusal stops the worker: what was queued before it stays the count.
    assert producer.write_many([0, 1, 2, 3], "out", keys[:4], values[:4], [], on_delivered[:4]) == 3
    assert latch.is_set() and "cannot write to topic" in str(latch.error)
    # Interrupted: nothing more is queued.
    producer.interrupt()
    assert producer.write_many([4], "out", keys[4:5], values[4:5], [], on_delivered[4:5]) == 0
