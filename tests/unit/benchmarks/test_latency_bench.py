"""The latency benchmark's own logic: fresh keywords only, cache hit rates, paired summaries."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from benchmarks.fresh_keywords import FreshKeywords, PoolExhaustedError
from benchmarks.latency_probes import cache_hit_rate
from benchmarks.latency_report import (MAX_GENERATOR_LAG_P99_MS, MAX_HIT_RATE, generator_verdict, overload_verdict,
                                      partition_line, partition_spread, render_markdown, render_overload,
                                      schedule_lag_ms, summarise, window_stats, windows_line)
from worker.benchmark.loadgen import arrivals


def test_fresh_keywords_are_distinct_and_never_handed_out_twice(tmp_path: Path) -> None:
    a = tmp_path / "a.tsv"
    b = tmp_path / "b.tsv"
    a.write_text("1\tcheap flights\n2\tCheap  Flights\n3\tused cars\n", encoding="utf-8")
    b.write_text("1\tused cars\n2\tweather today\n", encoding="utf-8")
    pool = FreshKeywords([a, b], seed=1)
    assert len(pool) == 3, "a repeat (case and spacing folded) is offered once"
    got = pool.take(2) + pool.take(1)
    assert len({t.lower() for _, t in got}) == 3 and len({q for q, _ in got}) == 3
    with pytest.raises(PoolExhaustedError, match="only 0 of 3"):
        pool.take(1)


def test_cache_hit_rate_counts_hits_and_joins_of_the_level_only() -> None:
    before = {("kwe_cache_hits_total", ""): 100.0, ("kwe_cache_joined_total", ""): 0.0,
              ("kwe_cache_misses_total", ""): 900.0}
    after = {("kwe_cache_hits_total", ""): 110.0, ("kwe_cache_joined_total", ""): 10.0,
             ("kwe_cache_misses_total", ""): 1880.0}
    assert cache_hit_rate(before, after) == pytest.approx(20 / 1000)
    assert cache_hit_rate({}, {}) == 0.0  # cache off: nothing looked up


def _run(p50: float, p99: float, hits: float = 0.0) -> dict:
    return {"p50_ms": p50, "p99_ms": p99, "mean_batch": 2.0, "cache_hit_rate": hits, "keeps_up": True,
            "missing": 0, "hops": {}, "reader_p50_ms": p50 + 5, "reader_p99_ms": p99 + 5, "valid": True,
            "windows": [{"start_s": 0, "n": 10, "p50_ms": p50, "p99_ms": p99, "max_ms": p99}],
            "generator": {"lag_p99_ms": 1.0}}


def test_summary_gives_quartiles_over_rounds_and_the_paired_ratio() -> None:
    report = {
        "levels": [0.5], "variant_order": ["new", "old"], "rates": {"0.5": 100.0}, "rounds": 3,
        "runs": {"0.5": {"new": [_run(10, 50), _run(12, 100), _run(11, 60)],
                         "old": [_run(20, 100), _run(30, 100), _run(25, 300, hits=0.05)]}},
        "command": "x", "conditions": "y",
        "sustained": {"new": {"steady_kw_s": 200, "whole_kw_s": 180, "n": 4000}},
    }
    rows = summarise(report)
    new, old = rows
    assert new["p99"]["median"] == 60 and new["p50"]["median"] == 11
    assert "p99_ratio_to_first" not in new
    # Paired per round: 100/50, 100/100, 300/60.
    assert old["p99_ratio_to_first"]["median"] == pytest.approx(2.0)
    assert old["max_hit_rate"] == 0.05 > MAX_HIT_RATE
    md = render_markdown(report)
    assert "cache, not model" in md and "| new | 50% |" in md and not math.isnan(new["p99"]["q1"])


def test_a_pool_recycles_only_when_told_the_cache_is_off(tmp_path: Path) -> None:
    src = tmp_path / "q.tsv"
    src.write_text("".join(f"{i}\tquery number {i}\n" for i in range(10)), encoding="utf-8")
    pool = FreshKeywords([src], recycle=True)
    first = pool.take(8)
    again = pool.take(8)  # only 2 left: starts again, reshuffled
    assert pool.recycled == 1 and len(again) == 8 and set(again) <= set(first) | set(pool._rows)
    with pytest.raises(PoolExhaustedError):
        pool.take(11)  # more than the whole pool even recycled


def test_window_stats_show_a_transient_the_level_p99_would_average_away() -> None:
    # 30 s of sends, one a 10 ms; the first 5 s wait 2 s each, the rest 20 ms.
    t = np.arange(0, 30_000, 10, dtype=np.float64) + 1_000_000
    lat = np.where(t - t[0] < 5_000, 2_000.0, 20.0)
    windows = window_stats(t, lat, 5.0)
    assert [w["start_s"] for w in windows] == [0, 5, 10, 15, 20, 25]
    assert windows[0]["p99_ms"] == 2_000 and all(w["p99_ms"] == 20 for w in windows[1:])
    assert sum(w["n"] for w in windows) == len(t)
    assert windows_line(windows) == "2000 / 20 / 20 / 20 / 20 / 20"
    # An empty window (a pause in sending) is left out rather than reported as zero latency.
    gap = window_stats(np.array([0.0, 1.0, 12_000.0]), np.array([5.0, 5.0, 9.0]), 5.0)
    assert [w["start_s"] for w in gap] == [0, 10]
    assert window_stats(np.array([]), np.array([])) == []


def test_generator_lag_is_measured_against_the_schedule_and_rejects_a_late_sender() -> None:
    planned = np.array(list(itertools.islice(arrivals(200.0, float("inf"), "poisson", seed=3), 1000)))
    start_ms = 1.7e12
    on_time = start_ms + 1000 * planned + 1.0  # 1 ms of send overhead each: on time
    lag = schedule_lag_ms(on_time, planned)
    assert lag.max() == pytest.approx(0.0, abs=1e-6)
    assert generator_verdict(lag)["valid"]
    # The sender stalls 50 ms for the last 5% of the records: p99 is 50 ms behind.
    stalled = on_time.copy()
    stalled[950:] += 50.0
    verdict = generator_verdict(schedule_lag_ms(stalled, planned))
    assert verdict["lag_p99_ms"] == pytest.approx(50.0) and not verdict["valid"]
    assert f"{MAX_GENERATOR_LAG_P99_MS:g} ms" in verdict["why"]
    # 1% of records late is within p99: still valid (a single hiccup does not reject a level).
    hiccup = on_time.copy()
    hiccup[500:505] += 80.0
    assert generator_verdict(schedule_lag_ms(hiccup, planned))["valid"]


def test_a_rejected_level_is_left_out_of_the_medians_and_counted() -> None:
    bad = {**_run(500, 5000), "valid": False}
    report = {
        "levels": [0.5], "variant_order": ["new"], "rates": {"0.5": 100.0}, "rounds": 3,
        "runs": {"0.5": {"new": [_run(10, 50), bad, _run(12, 70)]}},
        "command": "x", "conditions": "y", "sustained": {"new": {"steady_kw_s": 200, "whole_kw_s": 180, "n": 4000}},
    }
    (row,) = summarise(report)
    assert row["rejected"] == 1 and row["p99"]["median"] == 60


def test_overload_verdict_finds_the_drain_and_judges_the_p99_after_it() -> None:
    # 10 s of overload (latency growing 0 -> 4 s), then 20 s at a comfortable rate (the backlog
    # drains until 14 s, latency 20 ms after it).
    send = np.arange(0, 30_000, 10, dtype=np.float64)
    lat = np.where(send < 10_000, send * 0.4, np.maximum(20.0, 4_000 - (send - 10_000)))
    out = send + lat
    v = overload_verdict(send, out, high_end_ms=10_000 - 10, goal_p99_ms=100.0)
    assert v["overload_out_s"] == pytest.approx(3.99, abs=0.02)  # the last overload record out at ~13.98 s
    assert v["drain_s"] == pytest.approx(4.1, abs=0.11) and v["lag_zero"]  # what queued behind it: out at 14 s
    assert v["backlog_at_high_end"] > 0 and v["settled"] and v["p99_after_settle_ms"] == 20.0
    assert not overload_verdict(send, out, high_end_ms=9_990, goal_p99_ms=10.0)["settled"]


def _fifo(arrivals_ms: np.ndarray, service_per_s: float) -> np.ndarray:
    """When each record leaves one first-in first-out server of this rate."""
    out, free = np.empty_like(arrivals_ms), 0.0
    for i, t in enumerate(arrivals_ms):
        free = max(free, t) + 1000.0 / service_per_s
        out[i] = free
    return out


def test_the_lag_reaches_zero_only_once_what_queued_behind_the_overload_is_out() -> None:
    # 300/s for 10 s, then 100/s, into a server of 200/s: the overload leaves 1,000 records, its
    # own last one is out at 15 s, but the 500 sent meanwhile queue behind it; the lag falls by
    # the spare 100/s and reaches zero at 20 s.
    send = np.concatenate([np.arange(0, 10_000, 1000 / 300), np.arange(10_000, 40_000, 10.0)])
    out = _fifo(send, 200.0)
    v = overload_verdict(send, out, high_end_ms=10_000, goal_p99_ms=100.0)
    assert v["overload_out_s"] == pytest.approx(5.0, abs=0.05)
    assert v["drain_s"] == pytest.approx(9.0, abs=0.3)  # lag within one second of arrivals (100)
    assert v["drain_kw_s"] == pytest.approx(1000 / 9.0, rel=0.05) and v["settled"]
    # A stream that never catches up is never called drained.
    slow = _fifo(send, 90.0)
    stuck = overload_verdict(send, slow, high_end_ms=10_000, goal_p99_ms=100.0)
    assert not stuck["lag_zero"] and not stuck["settled"] and math.isnan(stuck["p99_after_settle_ms"])


def test_partition_spread_shows_partitions_served_one_after_another() -> None:
    # 10 s of overload on 3 partitions; a fair drain empties them together, a serial one in turn.
    send = np.tile(np.arange(0, 10_000, 10, dtype=np.float64), 3)
    part = np.repeat([0, 1, 2], 1000)
    fair = partition_spread(send, send + 2_000, part, high_end_ms=10_000)
    assert fair["drain_spread_s"] == pytest.approx(0.0)
    assert {r["n"] for r in fair["partitions"].values()} == {1000}
    serial = partition_spread(send, send + 2_000 + part * 5_000.0, part, high_end_ms=10_000)
    assert serial["drain_spread_s"] == pytest.approx(10.0)
    assert serial["partitions"]["2"]["drained_s"] == pytest.approx(11.99)
    assert serial["partitions"]["0"]["p50_ms"] == pytest.approx(2_000)
    assert serial["partitions"]["2"]["p99_ms"] == pytest.approx(12_000)
    # Records sent after the overload are not the backlog's.
    late = partition_spread(np.append(send, 20_000.0), np.append(send + 2_000, 99_000.0), np.append(part, 0), 10_000)
    assert late["drain_spread_s"] == pytest.approx(0.0)
    assert partition_line(serial).startswith("p0 2.0/2.0 s, 0 at +2.0 s | p1 ")


def test_the_overload_report_names_each_variants_drain_and_how_alike_its_partitions_drained() -> None:
    send = np.tile(np.arange(0, 10_000, 10, dtype=np.float64), 2)
    part = np.repeat([0, 1], 1000)
    serial = partition_spread(send, send + 2_000 + part * 5_000.0, part, high_end_ms=10_000)
    ov = {"phases": [{"load": 2.0, "rate": 200.0, "seconds": 10.0}, {"load": 0.5, "rate": 50.0, "seconds": 60.0}],
          "sent": 2000, "missing": 0, "rss_growth_mib": 12.5, "backlog_at_high_end": 900, "overload_out_s": 7.0,
          "drain_s": 60.0, "lag_zero": False, "p99_after_settle_ms": math.nan, "by_partition": serial}
    text = render_overload({"overload": {"new": ov}})
    row = next(line for line in text.splitlines() if line.startswith("| new |"))
    assert "2x (200 kw/s) for 10 s, then 0.5x (50 kw/s) for 60 s" in row
    assert row.endswith("| 12.5 | 900 | 7.0 | not reached | - | 5.0 |")
    assert "- new: p0 2.0/2.0 s, 0 at +2.0 s | p1 " in text
