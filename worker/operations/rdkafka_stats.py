"""librdkafka's statistics (`statistics.interval.ms`, the `stats_cb` payload) read into
per-partition consumer lags: a pure function of the JSON document, no metrics, no state.
"""

from __future__ import annotations

import json
from collections.abc import Container, Mapping
from typing import NamedTuple


class PartitionLag(NamedTuple):
    topic: str
    partition: int
    lag: int


def partition_lags(stats_json: str | bytes, owned: Container[tuple[str, int]] | None = None) -> list[PartitionLag]:
    """The consumer lag of each partition in a librdkafka statistics payload.

    librdkafka hands `stats_cb` a JSON document whose `topics.<name>.partitions.<id>.consumer_lag`
    is the high watermark minus the committed offset. Two kinds of entries carry no lag and are
    skipped: the internal partition -1 (the "unassigned" queue every topic has) and a consumer_lag
    of -1 (not known yet: no committed offset or no watermark fetched). `owned`, when given, holds
    the (topic, partition) pairs this member owns now: librdkafka keeps reporting a revoked
    partition for a while, and its stale lag must not come back after the series was dropped.

    Raises ValueError when the payload is not a librdkafka statistics object.
    """
    try:
        stats = json.loads(stats_json)
    except json.JSONDecodeError as exc:
        raise ValueError(f"librdkafka statistics are not JSON: {exc}") from None
    if not isinstance(stats, dict):
        raise ValueError("librdkafka statistics are not a JSON object")
    topics = stats.get("topics") or {}
    if not isinstance(topics, Mapping):
        raise ValueError("librdkafka statistics: 'topics' is not an object")
    lags: list[PartitionLag] = []
    for topic, tdata in topics.items():
        partitions = tdata.get("partitions") if isinstance(tdata, Mapping) else None
        if not isinstance(partitions, Mapping):
            continue
        for pid_text, pdata in partitions.items():
            try:
                pid = int(pid_text)
            except ValueError:
                continue
            if pid < 0 or not isinstance(pdata, Mapping):
                continue
            lag = pdata.get("consumer_lag", -1)
            # bool is an int subclass; a JSON true is not a lag.
            if not isinstance(lag, int) or isinstance(lag, bool) or lag < 0:
                continue
            if owned is not None and (topic, pid) not in owned:
                continue
            lags.append(PartitionLag(topic, pid, lag))
    return lags
