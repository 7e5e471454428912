"""pass_headers and W3C trace context (worker/formats/propagation.py), in-process.

Through the broker and a worker process: tests/broker/test_schema_registry_kafka.py (Avro) and
tests/broker/test_sink_output_kafka.py (JSON).
"""

from __future__ import annotations

import pytest

from worker.formats.headers import InputHeaders
from worker.formats.propagation import Propagation, find_traceparent, parse_traceparent

OWN = [("kwe-model", b"all-MiniLM-L6-v2"), ("kwe-encoding", b"float-list"), ("kwe-dim", b"384")]
TP = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_traceparent_parses_and_its_child_keeps_trace_and_flags() -> None:
    tp = parse_traceparent(TP)
    assert tp is not None and tp.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" and tp.sampled
    child = tp.child()
    assert (child.trace_id, child.flags) == (tp.trace_id, tp.flags) and child.span_id != tp.span_id
    assert parse_traceparent(child.header()) == child
    assert len({tp.child().span_id for _ in range(100)}) == 100


@pytest.mark.parametrize("value", [
    None, b"", b"garbage",
    b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace ID
    b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero span ID
    b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
    b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper-case hex
    b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # version 00 has no more fields
])
def test_invalid_traceparents_are_ignored(value: bytes | None) -> None:
    assert parse_traceparent(value) is None


def test_a_later_version_with_more_fields_is_read() -> None:
    assert parse_traceparent(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-more") is not None


def test_named_headers_pass_after_the_workers_own_which_no_input_header_shadows() -> None:
    inp = InputHeaders([("tenant", b"acme"), ("source", b"app"), ("kwe-model", b"spoofed"), ("KWE-DIM", b"1"),
                        ("other", None)])
    out = Propagation.of(("tenant", "kwe-model", "other"), trace_context=False).output_headers(OWN, inp)
    assert out == OWN + [("tenant", b"acme"), ("other", None)]
    every = Propagation.of(("*",), trace_context=False).output_headers(OWN, inp)
    assert every == OWN + [("tenant", b"acme"), ("source", b"app"), ("other", None)]
    assert OWN == [("kwe-model", b"all-MiniLM-L6-v2"), ("kwe-encoding", b"float-list"), ("kwe-dim", b"384")]


def test_trace_context_writes_a_child_and_carries_tracestate() -> None:
    inp = InputHeaders([("traceparent", TP), ("tracestate", b"congo=t61rcWkgMzE"), ("tenant", b"acme")])
    out = Propagation.of(("*",), trace_context=True).output_headers(OWN, inp)
    names = [n for n, _ in out]
    assert names == [*(n for n, _ in OWN), "tenant", "traceparent", "tracestate"]  # the input's never copied as is
    child = parse_traceparent(dict(out)["traceparent"])
    assert child is not None and child.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert child.span_id != "00f067aa0ba902b7" and dict(out)["tracestate"] == b"congo=t61rcWkgMzE"
    # Trace context off: the headers are only what pass_headers names.
    off = Propagation.of(("traceparent",), trace_context=False).output_headers(OWN, inp)
    assert off == OWN + [("traceparent", TP)]
    # An invalid traceparent gives no child (and is not passed on under trace context).
    bad = InputHeaders([("traceparent", b"00-zz"), ("tracestate", b"x=1")])
    assert Propagation.of((), trace_context=True).output_headers(OWN, bad) == OWN


def test_a_record_without_headers_gets_the_shared_list_and_off_is_inactive() -> None:
    assert Propagation.of(("tenant",), True).output_headers(OWN, InputHeaders()) is OWN
    assert not Propagation.of((), trace_context=False).active
    assert Propagation.of((), trace_context=True).active


def test_find_traceparent_matches_the_name_case_insensitively() -> None:
    tp = find_traceparent(InputHeaders([("TraceParent", TP)]))
    assert tp is not None and tp.span_id == "00f067aa0ba902b7"


def test_the_default_path_imports_no_registry_or_otel_code_and_a_missing_extra_is_one_clear_error() -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    script = """
import sys
for name in ("fastavro", "opentelemetry", "google.protobuf.descriptor_pool"):
    sys.modules[name] = None  # as if the extras were not installed: importing them raises ImportError
from worker.formats.codec_choice import registry_formats
import worker.cli, worker.app, worker.pipeline, worker.output.stage
from worker.output.tracing import batch_spans
from worker.formats.messages import OutputCodec
from worker.settings.schema import Settings, SettingsError
codec = OutputCodec(model="m", dim=4, encoding="float-list")
assert registry_formats(Settings(), codec) == (codec, None)
for call in (lambda: registry_formats(Settings(output_format="avro", schema_registry_url="http://sr"), codec),
             lambda: batch_spans("http://collector:4318", model="m")):
    try:
        call()
    except SettingsError as exc:
        print(exc)
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    # The install line comes first, the missing module (an implementation detail) last.
    assert lines[0].startswith("output_format=avro needs the registry extra: pip install 'keyword-embedder[registry]'")
    assert lines[0].endswith("(missing: fastavro)")
    assert lines[1].startswith("otel_exporter_otlp_endpoint (span export) needs the otel extra: "
                               "pip install 'keyword-embedder[otel]'")
