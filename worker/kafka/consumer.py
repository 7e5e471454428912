"""Consumer configuration: a group member that stores offsets only after the output is acknowledged."""

from __future__ import annotations

import logging
from typing import Any

from worker.config import Settings
from worker.kafka.client_config import client_config


def consumer_config(settings: Settings, **callbacks: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap.servers": settings.bootstrap_servers,
        "group.id": settings.group_id,
        # Incremental rebalances: a joining member does not stop the others' partitions.
        "partition.assignment.strategy": "cooperative-sticky",
        # Commit-after-write: the pipeline commits explicit offsets (the lowest unfinished
        # offset per partition) itself; nothing is stored or committed behind its back.
        "enable.auto.offset.store": False,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": 10000,
        "heartbeat.interval.ms": 1000,
        "max.poll.interval.ms": 300000,
        "client.id": f"keyword-embedder-{settings.group_id}",
    }
    if settings.metrics_port:
        config["statistics.interval.ms"] = 5000  # per-partition consumer lag for /metrics
    # librdkafka's own log lines go through the stdlib logger into the structured log stream,
    # instead of raw "%6|...|FAIL|..." lines on stderr.
    config["logger"] = logging.getLogger("librdkafka")
    config.update(callbacks)
    # Security and --kafka-config / --kafka-config-file keys, merged in one place.
    config.update(client_config(settings))
    return config
