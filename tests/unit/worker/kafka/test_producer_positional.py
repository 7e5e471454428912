"""OutputProducer passes confluent-kafka's `produce` every argument by position (a keyword costs the
C call a dictionary lookup for each of its eight parameters). That order is the C function's, not a
documented signature, so this checks it against the installed client: on librdkafka's own mock
cluster (in-process, on loopback), a record written through OutputProducer comes back with its key,
value and headers, in the topic it was written to, and its acknowledgement runs."""

from __future__ import annotations

import threading

from confluent_kafka import Consumer

from worker.deadline import Deadline
from worker.kafka.producer import OutputProducer
from worker.latch import FatalLatch


def test_a_record_keeps_its_key_value_and_headers_through_the_real_client() -> None:
    latch = FatalLatch()
    producer = OutputProducer({"test.mock.num.brokers": 1, "enable.idempotence": True, "acks": "all",
                               "log_level": 0}, latch, poll_interval_s=0.01)
    delivered = threading.Event()
    headers = [("kwe-model", b"m"), ("kwe-empty", None), ("kwe-encoding", b"float-list")]
    producer.start()
    try:
        assert producer.produce("embeddings", b"q-1", b'{"id":"q-1"}', headers, delivered.set)
        assert producer.produce("other", None, b"no key", [], lambda: None)
        assert producer.flush(Deadline.after(10.0)) == 0
        assert delivered.wait(5.0) and not latch.is_set(), latch.error
        brokers = producer.client.list_topics(timeout=5).brokers.values()
    finally:
        producer.stop(5.0)
    consumer = Consumer({"bootstrap.servers": ",".join(f"{b.host}:{b.port}" for b in brokers),
                         "group.id": "positional", "auto.offset.reset": "earliest", "log_level": 0})
    try:
        consumer.subscribe(["embeddings"])
        got = None
        deadline = Deadline.after(10.0)
        while got is None and not deadline.expired():
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                got = msg
    finally:
        consumer.close()
    assert got is not None, "the record never came back"
    assert (got.topic(), got.key(), got.value()) == ("embeddings", b"q-1", b'{"id":"q-1"}')
    assert got.headers() == headers
