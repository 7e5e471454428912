"""Throttled logging of transient client errors.

A broker that is down makes librdkafka report the same error many times a second; one line
per kind per interval, with how many were suppressed, keeps the log readable. Called from
librdkafka's callback threads and the poll thread alike, hence the lock.
"""

from __future__ import annotations

import threading
import time

import structlog
from confluent_kafka import KafkaError

log = structlog.get_logger(__name__)


class ThrottledLog:
    def __init__(self, interval_s: float = 10.0) -> None:
        self._interval = interval_s
        self._lock = threading.Lock()
        self._last: dict[tuple[str, int], tuple[float, int]] = {}

    def warn(self, event: str, err: KafkaError, **context: object) -> None:
        key, now = (event, err.code()), time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(key, (float("-inf"), 0))
            if now - last < self._interval:
                self._last[key] = (last, suppressed + 1)
                return
            self._last[key] = (now, 0)
        log.warning(event, error=str(err), suppressed_since_last=suppressed, **context)
