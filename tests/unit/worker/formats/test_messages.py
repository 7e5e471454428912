"""Message formats against their JSON Schemas, and every rejection reason."""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from typing import Any

import numpy as np
import orjson
import pytest
from jsonschema import Draft202012Validator

from tests.conftest import ROOT
from worker.output.dead_letter_record import dead_letter_record
from worker.formats.headers import InputHeaders, read_headers
from worker.settings.schema import Settings
from worker.formats.messages import (
    H_REASON, H_SRC_OFFSET, Keyword, OutputCodec, Rejection, decode_embedding, decode_input, is_blank,
)

SCHEMAS = ROOT / "schemas"


def schema(name: str) -> Draft202012Validator:
    s = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    Draft202012Validator.check_schema(s)
    return Draft202012Validator(s)


@pytest.mark.parametrize("name", ["input", "output", "dead-letter"])
def test_schema_examples_validate(name: str) -> None:
    v = schema(name)
    examples = v.schema["examples"]
    assert examples
    for ex in examples:
        v.validate(ex)


def test_example_files_decode() -> None:
    example = (SCHEMAS / "examples" / "input.json").read_bytes()
    got = decode_input(b"k", example, fmt="json", max_bytes=16384)
    assert isinstance(got, Keyword)
    schema("input").validate(orjson.loads(example))


BAD_JSON = [
    (None, "null_value"),
    (b"x" * 20000, "oversized"),
    (b"\xff\xfe{}", "not_utf8"),
    (b"{not json", "malformed_json"),
    (b"[1, 2]", "not_an_object"),
    (b'{"text": "shoes"}', "missing_id"),
    (b'{"id": 7, "text": "shoes"}', "id_not_string"),
    (b'{"id": "", "text": "shoes"}', "empty_id"),
    (b'{"id": "q"}', "missing_text"),
    (b'{"id": "q", "text": ["shoes"]}', "text_not_string"),
    (b'{"id": "q", "text": " \\t\\n "}', "empty_text"),
]


@pytest.mark.parametrize(("value", "reason"), BAD_JSON)
def test_json_rejections(value: bytes | None, reason: str) -> None:
    got = decode_input(b"key", value, fmt="json", max_bytes=16384)
    assert isinstance(got, Rejection)
    assert got.reason == reason
    assert got.detail
    # Every reason the decoder can give is listed in the dead-letter schema.
    assert reason in schema("dead-letter").schema["properties"]["reason"]["enum"]
    # Whatever the schema accepts as input must not be rejected, and vice versa.
    if value is not None and reason not in ("oversized", "not_utf8", "malformed_json"):
        assert not schema("input").is_valid(orjson.loads(value))


def test_json_accepts_extra_fields_and_unicode() -> None:
    got = decode_input(None, '{"id": "q-1", "text": "café 東京 🙂", "src": 1}'.encode(), fmt="json", max_bytes=100)
    assert got == Keyword("q-1", "café 東京 🙂")


def test_raw_format() -> None:
    assert decode_input(b"q-9", b"miami white pages", fmt="raw", max_bytes=100) == Keyword("q-9", "miami white pages")
    assert decode_input(None, b"shoes", fmt="raw", max_bytes=100).reason == "missing_key"  # type: ignore[union-attr]
    assert decode_input(b"\xff", b"shoes", fmt="raw", max_bytes=100).reason == "not_utf8"  # type: ignore[union-attr]
    assert decode_input(b"q", b"   ", fmt="raw", max_bytes=100).reason == "empty_text"  # type: ignore[union-attr]
    # A raw value that happens to be JSON is just text.
    assert decode_input(b"q", b'{"id": 1}', fmt="raw", max_bytes=100) == Keyword("q", '{"id": 1}')


def test_size_limit_is_inclusive() -> None:
    value = orjson.dumps({"id": "q", "text": "a" * 50})
    assert isinstance(decode_input(None, value, fmt="json", max_bytes=len(value)), Keyword)
    assert decode_input(None, value, fmt="json", max_bytes=len(value) - 1).reason == "oversized"  # type: ignore[union-attr]


