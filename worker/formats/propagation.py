"""What an input record's headers give its embedding: pass_headers and W3C trace context.

`Propagation.output_headers` runs on the output thread, once per record, and only when the
record has headers and either feature is on: a record without headers gets the codec's shared
header list as before, so the default path does no per-record header work.

- pass_headers: the named input headers (or all, '*') are copied after the worker's own; an
  input header named kwe-* is never copied, so it cannot shadow one of the worker's.
- trace context (W3C Trace Context, https://www.w3.org/TR/trace-context/): a valid input
  `traceparent` gives the output a child `traceparent` (same trace ID and flags, a new span ID),
  and `tracestate` is carried unchanged with it; an invalid one is dropped, as the spec says.
  The input's own traceparent is never copied as is, even under '*'.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from worker.formats.headers import InputHeaders
from worker.formats.messages import OWN_HEADER_PREFIX, Headers

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_TRACE_HEADERS = frozenset({TRACEPARENT, TRACESTATE})
# version-traceid-parentid-flags; a later version may append fields after the flags ("-...").
_TRACEPARENT_RE = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE = b"0" * 32
_ZERO_SPAN = b"0" * 16


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A parsed W3C traceparent (lower-case hex)."""

    trace_id: str
    span_id: str
    flags: str

    @property
    def sampled(self) -> bool:
        return bool(int(self.flags, 16) & 1)

    def child(self) -> TraceParent:
        """A child context: same trace and flags, a fresh random span ID (never all zeros)."""
        while True:
            span = os.urandom(8).hex()
            if span != "0" * 16:
                return TraceParent(self.trace_id, span, self.flags)

    def header(self) -> bytes:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}".encode("ascii")


def parse_traceparent(value: bytes | None) -> TraceParent | None:
    """The traceparent header's context, or None when it is absent or invalid (per the spec:
    version ff, an all-zero trace or span ID, a version 00 value with extra fields, bad hex)."""
    if not value:
        return None
    m = _TRACEPARENT_RE.fullmatch(value.strip())
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == b"ff" or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN or (version == b"00" and rest):
        return None
    return TraceParent(trace_id.decode(), span_id.decode(), flags.decode())


def find_traceparent(headers: InputHeaders) -> TraceParent | None:
    """The input's trace context (the first traceparent header; names compared case-insensitively)."""
    for name, value in headers.headers:
        if name.lower() == TRACEPARENT:
            return parse_traceparent(value)
    return None


@dataclass(frozen=True)
class Propagation:
    """The pass_headers and trace_context settings, applied to one record's output headers."""

    names: frozenset[str] = frozenset()
    all_headers: bool = False  # pass_headers = '*'
    trace: bool = False

    @classmethod
    def of(cls, pass_headers: tuple[str, ...], trace_context: bool) -> Propagation:
        return cls(frozenset(n for n in pass_headers if n != "*"), "*" in pass_headers, trace_context)

    @property
    def active(self) -> bool:
        return bool(self.names) or self.all_headers or self.trace

    def output_headers(self, own: Headers, inp: InputHeaders) -> Headers:
        """The worker's own headers, then the passed input headers, then the child trace context."""
        if not inp.headers:
            return own
        out = list(own)
        parent: TraceParent | None = None
        state: bytes | None = None
        for name, value in inp.headers:
            lower = name.lower()
            if lower.startswith(OWN_HEADER_PREFIX):
                continue
            if lower in _TRACE_HEADERS:
                if lower == TRACEPARENT and parent is None:
                    parent = parse_traceparent(value)
                elif lower == TRACESTATE and state is None:
                    state = value
                if self.trace:
                    continue  # written below as the child context, never copied as is
            if self.all_headers or name in self.names:
                out.append((name, value))
        if self.trace and parent is not None:
            out.append((TRACEPARENT, parent.child().header()))
            if state:
                out.append((TRACESTATE, state))
        return out
