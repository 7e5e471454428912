"""Throttled logging of transient client errors (worker/kafka/throttle.py): one line per event and
error code per interval, the next one saying how many were suppressed in between."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError
from structlog.testing import capture_logs

from worker.kafka import throttle
from worker.kafka.throttle import ThrottledLog


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_kind_per_interval_with_the_count_suppressed(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(throttle.time, "monotonic", clock)
    errors = ThrottledLog(interval_s=10.0)
    down, timed_out = KafkaError(KafkaError._TRANSPORT), KafkaError(KafkaError._TIMED_OUT)
    with capture_logs() as logs:
        errors.warn("consumer error", down, member="m-1")
        for _ in range(5):
            clock.now += 1.0
            errors.warn("consumer error", down, member="m-1")
        errors.warn("consumer error", timed_out)  # another code: its own line at once
        errors.warn("producer error", down)  # another event: its own line at once
        clock.now += 5.0  # 10 s after the first line
        errors.warn("consumer error", down, member="m-1")
    assert [(e["event"], e["suppressed_since_last"]) for e in logs] == [
        ("consumer error", 0), ("consumer error", 0), ("producer error", 0), ("consumer error", 5)]
    assert logs[0]["member"] == "m-1" and logs[0]["log_level"] == "warning"
    assert logs[0]["error"] == str(down) and logs[1]["error"] == str(timed_out)