@pytest.mark.parametrize(("key", "headers_bytes", "largest"), [(b"k" * 20000, 0, "key"), (b"k", 30000, "headers")])
def test_size_check_counts_key_and_headers(key: bytes, headers_bytes: int, largest: str) -> None:
    value = b'{"id": "q", "text": "shoes"}'
    assert isinstance(decode_input(None, value, fmt="json", max_bytes=16384), Keyword)  # the value alone fits
    got = decode_input(key, value, fmt="json", max_bytes=16384, headers_bytes=headers_bytes)
    assert isinstance(got, Rejection) and got.reason == "oversized"
    total = len(key) + len(value) + headers_bytes
    assert f"record is {total} bytes" in got.detail and f"largest: {largest}" in got.detail
    # Exactly at the limit still passes: the bound is on key + value + headers.
    assert isinstance(decode_input(key, value, fmt="json", max_bytes=total, headers_bytes=headers_bytes), Keyword)


INVISIBLE = ["\u200b\u200b", "\x00\x01", "\u200d\ufeff", "\u2028\u2029", " \u00a0\u3000\t", "\u00ad",
             "\ufe0f", "\u3164", "\u202e\u2066\u2069", "\U000e0001\U000e0041", "\x7f\x85", ""]


@pytest.mark.parametrize("text", INVISIBLE)
def test_invisible_only_text_is_empty_text(text: str) -> None:
    assert is_blank(text)
    got = decode_input(b"q", orjson.dumps({"id": "q", "text": text}), fmt="json", max_bytes=1000)
    assert isinstance(got, Rejection) and got.reason == "empty_text"
    assert decode_input(b"q", text.encode(), fmt="raw", max_bytes=1000).reason == "empty_text"  # type: ignore[union-attr]


@pytest.mark.parametrize("text", [
    "a\u200b", "\u200bshoes\u200b", "🙂", "東京", "\u0600", "\u06dd", "\ue000", "\u0301", "0", "\u200d🙂",
])
def test_visible_text_is_content(text: str) -> None:
    # Letters, digits, emoji, visible format signs (Arabic number sign, end of ayah), private-use
    # glyphs and combining marks show as something, so they are not empty.
    assert not is_blank(text)
    assert decode_input(b"q", orjson.dumps({"id": "q", "text": text}), fmt="json", max_bytes=1000) == Keyword("q", text)


@pytest.mark.parametrize(("encoding", "tol"), [("float-list", 1e-7), ("base64-f32", 0.0), ("base64-f16", 1e-3)])
def test_output_round_trip(encoding: str, tol: float) -> None:
    rng = np.random.default_rng(0)
    vec = rng.standard_normal(384).astype(np.float32)
    vec /= np.linalg.norm(vec)
    codec = OutputCodec(model="all-MiniLM-L6-v2", dim=384, encoding=encoding)  # type: ignore[arg-type]
    obj = orjson.loads(codec.value("q-1", vec, tokens=5, truncated=False))
    schema("output").validate(obj)
    assert obj["id"] == "q-1" and obj["dim"] == 384 and obj["encoding"] == encoding
    back = decode_embedding(obj["embedding"], encoding)  # type: ignore[arg-type]
    assert back.dtype == np.float32 and back.shape == (384,)
    np.testing.assert_allclose(back, vec, atol=tol, rtol=0)
    headers = dict(codec.headers)
    assert headers["kwe-encoding"] == encoding.encode() and headers["kwe-dim"] == b"384"


def test_base64_is_little_endian_float32_from_the_schema_alone() -> None:
    # A consumer in another language follows the schema text: base64 of little-endian float32.
    codec = OutputCodec(model="m", dim=2, encoding="base64-f32")
    obj = orjson.loads(codec.value("q", np.array([1.0, -2.5], dtype=np.float32), tokens=3, truncated=False))
    raw = base64.b64decode(obj["embedding"])
    assert np.frombuffer(raw, dtype="<f4").tolist() == [1.0, -2.5]


