"""Message formats: decode and validate input, encode embeddings and dead-letter records.

The wire formats are specified in schemas/ (input, output, dead-letter); this module is
their one implementation. Nothing here raises on bad input: decoding returns a `Rejection`
whose reason goes to the dead-letter topic, `read_headers` survives header names that are
not UTF-8, and `dead_letter_record` stays under its size limit whatever the input.
"""

from __future__ import annotations

import base64
import gc
import hashlib
import operator
import struct
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

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


@dataclass(frozen=True, slots=True)
class InputHeaders:
    """An input record's headers as the worker could read them.

    `headers` holds the headers whose names are UTF-8 (safe to hand back to confluent-kafka);
    `not_utf8` the others, as (raw name or None when even that was lost, value); `note` says
    what could not be read, or is None.
    """

    headers: Headers = field(default_factory=list)
    not_utf8: list[tuple[bytes | None, bytes | None]] = field(default_factory=list)
    note: str | None = None

    @property
    def size(self) -> int:
        """Bytes of names and values, as they count toward the input size check."""
        return (sum(len(n.encode("utf-8", "surrogatepass")) + len(v or b"") for n, v in self.headers)
                + sum(len(n or b"") + len(v or b"") for n, v in self.not_utf8))

    @classmethod
    def of(cls, headers: Sequence[tuple[str | bytes, bytes | None]] | None) -> InputHeaders:
        """Sorts plain (name, value) pairs: a bytes name, or a str that is not UTF-8-encodable, is not_utf8."""
        good: Headers = []
        bad: list[tuple[bytes | None, bytes | None]] = []
        for name, value in headers or ():
            raw = name if isinstance(name, bytes) else None
            if isinstance(name, str):
                try:
                    name.encode("utf-8")
                except UnicodeEncodeError:  # a lone surrogate: librdkafka would crash on it
                    raw = name.encode("utf-8", "surrogatepass")
                else:
                    good.append((name, value))
                    continue
            elif raw is not None:
                try:
                    good.append((raw.decode("utf-8"), value))
                    continue
                except UnicodeDecodeError:
                    pass
            bad.append((raw, value))
        return cls(good, bad)


class _HasHeaders(Protocol):
    def headers(self) -> Any: ...
    def set_headers(self, headers: Any) -> None: ...


def read_headers(msg: _HasHeaders) -> InputHeaders:
    """The headers of a consumed message; never raises. Call it instead of `msg.headers()`.

    Kafka allows any bytes as a header name. confluent-kafka 2.x decodes every name as UTF-8
    and, when one is not, `Message.headers()` raises SystemError (from a UnicodeDecodeError),
    or, at a call site CPython has specialised, returns without raising and leaves the error
    pending for a later, unrelated call to raise. Either way it caches a half-built list on the
    message, in which the bad name is a NULL slot that crashes the interpreter when touched (a
    second `headers()` call returns that list). This
    recovers what can be read safely: the good headers, the values of the bad ones, and the bad
    name when the exception carries it; then it replaces the message's cached headers with the
    good ones, so a later `msg.headers()` is safe.
    """
    error: Exception | None = None
    try:
        raw = _call_headers(msg)
    except Exception as exc:  # noqa: BLE001 - a failure to read headers must not stop the worker
        error = exc
        try:
            raw = _call_headers(msg)  # the list built before the failure, cached on the message
        except Exception:  # noqa: BLE001
            raw = None
    if raw is None and error is None:
        return InputHeaders()
    if not isinstance(raw, list):
        return _headers_dropped(msg, f"the headers could not be read and were dropped ({_why(error, raw)})")
    pairs: list[tuple[str | bytes, bytes | None]] = []
    unnamed: list[bytes | None] = []
    lost = 0
    for entry in raw:
        if not isinstance(entry, tuple) or len(entry) != 2:
            lost += 1
        elif len(gc.get_referents(entry)) < 2:
            # The NULL name slot: the GC's traversal skips it, where indexing would crash.
            value = entry[1]
            unnamed.append(value if isinstance(value, bytes) else None)
        elif isinstance(entry[0], (str, bytes)) and isinstance(entry[1], (bytes, type(None))):
            pairs.append(entry)
        else:
            lost += 1
    sorted_ = InputHeaders.of(pairs)
    if not unnamed and not lost and error is None:
        return sorted_
    names = _undecodable_names(error) if error is not None else []
    # The exception carries the bytes of the failed name only when exactly one name failed.
    named = list(zip(names, unnamed, strict=True)) if len(names) == len(unnamed) else [(None, v) for v in unnamed]
    bad = sorted_.not_utf8 + named
    note = (f"{len(bad)} header name(s) are not valid UTF-8; kept as bytes in headers_not_utf8"
            + (f", {sum(n is None for n, _ in bad)} of them without the name (the client could not recover it)"
               if any(n is None for n, _ in bad) else "")
            + (f"; {lost} header(s) could not be read and were dropped" if lost else "")
            + f" ({_why(error, raw)})")
    _replace_cached(msg, sorted_.headers)
    return InputHeaders(sorted_.headers, bad, note)


