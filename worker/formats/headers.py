"""Reading a consumed record's headers without ever raising.

Kafka allows any bytes as a header name; confluent-kafka decodes names as UTF-8 and fails in
ways that can crash the interpreter when one is not (see `read_headers`). Everything that needs
a record's headers reads them here, once per record.
"""

from __future__ import annotations

import gc
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from worker.formats.messages import Headers


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
        if not self.headers and not self.not_utf8:
            return 0  # the common case, read twice per record
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


# A record without headers (most of them): one shared, never-changed instance instead of one per record.
NO_HEADERS = InputHeaders()


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
        return NO_HEADERS
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