def test_dead_letter_keeps_original_bytes_and_source() -> None:
    rec = dead_letter_record(Rejection("malformed_json", "bad"), topic="keywords", partition=3, offset=1207,
                             timestamp_ms=1764400000000, key=b"q-9", value=b"{oops", headers=[("trace", b"abc")],
                             max_bytes=262144)
    obj, headers = orjson.loads(rec.value), rec.headers
    schema("dead-letter").validate(obj)
    assert base64.b64decode(obj["value_b64"]) == b"{oops"
    assert base64.b64decode(obj["key_b64"]) == b"q-9"
    assert obj["source"] == {"topic": "keywords", "partition": 3, "offset": 1207, "timestamp_ms": 1764400000000}
    h = dict(headers)
    assert h["trace"] == b"abc" and h[H_REASON] == b"malformed_json" and h[H_SRC_OFFSET] == b"1207"


def test_dead_letter_of_a_tombstone() -> None:
    rec = dead_letter_record(Rejection("null_value", "none"), topic="t", partition=0, offset=0, timestamp_ms=None,
                             key=None, value=None, headers=None, max_bytes=262144)
    obj = orjson.loads(rec.value)
    schema("dead-letter").validate(obj)
    assert obj["value_b64"] is None and obj["key_b64"] is None


def test_input_headers_sort_names_that_are_not_utf8() -> None:
    got = InputHeaders.of([("trace", b"t"), (b"bin", None), (b"\xff\xfe", b"v"), ("caf\udcff", b"w")])
    assert got.headers == [("trace", b"t"), ("bin", None)]
    assert got.not_utf8 == [(b"\xff\xfe", b"v"), (b"caf\xed\xb3\xbf", b"w")]
    assert got.size == (5 + 1) + (3 + 0) + (2 + 1) + (6 + 1)  # names and values, null counting 0
    assert InputHeaders.of(None) == InputHeaders()


class _FakeMessage:
    def __init__(self, headers: Any) -> None:
        self._headers = headers

    def headers(self) -> Any:
        return self._headers

    def set_headers(self, headers: Any) -> None:
        self._headers = headers


class _RaisingMessage(_FakeMessage):
    """headers() fails once the way confluent-kafka does, then returns what it cached."""

    def __init__(self, cached: Any, bad_name: bytes) -> None:
        super().__init__(cached)
        self.bad_name = bad_name
        self.calls = 0

    def headers(self) -> Any:
        self.calls += 1
        if self.calls == 1:
            try:
                self.bad_name.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SystemError("<method 'headers'> returned a result with an exception set") from exc
        return self._headers


def test_read_headers_of_plain_messages() -> None:
    assert read_headers(_FakeMessage(None)) == InputHeaders()
    got = read_headers(_FakeMessage([("a", b"1"), ("b", None)]))
    assert got.headers == [("a", b"1"), ("b", None)] and got.note is None and got.size == 3


def test_read_headers_never_raises() -> None:
    # The real client's failure (a NULL name slot) is exercised in test_messages_kafka.py; here,
    # any exception, and a second call that fails too, end in a note instead of an exception.
    msg = _RaisingMessage(None, b"\xff")
    got = read_headers(msg)
    assert got.headers == [] and got.note and "UnicodeDecodeError" in got.note and "dropped" in got.note
    assert msg.headers() == []  # replaced, so a later call is safe

    class Broken(_FakeMessage):
        def headers(self) -> Any:
            raise RuntimeError("boom")

    got = read_headers(Broken(None))
    assert got.headers == [] and got.note and "boom" in got.note