# `msg.headers()` written as a plain call would, once CPython (3.11+) has specialised that call
# site, return the broken list *without* raising and leave the decode error pending, to surface
# later from some unrelated call. Calling through the C API (methodcaller) keeps CPython's check
# that a C function which returned a value did not also set an error, so it raises every time.
_call_headers = operator.methodcaller("headers")


def _why(error: BaseException | None, raw: object) -> str:
    if error is None:
        return f"the client returned {type(raw).__name__} entries it could not decode"
    cause = error.__cause__ or error
    return f"{type(cause).__name__}: {cause}"


def _headers_dropped(msg: _HasHeaders, note: str) -> InputHeaders:
    _replace_cached(msg, [])
    return InputHeaders([], [], note)


def _replace_cached(msg: _HasHeaders, headers: Headers) -> None:
    try:
        msg.set_headers(headers)
    except Exception:  # noqa: BLE001 - a message type without set_headers has nothing cached to fix
        pass


def _undecodable_names(exc: BaseException) -> list[bytes]:
    """The bytes of the name(s) that failed to decode, from the exception chain, oldest first."""
    found: list[bytes] = []
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UnicodeDecodeError) and isinstance(e.object, bytes):
            found.insert(0, bytes(e.object))
        todo.extend([e.__cause__, e.__context__])
    return found


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


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A dead-letter record ready to produce: its key, value and headers."""

    key: bytes | None
    value: bytes
    headers: Headers

    @property
    def size(self) -> int:
        """The bytes that count against dead_letter_max_bytes: key, value, and each header's name,
        value and two length fields (at most 5 bytes each as varints). The rest of the record's
        framing is a fixed few dozen bytes (config.RECORD_FRAMING_BYTES covers it)."""
        return len(self.key or b"") + len(self.value) + _headers_size(self.headers)


_HEADER_LENGTHS_BYTES = 10


def _headers_size(headers: Headers) -> int:
    return sum(len(n.encode("utf-8", "surrogatepass")) + len(v or b"") + _HEADER_LENGTHS_BYTES for n, v in headers)


def _cut_entry(fld: str, data: bytes, kept: int, **extra: Any) -> dict[str, Any]:
    return {"field": fld, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "kept": kept, **extra}


def headers_digest_input(headers: InputHeaders) -> bytes:
    """The bytes whose SHA-256 a cut "headers" entry records (documented in the schema)."""
    out = bytearray()
    pairs = [(n.encode("utf-8"), v) for n, v in headers.headers] + [(n or b"", v) for n, v in headers.not_utf8]
    for name, value in pairs:
        out += struct.pack(">I", len(name)) + name
        out += struct.pack(">i", -1) if value is None else struct.pack(">i", len(value)) + value
    return bytes(out)


# Longest `detail` (and note) written, in characters: a detail may quote an exception.
_MAX_DETAIL = 500


def _text(text: str, limit: int) -> str:
    """At most `limit` characters, always encodable (a lone surrogate would make orjson raise)."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "..."


