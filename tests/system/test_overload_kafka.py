"""Offered twice what the worker can do, then half: nothing is lost, memory stays bounded, and the
partitions drain together.

Issue 37: an open-loop stream above capacity must not grow the worker's memory (flow control
pauses the partitions at max_in_flight; the rest waits in the broker, not in the process), and
when the stream falls below capacity the lag drains and every keyword comes out, from every
partition alike: no partition's keywords wait for the others' backlog (with librdkafka's 1 MiB
per partition and fetch they drained one after another: worker/kafka/consumer.py). The figures
against the sustained rate (2x, then 50%; drain rate, p99 after the drain) are
benchmarks/kafka_latency.py --overload's; this is the short form that proves the three invariants.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.fresh_keywords import FreshKeywords, default_sources
from benchmarks.latency_probes import rss_bytes
from benchmarks.latency_report import partition_line
from benchmarks.latency_rounds import Side, _reader, backlog_round, overload_round
from tests.kafka_tools import WorkerProcess

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

# Above what a 2-core runner sustains open loop (~1,000-2,000 keywords/s here), so the first phase
# is an overload on any box this runs on; the second is a trickle any box keeps up with.
HIGH_RATE = 2500.0
HIGH_S, LOW_S = 8.0, 6.0
RSS_GROWTH_MIB = 64
# The partitions' backlogs reach zero within this share of the drain of each other (one after
# another: about 0.8-0.9 of it).
DRAIN_SPREAD_SHARE = 0.35


def test_an_overload_loses_nothing_keeps_memory_bounded_and_drains_every_partition_alike(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    topics = (make_topic("kw", 6), make_topic("emb", 6), make_topic("dlq", 1))
    worker = WorkerProcess(kafka_bootstrap, *topics, group_id, tmp_path / "w.log", ("--cache-bytes", "0")).start()
    side = Side("ov", [], worker, topics, _reader(kafka_bootstrap, f"{group_id}-rin", topics[0]),
                _reader(kafka_bootstrap, f"{group_id}-rout", topics[1]))
    pool = FreshKeywords(default_sources(), recycle=True)
    try:
        worker.wait_ready(180)
        backlog_round(side, pool.take(2000), kafka_bootstrap, "warmup-")  # warm: RSS measured from here
        assert worker.proc is not None and rss_bytes(worker.proc.pid) > 0
        ov = overload_round(side, pool, kafka_bootstrap, HIGH_RATE, tmp_path, high=1.0, high_s=HIGH_S,
                            low=0.05, low_s=LOW_S, goal_p99_ms=float("inf"))
    finally:
        side.close()
    print(f"sent {ov['sent']}, missing {ov['missing']}, RSS {ov['rss_start_bytes'] / 2**20:.0f} MiB + "
          f"{ov['rss_growth_mib']:.1f} MiB, backlog at the end of the overload {ov['backlog_at_high_end']}, "
          f"its last record out {ov['overload_out_s']:.1f} s later; by partition: {partition_line(ov['by_partition'])}")
    assert ov["missing"] == 0, ov["missing"]
    assert ov["backlog_at_high_end"] > 0, "the first phase was no overload: raise HIGH_RATE"
    assert ov["rss_growth_mib"] <= RSS_GROWTH_MIB, ov["rss"]
    spread = ov["by_partition"]["drain_spread_s"]
    assert spread <= max(2.0, DRAIN_SPREAD_SHARE * ov["overload_out_s"]), partition_line(ov["by_partition"])
