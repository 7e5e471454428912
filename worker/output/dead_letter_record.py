"""The dead-letter record: the reason, the source position and the original bytes, size-bounded.

Its wire format is specified in schemas/dead-letter.schema.json; this module is its one
implementation. `dead_letter_record` never raises and never exceeds its size limit.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import orjson

from worker.formats.headers import InputHeaders
from worker.formats.messages import (
    H_REASON,
    H_SRC_OFFSET,
    H_SRC_PARTITION,
    H_SRC_TOPIC,
    OWN_HEADER_PREFIX,
    Headers,
    Rejection,
)


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
        framing is a fixed few dozen bytes (kafka_overrides.RECORD_FRAMING_BYTES covers it)."""
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
        # The input's headers come along (pass-through), except any named like the worker's own:
        # those stay only in the value's "headers", so they cannot shadow the reason or source.
        passed = [(n, v) for n, v in hdrs.headers if not n.lower().startswith(OWN_HEADER_PREFIX)]
        out_headers = (passed if keep_headers else []) + own_headers
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
