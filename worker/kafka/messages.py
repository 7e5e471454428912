"""Message formats: decode and validate input, encode embeddings and dead-letter records.

The wire formats are specified in schemas/ (input, output, dead-letter); this module is
their one implementation. Decoding never raises on bad input: it returns a `Rejection`
whose reason goes to the dead-letter topic.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Literal

import numpy as np
import orjson

InputFormat = Literal["json", "raw"]
OutputEncoding = Literal["float-list", "base64-f32", "base64-f16"]
Headers = list[tuple[str, bytes | None]]

# Header names, also in schemas/*.json.
H_MODEL = "kwe-model"
H_ENCODING = "kwe-encoding"
H_DIM = "kwe-dim"
H_REASON = "kwe-dlq-reason"
H_SRC_TOPIC = "kwe-source-topic"
H_SRC_PARTITION = "kwe-source-partition"
H_SRC_OFFSET = "kwe-source-offset"


@dataclass(frozen=True, slots=True)
class Keyword:
    id: str
    text: str


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: str
    detail: str


def decode_input(key: bytes | None, value: bytes | None, *, fmt: InputFormat, max_bytes: int) -> Keyword | Rejection:
    if value is None:
        return Rejection("null_value", "the message has no value (tombstone)")
    if len(value) > max_bytes:
        return Rejection("oversized", f"value is {len(value)} bytes, above max_message_bytes={max_bytes}")
    try:
        raw_text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Rejection("not_utf8", f"value is not valid UTF-8 ({exc.reason} at byte {exc.start})")
    if fmt == "raw":
        if key is None:
            return Rejection("missing_key", "input_format=raw needs the query ID in the message key")
        try:
            qid = key.decode("utf-8")
        except UnicodeDecodeError as exc:
            return Rejection("not_utf8", f"key is not valid UTF-8 ({exc.reason} at byte {exc.start})")
        return _checked(qid, raw_text)
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        return Rejection("malformed_json", f"value is not JSON ({exc})")
    if not isinstance(obj, dict):
        return Rejection("not_an_object", f"value is a JSON {type(obj).__name__}, expected an object")
    if "id" not in obj:
        return Rejection("missing_id", "the object has no 'id'")
    if not isinstance(obj["id"], str):
        return Rejection("id_not_string", f"'id' is a {type(obj['id']).__name__}, expected a string")
    if "text" not in obj:
        return Rejection("missing_text", "the object has no 'text'")
    if not isinstance(obj["text"], str):
        return Rejection("text_not_string", f"'text' is a {type(obj['text']).__name__}, expected a string")
    return _checked(obj["id"], obj["text"])


def _checked(qid: str, text: str) -> Keyword | Rejection:
    if not qid:
        return Rejection("empty_id", "the query ID is empty; it keys the output record")
    if not text.strip():
        return Rejection("empty_text", "'text' is empty or whitespace only")
    return Keyword(qid, text)


def encode_embedding(vec: np.ndarray, encoding: OutputEncoding) -> np.ndarray | str:
    """The output's "embedding" value, to be written by orjson with OPT_SERIALIZE_NUMPY.

    float-list: the float32 array itself, which orjson writes with each number in the shortest
    form that reads back as the same float32 (about half the bytes of float64 reprs, and faster).
    """
    if encoding == "float-list":
        return np.ascontiguousarray(vec, dtype=np.float32)
    dtype = "<f4" if encoding == "base64-f32" else "<f2"
    return base64.b64encode(vec.astype(dtype).tobytes()).decode("ascii")


def decode_embedding(value: list[float] | str, encoding: OutputEncoding) -> np.ndarray:
    """The inverse of encode_embedding, for consumers and tests."""
    if encoding == "float-list":
        return np.asarray(value, dtype=np.float32)
    dtype = "<f4" if encoding == "base64-f32" else "<f2"
    return np.frombuffer(base64.b64decode(value), dtype=dtype).astype(np.float32)


@dataclass(frozen=True)
class OutputCodec:
    """Encodes embeddings for one model and encoding; headers are built once."""

    model: str
    dim: int
    encoding: OutputEncoding

    @property
    def headers(self) -> Headers:
        return [(H_MODEL, self.model.encode()), (H_ENCODING, self.encoding.encode()), (H_DIM, str(self.dim).encode())]

    def value(self, qid: str, vec: np.ndarray, tokens: int, truncated: bool) -> bytes:
        return orjson.dumps({
            "id": qid,
            "embedding": encode_embedding(vec, self.encoding),
            "encoding": self.encoding,
            "dim": self.dim,
            "model": self.model,
            "tokens": tokens,
            "truncated": truncated,
        }, option=orjson.OPT_SERIALIZE_NUMPY)


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def dead_letter(rejection: Rejection, *, topic: str, partition: int, offset: int, timestamp_ms: int | None,
                key: bytes | None, value: bytes | None, headers: Headers | None) -> tuple[bytes, Headers]:
    """The dead-letter value and headers: the reason, the source position, and the original bytes."""
    original = list(headers or [])
    record = {
        "reason": rejection.reason,
        "detail": rejection.detail,
        "source": {"topic": topic, "partition": partition, "offset": offset, "timestamp_ms": timestamp_ms},
        "key_b64": _b64(key),
        "value_b64": _b64(value),
        "headers": [[name, _b64(v)] for name, v in original],
    }
    out_headers = original + [
        (H_REASON, rejection.reason.encode()),
        (H_SRC_TOPIC, topic.encode()),
        (H_SRC_PARTITION, str(partition).encode()),
        (H_SRC_OFFSET, str(offset).encode()),
    ]
    return orjson.dumps(record), out_headers
