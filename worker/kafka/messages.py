"""Message formats: decode and validate input, encode embeddings.

The wire formats are specified in schemas/ (input, output, dead-letter); this module is
their one implementation, with worker/kafka/headers.py (reading headers safely) and
worker/kafka/dead_letter_record.py (the dead-letter record). Decoding never raises on bad
input: it returns a `Rejection` whose reason goes to the dead-letter topic.
"""

from __future__ import annotations

import base64
import unicodedata
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import orjson

from kwe_core.vectors import (dequantize_int8, pack_binary, quantize_int8, truncate, unpack_binary)

InputFormat = Literal["json", "raw"]
OutputEncoding = Literal["float-list", "base64-f32", "base64-f16", "int8", "binary"]
Headers = list[tuple[str, bytes | None]]

# Header names, also in schemas/*.json.
H_MODEL = "kwe-model"
H_ENCODING = "kwe-encoding"
H_DIM = "kwe-dim"
H_INT8_RANGE = "kwe-int8-range"
H_PROMPT_NAME = "kwe-prompt-name"
H_PROMPT = "kwe-prompt"
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


def decode_input(key: bytes | None, value: bytes | None, *, fmt: InputFormat, max_bytes: int,
                 headers_bytes: int = 0) -> Keyword | Rejection:
    """Decodes and validates one input record; `max_bytes` bounds key + value + headers together."""
    if value is None:
        return Rejection("null_value", "the message has no value (tombstone)")
    key_bytes = len(key) if key is not None else 0
    total = key_bytes + len(value) + headers_bytes
    if total > max_bytes:
        parts = {"key": key_bytes, "value": len(value), "headers": headers_bytes}
        largest = max(parts, key=parts.__getitem__)
        return Rejection("oversized", f"record is {total} bytes (key {key_bytes}, value {len(value)}, headers "
                                      f"{headers_bytes}; largest: {largest}), above max_message_bytes={max_bytes}")
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
    if is_blank(text):
        return Rejection("empty_text", "'text' is empty, or only whitespace, control, zero-width or "
                                       "other invisible formatting characters")
    return Keyword(qid, text)


# Invisible characters: control (Cc), format (Cf), separators (Zs, Zl, Zp), anything Python
# calls whitespace, and the rest of Unicode's Default_Ignorable_Code_Point set that is not Cf
# (variation selectors, fillers, the combining grapheme joiner). The Cf "prepended
# concatenation marks" (Arabic number sign, end of ayah, ...) are visible signs and stay content,
# and so do private-use and unassigned code points (a newer Unicode may assign them).
_BLANK_CATEGORIES = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp"})
_VISIBLE_FORMAT = frozenset("\u0600\u0601\u0602\u0603\u0604\u0605\u06dd\u070f\u0890\u0891\u08e2"
                            "\U000110bd\U000110cd")
_IGNORABLE_MARKS = (frozenset("\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180f\u3164\uffa0")
                    | frozenset(map(chr, range(0xFE00, 0xFE10))) | frozenset(map(chr, range(0xE0100, 0xE01F0))))


def is_blank(text: str) -> bool:
    """True when the text has nothing to embed: no character that shows as content."""
    for ch in text:
        if ch.isspace() or ch in _IGNORABLE_MARKS:
            continue
        if unicodedata.category(ch) in _BLANK_CATEGORIES and ch not in _VISIBLE_FORMAT:
            continue
        return False
    return True


def encode_embedding(vec: np.ndarray, encoding: OutputEncoding,
                     int8_range: tuple[float, float] | None = None) -> np.ndarray | str:
    """The output's "embedding" value, to be written by orjson with OPT_SERIALIZE_NUMPY.

    float-list: the float32 array itself, which orjson writes with each number in the shortest
    form that reads back as the same float32 (about half the bytes of float64 reprs, and faster).
    int8: base64 of dim signed bytes (kwe_core.vectors.quantize_int8 over `int8_range`).
    binary: base64 of ceil(dim / 8) bytes of packed sign bits (kwe_core.vectors.pack_binary).
    """
    if encoding == "float-list":
        return np.ascontiguousarray(vec, dtype=np.float32)
    if encoding == "int8":
        if int8_range is None:
            raise ValueError("the int8 encoding needs its calibration range")
        raw = quantize_int8(vec, *int8_range).tobytes()
    elif encoding == "binary":
        raw = pack_binary(vec).tobytes()
    else:
        raw = vec.astype("<f4" if encoding == "base64-f32" else "<f2").tobytes()
    return base64.b64encode(raw).decode("ascii")


