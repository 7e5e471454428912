"""The open-loop schedule (pure logic); `produce --rate` against the real broker is
tests/broker/test_loadgen_kafka.py."""

from __future__ import annotations

import itertools
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kafka_tools import ROOT
from worker.benchmark.loadgen import Lateness, arrivals, cycled


def test_fixed_spacing_is_exact() -> None:
    times = list(arrivals(100, 1.0, "fixed"))
    assert len(times) == 100
    assert times[0] == 0.0 and times[-1] == pytest.approx(0.99)
    assert all(b - a == pytest.approx(0.01) for a, b in itertools.pairwise(times))


def test_poisson_has_the_rate_on_average_and_varies() -> None:
    times = list(arrivals(1000, 20.0, "poisson", seed=3))
    assert 19_000 < len(times) < 21_000
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(g >= 0 for g in gaps) and max(times) < 20.0
    assert statistics.mean(gaps) == pytest.approx(0.001, rel=0.05)
    # Exponential gaps: the standard deviation is the mean (evenly spaced ones would have 0).
    assert statistics.stdev(gaps) == pytest.approx(0.001, rel=0.1)
    assert list(arrivals(1000, 1.0, seed=3)) == list(arrivals(1000, 1.0, seed=3))
    assert list(arrivals(1000, 1.0, seed=3)) != list(arrivals(1000, 1.0, seed=4))


@pytest.mark.parametrize("rate,duration,spacing", [(0, 1, "fixed"), (10, 0, "fixed"), (10, 1, "bursty")])
def test_arrivals_refuse_bad_arguments(rate: float, duration: float, spacing: str) -> None:
    with pytest.raises(ValueError):
        next(arrivals(rate, duration, spacing))  # type: ignore[arg-type]


def test_cycled_gives_every_record_its_own_id() -> None:
    rows = list(itertools.islice(cycled([("a", "x"), ("b", "y")]), 5))
    assert rows == [("a", "x"), ("b", "y"), ("a~1", "x"), ("b~1", "y"), ("a~2", "x")]
    assert list(cycled([])) == []


def test_lateness_counts_only_late_sends() -> None:
    late = Lateness()
    for s in (-0.5, 0.0, 0.2, 0.1):
        late.add(s)
    assert late.max_s == 0.2 and late.n == 4 and late.mean_s == pytest.approx(0.075)


def test_produce_refuses_a_duration_without_a_rate(tmp_path: Path) -> None:
    src = tmp_path / "q.tsv"
    src.write_text("1\ta\n", encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "worker.cli", "produce", "--bootstrap-servers", "127.0.0.1:1",
                          "--topic", "t", "--input", str(src), "--duration", "5"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--duration needs --rate" in out.stderr
