"""Message formats: decode and validate input, encode embeddings.

The wire formats are specified in schemas/ (input, output, dead-letter); this module is
their one implementation, with worker/formats/headers.py (reading headers safely) and
worker/output/dead_letter_record.py (the dead-letter record). Decoding never raises on bad
input: it returns a `Rejection` whose reason goes to the dead-letter topic.
"""

from __future__ import annotations

import base64
import unicodedata
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import orjson

from worker.core.vectors import dequantize_int8, pack_binary, quantize_int8, truncate, unpack_binary
from worker.names import InputFormat, OutputEncoding
from worker.settings.output_fields import FieldMap, apply_output_fields

Headers = list[tuple[str, bytes | None]]

# The worker's own headers all start with this; an input header of that name is never copied
# onto an output or dead letter (pass_headers), so it cannot shadow the worker's.
OWN_HEADER_PREFIX = "kwe-"

# Header names, also in schemas/*.json.
H_MODEL = "kwe-model"
H_ENCODING = "kwe-encoding"
H_DIM = "kwe-dim"
# The model fingerprint (worker/core/fingerprint.py): equal values, comparable vectors.
H_FINGERPRINT = "kwe-fingerprint"
H_INT8_RANGE = "kwe-int8-range"
H_PROMPT_NAME = "kwe-prompt-name"
H_PROMPT = "kwe-prompt"
# Written (as b"false") only when the vectors are not unit length: the model's pipeline has no
# Normalize module (docs/models.md); absent, they are L2-normalised.
H_NORMALIZED = "kwe-normalized"
H_REASON = "kwe-dlq-reason"
H_SRC_TOPIC = "kwe-source-topic"
H_SRC_PARTITION = "kwe-source-partition"
H_SRC_OFFSET = "kwe-source-offset"


@dataclass(slots=True)
class Keyword:
    id: str
    text: str


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: str
    detail: str


def decode_input(key: bytes | None, value: bytes | None, *, fmt: InputFormat, max_bytes: int,
                 headers_bytes: int = 0) -> Keyword | Rejection:
    """Decodes and validates one input record; `max_bytes` bounds key + value + headers together.

    The registry formats are decoded by worker/formats/schema_registry.py, which runs
    `check_size` first and `keyword_from_object` on what the registry's deserialiser returns.
    """
    rejection = check_size(key, value, max_bytes=max_bytes, headers_bytes=headers_bytes)
    if rejection is not None:
        return rejection
    assert value is not None
    if fmt == "raw":
        try:
            raw_text = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            return _not_utf8(exc)
        if key is None:
            return Rejection("missing_key", "input_format=raw needs the query ID in the message key")
        try:
            qid = key.decode("utf-8")
        except UnicodeDecodeError as exc:
            return Rejection("not_utf8", f"key is not valid UTF-8 ({exc.reason} at byte {exc.start})")
        return _checked(qid, raw_text)
    try:
        obj = orjson.loads(value)  # validates UTF-8 itself: the value is decoded once
    except orjson.JSONDecodeError as exc:
        try:
            value.decode("utf-8")  # which of the two reasons: not text at all, or text but not JSON
        except UnicodeDecodeError as not_text:
            return _not_utf8(not_text)
        return Rejection("malformed_json", f"value is not JSON ({exc})")
    return keyword_from_object(obj)


def _not_utf8(exc: UnicodeDecodeError) -> Rejection:
    return Rejection("not_utf8", f"value is not valid UTF-8 ({exc.reason} at byte {exc.start})")


def check_size(key: bytes | None, value: bytes | None, *, max_bytes: int, headers_bytes: int = 0) -> Rejection | None:
    """The checks every input format shares: a value, and key + value + headers within max_bytes."""
    if value is None:
        return Rejection("null_value", "the message has no value (tombstone)")
    key_bytes = len(key) if key is not None else 0
    total = key_bytes + len(value) + headers_bytes
    if total > max_bytes:
        parts = {"key": key_bytes, "value": len(value), "headers": headers_bytes}
        largest = max(parts, key=parts.__getitem__)
        return Rejection("oversized", f"record is {total} bytes (key {key_bytes}, value {len(value)}, headers "
                                      f"{headers_bytes}; largest: {largest}), above max_message_bytes={max_bytes}")
    return None


def plain_keyword(obj: object) -> tuple[str, str] | None:
    """(ID, text) of nearly every record: a dict of two strings, an ID and a text that starts with
    a letter or digit, so neither can be empty or blank. None: `keyword_from_object` decides, with
    its reason (intake calls this first, per record, so that the common case builds no Keyword)."""
    if type(obj) is dict:
        qid, text = obj.get("id"), obj.get("text")
        if type(qid) is str and type(text) is str and qid:
            first = text[:1]
            if first.isascii() and first.isalnum():
                return qid, text
    return None