def decode_embedding(value: list[float] | str, encoding: OutputEncoding, *, dim: int | None = None,
                     int8_range: tuple[float, float] | None = None) -> np.ndarray:
    """The inverse of encode_embedding, for consumers and tests.

    int8 comes back dequantised (float32, needs `int8_range`); binary as its dim bits, 0 or 1
    (uint8, needs `dim`).
    """
    if encoding == "float-list":
        return np.asarray(value, dtype=np.float32)
    assert isinstance(value, str)
    raw = base64.b64decode(value)
    if encoding == "int8":
        if int8_range is None:
            raise ValueError("decoding int8 needs the int8_range of the record")
        return dequantize_int8(np.frombuffer(raw, dtype=np.int8), *int8_range)
    if encoding == "binary":
        if dim is None:
            raise ValueError("decoding binary needs the record's dim")
        return unpack_binary(np.frombuffer(raw, dtype=np.uint8), dim)
    dtype = "<f4" if encoding == "base64-f32" else "<f2"
    return np.frombuffer(raw, dtype=dtype).astype(np.float32)


@dataclass(frozen=True)
class OutputCodec:
    """Encodes embeddings for one model, prompt, width and encoding.

    `dim` is the width written (truncate_dim when set, else the model's); vectors arrive at the
    model's width and are truncated and renormalised here, after the cache, so cached rows
    stay full-width. The optional fields (prompt_name, int8_range) are written only when they
    apply, so the default record is unchanged.
    """

    model: str
    dim: int
    encoding: OutputEncoding
    truncate_dim: int = 0  # 0: the model's full width
    prompt_name: str | None = None
    prompt: str = ""
    int8_range: tuple[float, float] | None = None  # required by (and only written for) int8
    _headers: Headers = field(init=False, repr=False, compare=False)
    _extra: dict[str, object] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.truncate_dim and self.truncate_dim != self.dim:
            raise ValueError(f"OutputCodec: dim {self.dim} must equal truncate_dim {self.truncate_dim}")
        if (self.encoding == "int8") != (self.int8_range is not None):
            raise ValueError("OutputCodec: int8_range is set for, and only for, the int8 encoding")
        headers: Headers = [(H_MODEL, self.model.encode()), (H_ENCODING, self.encoding.encode()),
                            (H_DIM, str(self.dim).encode())]
        extra: dict[str, object] = {}
        if self.int8_range is not None:
            lo, hi = self.int8_range
            headers.append((H_INT8_RANGE, f"{lo!r},{hi!r}".encode()))
            extra["int8_range"] = [lo, hi]
        if self.prompt:
            headers.append((H_PROMPT, self.prompt.encode("utf-8")))
            extra["prompt_name"] = self.prompt_name
            if self.prompt_name is not None:
                headers.append((H_PROMPT_NAME, self.prompt_name.encode("utf-8")))
        object.__setattr__(self, "_headers", headers)
        object.__setattr__(self, "_extra", extra)

    @property
    def headers(self) -> Headers:
        return list(self._headers)

    def value(self, qid: str, vec: np.ndarray, tokens: int, truncated: bool) -> bytes:
        if self.truncate_dim:
            vec = truncate(vec, self.truncate_dim)
        record = {
            "id": qid,
            "embedding": encode_embedding(vec, self.encoding, self.int8_range),
            "encoding": self.encoding,
            "dim": self.dim,
            "model": self.model,
            "tokens": tokens,
            "truncated": truncated,
        }
        if self._extra:
            record.update(self._extra)
        return orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY)