def dead_letter_record(rejection: Rejection, *, topic: str, partition: int, offset: int, timestamp_ms: int | None,
                       key: bytes | None, value: bytes | None, headers: InputHeaders | Headers | None,
                       max_bytes: int) -> DeadLetter:
    """The dead-letter record for one input record: the reason, the source position, the original bytes.

    The record's key, value and headers together stay within `max_bytes` (the dead-letter
    topic takes nothing larger). When the original bytes do not fit, the key and value are
    cut to a prefix and the original headers dropped, fairly: what fits whole is kept whole,
    the rest shares what is left. Each cut field is listed in "cut" with its original size
    and SHA-256, and the source topic/partition/offset is always kept, so the original
    record can be found and verified. Never raises on any input.
    """
    hdrs = headers if isinstance(headers, InputHeaders) else InputHeaders.of(headers)
    has_headers = bool(hdrs.headers or hdrs.not_utf8)
    detail = _text(rejection.detail, _MAX_DETAIL)
    notes = [_text(hdrs.note, _MAX_DETAIL)] if hdrs.note else []
    own_headers: Headers = [
        (H_REASON, rejection.reason.encode()),
        (H_SRC_TOPIC, topic.encode("utf-8", "replace")),
        (H_SRC_PARTITION, str(partition).encode()),
        (H_SRC_OFFSET, str(offset).encode()),
    ]

    def build(key_kept: int | None, value_kept: int | None, keep_headers: bool) -> DeadLetter:
        """None keeps the field whole; an int keeps that many leading bytes and lists it in "cut"."""
        cut: list[dict[str, Any]] = []
        if key is not None and key_kept is not None:
            cut.append(_cut_entry("key", key, key_kept))
        if value is not None and value_kept is not None:
            cut.append(_cut_entry("value", value, value_kept))
        if not keep_headers and has_headers:
            cut.append(_cut_entry("headers", headers_digest_input(hdrs), 0,
                                  count=len(hdrs.headers) + len(hdrs.not_utf8)))
        record = {
            "reason": rejection.reason,
            "detail": detail,
            "source": {"topic": _text(topic, 300), "partition": partition, "offset": offset, "timestamp_ms": timestamp_ms},
            "key_b64": _b64(key if key_kept is None or key is None else key[:key_kept]),
            "value_b64": _b64(value if value_kept is None or value is None else value[:value_kept]),
            "headers": [[n, _b64(v)] for n, v in hdrs.headers] if keep_headers else [],
            "headers_not_utf8": [[_b64(n), _b64(v)] for n, v in hdrs.not_utf8] if keep_headers else [],
            "cut": cut,
            "notes": notes,
        }
        out_key = key if key_kept is None else None  # a cut key is not the record's key any more
        out_headers = (list(hdrs.headers) if keep_headers else []) + own_headers
        return DeadLetter(out_key, orjson.dumps(record), out_headers)

    whole = build(None, None, True)
    if whole.size <= max_bytes:
        return whole
    keep_headers_cost = build(0, 0, True).size - build(0, 0, False).size
    floor = build(0, 0, False)
    # The floor writes "kept": 0; a prefix's length takes up to 9 more digits per field.
    budget = max_bytes - floor.size - 32
    # Fair shares, smallest field first: a field that fits its share is kept whole, the others
    # get equal prefixes. Costs: base64 in the value (4/3), plus the key once more as the key.
    fields: list[tuple[str, int, int]] = []  # name, cost kept whole, length
    if key is not None:
        fields.append(("key", len(key) + _b64_len(len(key)), len(key)))
    if value is not None:
        fields.append(("value", _b64_len(len(value)), len(value)))
    if has_headers:
        fields.append(("headers", keep_headers_cost, 0))
    kept: dict[str, int | None] = {}
    remaining = budget
    for i, (name, cost, length) in enumerate(sorted(fields, key=lambda f: f[1])):
        share = remaining // (len(fields) - i)
        if cost <= share:
            kept[name] = None
            remaining -= cost
        elif name == "headers":
            kept[name] = 0
        else:
            n = min(length, max(0, (share // 4) * 3 - 3))  # its base64 fits the share
            kept[name] = n
            remaining -= _b64_len(n)
    record = build(kept.get("key", 0), kept.get("value", 0), kept.get("headers", 0) is None)
    if record.size <= max_bytes:
        return record
    if floor.size <= max_bytes:
        return floor
    # Only a pathological detail or note (thousands of escaped characters) gets here; without
    # them the record is well under a kilobyte, below the 4096-byte minimum of the setting.
    detail = _text(detail, 100)
    notes.clear()
    return build(0, 0, False)


def _b64_len(n: int) -> int:
    return 4 * ((n + 2) // 3)