def keyword_from_object(obj: object) -> Keyword | Rejection:
    """The keyword of a decoded {"id", "text"} object (JSON, or a registry format's record)."""
    plain = plain_keyword(obj)
    if plain is not None:
        return Keyword(*plain)
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
    int8: base64 of dim signed bytes (worker.core.vectors.quantize_int8 over `int8_range`).
    binary: base64 of ceil(dim / 8) bytes of packed sign bits (worker.core.vectors.pack_binary).
    """
    if encoding == "float-list":
        return np.ascontiguousarray(vec, dtype=np.float32)
    return base64.b64encode(embedding_bytes(vec, encoding, int8_range)).decode("ascii")


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


class ValueEncoder(Protocol):
    """What the output stage needs of a codec: the shared headers and the value of each embedding,
    one at a time or a batch at once (OutputCodec for JSON; worker/formats/schema_registry.py's
    RegistryOutput for the registry formats)."""

    @property
    def headers(self) -> Headers: ...

    def value(self, qid: str, vec: np.ndarray, tokens: int, truncated: bool) -> bytes: ...

    def values(self, qids: Sequence[str], rows: np.ndarray, tokens: Sequence[int],
               truncated: Sequence[bool]) -> list[bytes]: ...


def values_one_by_one(encoder: ValueEncoder, qids: Sequence[str], rows: np.ndarray, tokens: Sequence[int],
                      truncated: Sequence[bool]) -> list[bytes]:
    """`values` as a loop over `value`: for encoders with no batch form of their own."""
    return [encoder.value(q, rows[i], tokens[i], truncated[i]) for i, q in enumerate(qids)]


def _json_rows(rows: np.ndarray) -> list[bytes]:
    """Each row of a float32 matrix as orjson writes it alone, brackets included: one call a row.
    Measured against one call for the batch split at "],[" (benchmarks/host/json_rows.py), the
    split cost more than the calls it saves: 1.7 against 2.5 us a row of a unit vector, 8.8
    against 11.9 of a real one (384 floats)."""
    dumps, numpy_option = orjson.dumps, orjson.OPT_SERIALIZE_NUMPY
    return [dumps(row, option=numpy_option) for row in np.ascontiguousarray(rows, dtype=np.float32)]


@dataclass(frozen=True)
class OutputCodec:
    """Encodes embeddings for one model, prompt, width and encoding.

    `dim` is the width written (truncate_dim when set, else the model's); vectors arrive at the
    model's width and are truncated here (and renormalised, for a model that normalises), after
    the cache, so cached rows stay full-width. The optional fields (prompt_name, int8_range, and
    normalized: false with its kwe-normalized header for a model without a Normalize module) are
    written only when they apply. The registry formats carry normalized as the header, not the
    field: their registered schemas stay as they are. `fingerprint` (set by the worker on every
    record: field and kwe-fingerprint header) is an optional field of the registry schemas too.
    """

    model: str
    dim: int
    encoding: OutputEncoding
    truncate_dim: int = 0  # 0: the model's full width
    prompt_name: str | None = None
    prompt: str = ""
    int8_range: tuple[float, float] | None = None  # required by (and only written for) int8
    fields: FieldMap = field(default_factory=lambda: FieldMap())  # output_fields (JSON only)
    normalized: bool = True  # the model's vectors are unit length (its pipeline ends in Normalize)
    # The model fingerprint, computed once at start (codec_choice.output_codec); "": none written.
    fingerprint: str = ""
    _headers: Headers = field(init=False, repr=False, compare=False)
    _extra: dict[str, object] = field(init=False, repr=False, compare=False)
    _shaped: bool = field(init=False, repr=False, compare=False)  # output_fields set (read per record)
    _fixed: tuple[bytes, bytes] = field(init=False, repr=False, compare=False)  # see _fixed_json

    def __post_init__(self) -> None:
        if self.truncate_dim and self.truncate_dim != self.dim:
            raise ValueError(f"OutputCodec: dim {self.dim} must equal truncate_dim {self.truncate_dim}")
        if (self.encoding == "int8") != (self.int8_range is not None):
            raise ValueError("OutputCodec: int8_range is set for, and only for, the int8 encoding")
        headers: Headers = [(H_MODEL, self.model.encode()), (H_ENCODING, self.encoding.encode()),
                            (H_DIM, str(self.dim).encode())]
        extra: dict[str, object] = {}
        if self.fingerprint:
            # A constant of the codec: the header list is shared and the field added with the
            # other constant fields, so it costs a record nothing to compute.
            headers.append((H_FINGERPRINT, self.fingerprint.encode("ascii")))
            extra["fingerprint"] = self.fingerprint
        if self.int8_range is not None:
            lo, hi = self.int8_range
            headers.append((H_INT8_RANGE, f"{lo!r},{hi!r}".encode()))
            extra["int8_range"] = [lo, hi]
        if self.prompt:
            headers.append((H_PROMPT, self.prompt.encode("utf-8")))
            extra["prompt_name"] = self.prompt_name
            if self.prompt_name is not None:
                headers.append((H_PROMPT_NAME, self.prompt_name.encode("utf-8")))
        if not self.normalized:
            headers.append((H_NORMALIZED, b"false"))
        object.__setattr__(self, "_headers", headers)
        object.__setattr__(self, "_extra", extra)
        object.__setattr__(self, "_shaped", bool(self.fields))
        object.__setattr__(self, "_fixed", self._fixed_json())

    @property
    def headers(self) -> Headers:
        return list(self._headers)

    def record(self, qid: str, vec: np.ndarray, tokens: int, truncated: bool, *,
               raw_bytes: bool = False) -> dict[str, object]:
        """The output record as a dict, before output_fields. The embedding is what encode_embedding
        gives (a float32 array for float-list), or with `raw_bytes` the bytes behind the base64 of the
        other encodings (the registry formats write them as `bytes`)."""
        if self.truncate_dim:
            vec = truncate(vec, self.truncate_dim, renormalise=self.normalized)
        record: dict[str, object] = {
            "id": qid,
            "embedding": (embedding_bytes(vec, self.encoding, self.int8_range)
                          if raw_bytes and self.encoding != "float-list"
                          else encode_embedding(vec, self.encoding, self.int8_range)),
            "encoding": self.encoding,
            "dim": self.dim,
            "model": self.model,
            "tokens": tokens,
            "truncated": truncated,
        }
        if self._extra:
            record.update(self._extra)
        return record

    def value(self, qid: str, vec: np.ndarray, tokens: int, truncated: bool) -> bytes:
        record = self.record(qid, vec, tokens, truncated)
        if not self.normalized:
            record["normalized"] = False
        if self._shaped:
            record = apply_output_fields(record, self.fields)
        return orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY)

    def values(self, qids: Sequence[str], rows: np.ndarray, tokens: Sequence[int],
               truncated: Sequence[bool]) -> list[bytes]:
        """The values of a batch, byte for byte what `value` writes for each row, without building
        a dict per record: the record's fixed fields are written once per codec and the embeddings
        of the whole batch in one call (tests/unit/worker/formats/test_messages.py holds the two against each other)."""
        if self._shaped or not len(qids):
            return values_one_by_one(self, qids, rows, tokens, truncated)
        if self.truncate_dim:
            rows = truncate(rows, self.truncate_dim, renormalise=self.normalized)
        if self.encoding == "float-list":
            embeddings, opening, closing = _json_rows(rows), b',"embedding":', b""
        else:
            embeddings = [base64.b64encode(r) for r in _BATCH_BYTES[self.encoding](rows, self.int8_range)]
            opening, closing = b',"embedding":"', b'"'
        fixed, tail = self._fixed
        middle = closing + fixed
        cut_end, whole_end = b',"truncated":true' + tail, b',"truncated":false' + tail
        dumps = orjson.dumps
        return [b"".join((b'{"id":', dumps(q), opening, e, middle, b"%d" % t, cut_end if cut else whole_end))
                for q, e, t, cut in zip(qids, embeddings, tokens, truncated)]

    def _fixed_json(self) -> tuple[bytes, bytes]:
        """What every record of this codec writes between the embedding and the token count, and
        after `truncated`, in `record`'s key order (orjson keeps a dict's insertion order)."""
        middle = orjson.dumps({"encoding": self.encoding, "dim": self.dim, "model": self.model})[1:-1]
        extra: dict[str, object] = dict(self._extra)
        if not self.normalized:
            extra["normalized"] = False
        tail = (b"," + orjson.dumps(extra)[1:-1] if extra else b"") + b"}"
        return b"," + middle + b',"tokens":', tail


def _int8_rows(rows: np.ndarray, int8_range: tuple[float, float] | None) -> list[bytes]:
    if int8_range is None:
        raise ValueError("the int8 encoding needs its calibration range")
    q = quantize_int8(rows, *int8_range)
    return [q[i].tobytes() for i in range(len(q))]


def _binary_rows(rows: np.ndarray, int8_range: tuple[float, float] | None) -> list[bytes]:
    packed = pack_binary(rows)
    return [packed[i].tobytes() for i in range(len(packed))]


def _float_rows(dtype: str) -> Callable[[np.ndarray, tuple[float, float] | None], list[bytes]]:
    def rows_of(rows: np.ndarray, int8_range: tuple[float, float] | None) -> list[bytes]:
        arr = np.ascontiguousarray(rows, dtype=dtype)
        return [arr[i].tobytes() for i in range(len(arr))]
    return rows_of


# embedding_bytes of a whole batch at once, per byte encoding (each row as embedding_bytes writes it).
_BATCH_BYTES: dict[str, Callable[[np.ndarray, tuple[float, float] | None], list[bytes]]] = {
    "int8": _int8_rows, "binary": _binary_rows, "base64-f32": _float_rows("<f4"), "base64-f16": _float_rows("<f2")}


def embedding_bytes(vec: np.ndarray, encoding: OutputEncoding, int8_range: tuple[float, float] | None = None) -> bytes:
    """The bytes whose base64 encode_embedding writes for the byte encodings (not float-list)."""
    if encoding == "int8":
        if int8_range is None:
            raise ValueError("the int8 encoding needs its calibration range")
        return quantize_int8(vec, *int8_range).tobytes()
    if encoding == "binary":
        return pack_binary(vec).tobytes()
    if encoding == "float-list":
        raise ValueError("float-list has no byte form")
    return vec.astype("<f4" if encoding == "base64-f32" else "<f2").tobytes()
