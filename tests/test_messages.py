"""Message formats against their JSON Schemas, and every rejection reason."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import orjson
import pytest
from jsonschema import Draft202012Validator

from worker.kafka.messages import (
    H_REASON, H_SRC_OFFSET, Keyword, OutputCodec, Rejection, dead_letter, decode_embedding, decode_input,
)

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"


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
    value, headers = dead_letter(Rejection("malformed_json", "bad"), topic="keywords", partition=3, offset=1207,
                                 timestamp_ms=1764400000000, key=b"q-9", value=b"{oops",
                                 headers=[("trace", b"abc")])
    obj = orjson.loads(value)
    schema("dead-letter").validate(obj)
    assert base64.b64decode(obj["value_b64"]) == b"{oops"
    assert base64.b64decode(obj["key_b64"]) == b"q-9"
    assert obj["source"] == {"topic": "keywords", "partition": 3, "offset": 1207, "timestamp_ms": 1764400000000}
    h = dict(headers)
    assert h["trace"] == b"abc" and h[H_REASON] == b"malformed_json" and h[H_SRC_OFFSET] == b"1207"


def test_dead_letter_of_a_tombstone() -> None:
    value, _ = dead_letter(Rejection("null_value", "none"), topic="t", partition=0, offset=0, timestamp_ms=None,
                           key=None, value=None, headers=None)
    obj = orjson.loads(value)
    schema("dead-letter").validate(obj)
    assert obj["value_b64"] is None and obj["key_b64"] is None