def _check_dead_letter(rec: Any, *, max_bytes: int, key: bytes | None, value: bytes | None,
                       headers: InputHeaders) -> dict[str, Any]:
    assert rec.size <= max_bytes
    assert rec.size == len(rec.key or b"") + len(rec.value) + sum(len(n.encode()) + len(v or b"") + 10
                                                                  for n, v in rec.headers)
    obj = orjson.loads(rec.value)
    schema("dead-letter").validate(obj)
    assert obj["source"] == {"topic": "keywords", "partition": 3, "offset": 1207, "timestamp_ms": 1764400000000}
    h = dict(rec.headers)
    assert h[H_REASON] == b"oversized" and h[H_SRC_OFFSET] == b"1207"
    cut = {c["field"]: c for c in obj["cut"]}
    for name, original in (("key", key), ("value", value)):
        got = obj[f"{name}_b64"]
        if original is None:
            assert got is None and name not in cut
        elif name in cut:
            assert cut[name]["size"] == len(original)
            assert cut[name]["sha256"] == hashlib.sha256(original).hexdigest()
            assert base64.b64decode(got) == original[:cut[name]["kept"]]
        else:
            assert base64.b64decode(got) == original
    assert rec.key == (key if "key" not in cut else None)
    if "headers" in cut:
        assert obj["headers"] == [] and obj["headers_not_utf8"] == []
        assert cut["headers"]["count"] == len(headers.headers) + len(headers.not_utf8)
        canon = b"".join(struct.pack(">I", len(n)) + n + (struct.pack(">i", -1) if v is None else
                                                          struct.pack(">i", len(v)) + v)
                         for n, v in [(n.encode(), v) for n, v in headers.headers] + list(headers.not_utf8))
        assert cut["headers"]["sha256"] == hashlib.sha256(canon).hexdigest()
        assert cut["headers"]["size"] == len(canon)
        assert set(h) == {"kwe-dlq-reason", "kwe-source-topic", "kwe-source-partition", "kwe-source-offset"}
    else:
        assert [(n, base64.b64decode(v) if v else v) for n, v in obj["headers"]] == headers.headers
        assert rec.headers[:len(headers.headers)] == headers.headers
    return obj


SIZES = [
    (b"q-1", b"x" * 900_000, []),                                  # a 900 KB keyword
    (b"k" * 700_000, b'{"id": "q", "text": "shoes"}', []),        # a 700 KB key
    (b"k" * 300_000, b"v" * 300_000, [("trace", b"abc")]),         # both large, a small header kept
    (b"q", b"v" * 10, [("big", b"h" * 500_000), ("trace", b"t")]),  # one huge header: headers dropped
    (None, b"v" * 400_000, [("h", None)]),
    (b"q" * 150_000, None, []),                                   # a tombstone with a large key
    (b"q", b"v", [(f"h-{i}", b"x" * 20) for i in range(5000)]),    # many small headers
]


@pytest.mark.parametrize("max_bytes", [4096, 65536, Settings().dead_letter_max_bytes])
@pytest.mark.parametrize(("key", "value", "headers"), SIZES)
def test_dead_letter_stays_within_its_limit(max_bytes: int, key: bytes | None, value: bytes | None,
                                            headers: list[tuple[str, bytes | None]]) -> None:
    hdrs = InputHeaders.of(headers)
    rec = dead_letter_record(Rejection("oversized", "too big"), topic="keywords", partition=3, offset=1207,
                             timestamp_ms=1764400000000, key=key, value=value, headers=hdrs, max_bytes=max_bytes)
    obj = _check_dead_letter(rec, max_bytes=max_bytes, key=key, value=value, headers=hdrs)
    assert obj["cut"]  # every case here is too large for every limit
    if key is not None and len(key) > 100 or value is not None and len(value) > 100:
        # The limit is used, not wasted: the prefixes kept fill most of it.
        assert rec.size > max_bytes * 0.6
    else:
        # Headers are kept or dropped as a whole (their digest covers them all).
        assert [c["field"] for c in obj["cut"]] == ["headers"]


