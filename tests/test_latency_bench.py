"""The latency benchmark's own logic: fresh keywords only, cache hit rates, paired summaries."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.fresh_keywords import FreshKeywords, PoolExhaustedError
from benchmarks.kafka_latency import MAX_HIT_RATE, cache_hit_rate, render_markdown, summarise


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
            "missing": 0, "hops": {}}


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
