"""Message handling against the real broker: header names that are not UTF-8, bounded dead letters."""

from __future__ import annotations

import base64
import json
import operator
import time
from collections.abc import Callable

import orjson
import pytest
from confluent_kafka import Consumer, KafkaException, Message, Producer
from jsonschema import Draft202012Validator

from tests.conftest import ROOT
from tests.kafka_tools import produce_with_raw_headers
from worker.output.dead_letter_record import dead_letter_record
from worker.formats.headers import InputHeaders, read_headers
from worker.formats.messages import Rejection
from worker.settings.schema import Settings

pytestmark = pytest.mark.kafka

DLQ_SCHEMA = Draft202012Validator(json.loads(
    (ROOT / "schemas" / "dead-letter.schema.json").read_text()))


def _consume_one(bootstrap: str, topic: str, group: str) -> Message:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False})
    c.subscribe([topic])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is not None and not msg.error():
                return msg
        raise AssertionError(f"nothing to read on {topic}")
    finally:
        c.close()


def _produce(bootstrap: str, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes | None]]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    errors: list[object] = []
    p.produce(topic, key=key, value=value, headers=headers, on_delivery=lambda err, _m: errors.append(err))
    assert p.flush(30) == 0
    assert errors == [None]


def test_a_header_name_that_is_not_utf8_is_kept_as_bytes(kafka_bootstrap: str, make_topic: Callable[..., str],
                                                        group_id: str) -> None:
    topic, dlq = make_topic("in"), make_topic("dlq")
    produce_with_raw_headers(kafka_bootstrap, topic,
                             [(b"q-1", b"{oops", [(b"trace", b"t-1"), (b"\xff\xfebad", b"v-2"), (b"after", None)])])
    msg = _consume_one(kafka_bootstrap, topic, group_id)
    # What confluent-kafka itself does with such a record (why read_headers exists); called
    # through the C API so that the error is raised here, not left pending (see read_headers).
    with pytest.raises(SystemError) as info:
        operator.methodcaller("headers")(msg)
    assert isinstance(info.value.__cause__, UnicodeDecodeError)
    # Its cached list now holds a NULL name that crashes the interpreter when touched;
    # read_headers still gets through it (the bad name itself is gone with the exception).
    late = read_headers(msg)
    assert late.headers == [("trace", b"t-1"), ("after", None)]
    assert late.not_utf8 == [(None, b"v-2")] and late.note and "without the name" in late.note
    assert msg.headers() == [("trace", b"t-1"), ("after", None)]

    msg = _consume_one(kafka_bootstrap, topic, group_id + "-2")
    got = read_headers(msg)
    assert got.headers == [("trace", b"t-1"), ("after", None)]
    assert got.not_utf8 == [(b"\xff\xfebad", b"v-2")]
    assert got.note and "not valid UTF-8" in got.note
    assert msg.headers() == [("trace", b"t-1"), ("after", None)]  # safe to call again afterwards

    # The dead letter of that record is produced, and carries the raw name.
    rec = dead_letter_record(Rejection("malformed_json", "bad"), topic=topic, partition=msg.partition(),
                             offset=msg.offset(), timestamp_ms=msg.timestamp()[1], key=msg.key(), value=msg.value(),
                             headers=got, max_bytes=Settings().dead_letter_max_bytes)
    _produce(kafka_bootstrap, dlq, rec.key, rec.value, rec.headers)
    back = _consume_one(kafka_bootstrap, dlq, group_id + "-3")
    obj = orjson.loads(back.value())
    DLQ_SCHEMA.validate(obj)
    assert obj["headers_not_utf8"] == [[base64.b64encode(b"\xff\xfebad").decode(), base64.b64encode(b"v-2").decode()]]
    assert obj["headers"] == [["trace", base64.b64encode(b"t-1").decode()], ["after", None]]
    assert obj["notes"] == [got.note]
    assert dict(back.headers())["kwe-dlq-reason"] == b"malformed_json"


def test_several_bad_header_names_keep_every_value(kafka_bootstrap: str, make_topic: Callable[..., str],
                                                  group_id: str) -> None:
    topic = make_topic("in")
    produce_with_raw_headers(kafka_bootstrap, topic,
                             [(None, b"v", [(b"\xc3(", b"0"), (b"good", b"1"), (b"\xff\xfe", None), (b"", b"e")])])
    msg = _consume_one(kafka_bootstrap, topic, group_id)
    got = read_headers(msg)
    assert got.headers == [("good", b"1"), ("", b"e")]
    # The client keeps the bytes of one failed name at most: with two, both names are unknown.
    assert [v for _, v in got.not_utf8] == [b"0", None]
    assert got.note and "2 header name(s)" in got.note
    assert got.size == (4 + 1) + (0 + 1) + 1 + 0  # good, "", then the two values (names unknown)


def test_many_records_with_bad_header_names_leave_no_error_behind(kafka_bootstrap: str,
                                                                 make_topic: Callable[..., str], group_id: str) -> None:
    # A hot loop, as in the worker's poll thread: CPython specialises a plain msg.headers()
    # call site after a few dozen calls, after which the decode error stays pending and blows
    # up later in unrelated code. read_headers must read every record the same way.
    topic, n = make_topic("in"), 200
    produce_with_raw_headers(kafka_bootstrap, topic,
                             [(f"q-{i}".encode(), b"v", [(b"\xc3(", b"0"), (b"ok", b"1"), (b"\xff", None)])
                              for i in range(n)])
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group_id, "auto.offset.reset": "earliest"})
    c.subscribe([topic])
    seen: list[InputHeaders] = []
    deadline = time.monotonic() + 60
    while len(seen) < n and time.monotonic() < deadline:
        for msg in c.consume(100, timeout=0.5):  # plain Python work between reads, as a pending error would hit
            if not msg.error():
                seen.append(read_headers(msg))
    c.close()
    assert len(seen) == n
    assert all(h.headers == [("ok", b"1")] and [v for _, v in h.not_utf8] == [b"0", None] for h in seen)


def test_a_bounded_dead_letter_of_huge_key_and_value_is_accepted(kafka_bootstrap: str,
                                                                make_topic: Callable[..., str]) -> None:
    dlq = make_topic("dlq")
    key, value = b"k" * 700_000, b"x" * 900_000  # each under the broker's 1 MB default
    hdrs = InputHeaders.of([("trace", b"t")])
    limit = Settings().dead_letter_max_bytes

    def record(max_bytes: int):  # noqa: ANN202
        return dead_letter_record(Rejection("oversized", "too big"), topic="keywords", partition=0, offset=5,
                                  timestamp_ms=None, key=key, value=value, headers=hdrs, max_bytes=max_bytes)

    # Without a bound the record is 2.1 MB: the client refuses it (the crash loop of issue 10).
    whole = record(10**9)
    with pytest.raises(KafkaException) as info:
        Producer({"bootstrap.servers": kafka_bootstrap}).produce(dlq, key=whole.key, value=whole.value,
                                                                 headers=whole.headers)
    assert info.value.args[0].name() == "MSG_SIZE_TOO_LARGE"
    bounded = record(limit)
    assert bounded.size <= limit
    _produce(kafka_bootstrap, dlq, bounded.key, bounded.value, bounded.headers)