def test_dead_letter_cut_keeps_what_fits_whole() -> None:
    key, value = b"q-77", b"x" * 900_000
    hdrs = InputHeaders.of([("trace", b"abc")])
    rec = dead_letter_record(Rejection("oversized", "too big"), topic="keywords", partition=3, offset=1207,
                             timestamp_ms=1764400000000, key=key, value=value, headers=hdrs, max_bytes=65536)
    obj = _check_dead_letter(rec, max_bytes=65536, key=key, value=value, headers=hdrs)
    # The small key and header are kept whole (the key still keys the record); the value is a prefix.
    assert [c["field"] for c in obj["cut"]] == ["value"] and rec.key == key
    assert dict(rec.headers)["trace"] == b"abc"


def test_dead_letter_under_the_limit_is_whole() -> None:
    hdrs = InputHeaders.of([("trace", b"abc"), (b"\xff", b"v")])
    rec = dead_letter_record(Rejection("oversized", "too big"), topic="keywords", partition=3, offset=1207,
                             timestamp_ms=1764400000000, key=b"q", value=b"v" * 3000, headers=hdrs, max_bytes=65536)
    obj = _check_dead_letter(rec, max_bytes=65536, key=b"q", value=b"v" * 3000, headers=hdrs)
    assert obj["cut"] == [] and obj["headers_not_utf8"] == [[base64.b64encode(b"\xff").decode(), "dg=="]]
    # A name that is not UTF-8 is in the value only: confluent-kafka cannot write it as a header.
    assert [n for n, _ in rec.headers] == ["trace", "kwe-dlq-reason", "kwe-source-topic", "kwe-source-partition",
                                           "kwe-source-offset"]


def test_dead_letter_detail_is_bounded_and_encodable() -> None:
    rec = dead_letter_record(Rejection("inference_error", "\x00\udcff" * 100_000), topic="keywords", partition=0,
                             offset=1, timestamp_ms=None, key=None, value=b"v", headers=None, max_bytes=4096)
    assert rec.size <= 4096
    obj = orjson.loads(rec.value)
    schema("dead-letter").validate(obj)
    assert obj["detail"].endswith("...")


def test_dead_letter_example_in_the_schema_is_what_the_code_writes() -> None:
    examples = schema("dead-letter").schema["examples"]
    cut = next(ex for ex in examples if ex["cut"])
    key, value = b"q-9", ('{"id": "q-9", "text": "' + "running shoes " * 60 + '"}').encode()
    rec = dead_letter_record(Rejection("oversized", cut["detail"]), topic="keywords", partition=3, offset=1207,
                             timestamp_ms=1764400000000, key=key, value=value,
                             headers=InputHeaders.of([("trace-id", b"abc123"), (b"\xffsrc", b"x")]), max_bytes=1024)
    assert orjson.loads(rec.value) == cut


# ------------------------------------------------------------------ output_fields


def test_output_fields_rename_and_drop_in_the_records_order() -> None:
    from worker.settings.output_fields import parse_output_fields

    fields = parse_output_fields(["embedding=vector", "-model", " -tokens "])
    codec = OutputCodec(model="m", dim=2, encoding="float-list", fields=fields)
    record = orjson.loads(codec.value("q-1", np.array([0.6, 0.8], np.float32), 4, False))
    assert list(record) == ["id", "vector", "encoding", "dim", "truncated"]
    assert record["vector"] == pytest.approx([0.6, 0.8])
    plain = orjson.loads(OutputCodec(model="m", dim=2, encoding="float-list").value(
        "q-1", np.array([0.6, 0.8], np.float32), 4, False))
    assert list(plain) == ["id", "embedding", "encoding", "dim", "model", "tokens", "truncated"]


@pytest.mark.parametrize(("items", "error"), [
    (["vector=embedding"], "'vector' is not an output field"),
    (["embedding"], "expected field=new_name"),
    (["embedding="], "write -embedding to drop"),
    (["embedding=v", "-embedding"], "named twice"),
    (["embedding=id"], "two output fields would be named 'id'"),
])
def test_output_fields_refuse_what_cannot_be_meant(items: list[str], error: str) -> None:
    from worker.settings.output_fields import parse_output_fields

    with pytest.raises(ValueError, match=error):
        parse_output_fields(items)


