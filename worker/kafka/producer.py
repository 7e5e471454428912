"""Producer configuration and the delivery loop thread.

The delivery loop is the only thread that calls `Producer.poll`, so every delivery
callback runs on it: that is where outputs are acknowledged and offsets marked done.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import structlog
from confluent_kafka import Producer

from worker.config import Settings
from worker.kafka.client_config import client_config

log = structlog.get_logger(__name__)


def producer_config(settings: Settings, **callbacks: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap.servers": settings.bootstrap_servers,
        # Idempotent + acks=all: a broker restart neither loses nor duplicates an acknowledged write.
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        # Embeddings are float text or float bytes, which compress poorly; lz4 cost about 7% of
        # the throughput of a 2-core worker (benchmarks/kafka_vs_offline.py). Where bandwidth
        # matters more, pass --kafka-config compression.type=lz4 (or zstd).
        "compression.type": "none",
        # Room for every in-flight keyword plus dead letters: produce() must not hit BufferError
        # in steady state, because the in-flight bound already limits what is outstanding.
        "queue.buffering.max.messages": max(100000, 4 * settings.max_in_flight),
        "message.timeout.ms": 120000,
        "client.id": f"keyword-embedder-{settings.group_id}",
    }
    # librdkafka's own log lines go through the stdlib logger into the structured log stream,
    # instead of raw "%6|...|FAIL|..." lines on stderr.
    config["logger"] = logging.getLogger("librdkafka")
    config.update(callbacks)
    # Security and --kafka-config / --kafka-config-file keys, merged in one place.
    config.update(client_config(settings))
    return config


class DeliveryLoop:
    """Owns `producer.poll`: serves delivery callbacks until stopped."""

    def __init__(self, producer: Producer, *, interval_s: float = 0.05) -> None:
        self._producer = producer
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kwe-delivery", daemon=False)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(self._interval)
        # Serve what was acknowledged while stopping, so no callback is left unrun.
        self._producer.poll(0)

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("delivery loop did not stop in time", timeout_s=timeout)