def test_output_fields_are_checked_with_the_settings() -> None:
    from worker.settings.schema import Settings, SettingsError

    assert Settings(output_fields=("embedding=vector", "id=point_id")).output_fields == ("embedding=vector", "id=point_id")
    with pytest.raises(SettingsError, match="output_fields.*not an output field"):
        Settings(output_fields=("vec=x",))
    with pytest.raises(SettingsError, match="JSON output"):
        Settings(output_fields=("-model",), output_format="avro", schema_registry_url="http://sr")
    with pytest.raises(SettingsError, match="needs schema_registry_url"):
        Settings(input_format="avro")


def test_output_fields_make_a_qdrant_point_the_query_id_as_a_uuid_and_a_constant_collection() -> None:
    import uuid

    from worker.settings.output_fields import parse_output_fields

    fields = parse_output_fields(["embedding=vector", "id=query_id", "uuid=id", "+collection_name=keywords",
                                  "-model", "-encoding", "-dim", "-tokens", "-truncated"])
    record = orjson.loads(OutputCodec(model="m", dim=2, encoding="float-list", fields=fields).value(
        "q-1", np.array([0.6, 0.8], np.float32), 4, False))
    assert record == {"query_id": "q-1", "vector": pytest.approx([0.6, 0.8]),
                      "id": str(uuid.uuid5(uuid.NAMESPACE_URL, "q-1")), "collection_name": "keywords"}
    assert uuid.UUID(record["id"]).version == 5
    with pytest.raises(ValueError, match="two output fields would be named 'id'"):
        parse_output_fields(["uuid=id"])
    with pytest.raises(ValueError, match="expected \\+name=value"):
        parse_output_fields(["+collection_name"])


# ------------------------------------------------------------------ batch encoding


@pytest.mark.parametrize("encoding", ["float-list", "base64-f32", "base64-f16", "int8", "binary"])
@pytest.mark.parametrize("variant", ["plain", "truncate", "prompt", "not-normalized", "fields"])
def test_a_batch_encodes_each_record_as_value_does_byte_for_byte(encoding: str, variant: str) -> None:
    from worker.settings.output_fields import parse_output_fields

    rng = np.random.default_rng(7)
    rows = rng.standard_normal((9, 48)).astype(np.float32)
    rows[0] = 0.0  # zeros, and values that print in exponent form
    rows[1, :3] = (1e-8, -3.5e12, 0.1)
    rows /= np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    kw: dict[str, Any] = {"model": "m\u00e9-\"q\"", "dim": 48, "encoding": encoding}
    if encoding == "int8":
        kw["int8_range"] = (-0.4, 0.4)
    if variant == "truncate":
        kw.update(dim=16, truncate_dim=16)
    elif variant == "prompt":
        kw.update(prompt="query: ", prompt_name="query")
    elif variant == "not-normalized":
        kw.update(normalized=False)
    elif variant == "fields":
        kw.update(fields=parse_output_fields(["embedding=vector", "-tokens", "+source=kafka"]))
    codec = OutputCodec(**kw)
    qids = ["q-1", "\u00fcber \"quoted\"", "", "x" * 300, "5", "6", "7", "8", "9"]
    tokens = [3, 7, 256, 1, 2, 3, 4, 5, 6]
    truncated = [False, True, True, False, False, False, False, False, True]
    batch = codec.values(qids, rows, tokens, truncated)
    assert batch == [codec.value(q, rows[i], tokens[i], truncated[i]) for i, q in enumerate(qids)]
    assert codec.values(qids[:1], rows[:1], tokens[:1], truncated[:1]) == batch[:1]
    assert codec.values([], rows[:0], [], []) == []
