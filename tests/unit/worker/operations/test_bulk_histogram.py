"""worker/operations/bulk_histogram.py: a batch of observations exposes what prometheus_client's
Histogram exposes for the same observations, one at a time."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from worker.operations.bulk_histogram import BulkHistogram

BUCKETS = (0.0001, 0.001, 0.01, 0.1, 1.0, 10.0)


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("#") or "_created" in line:
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


@pytest.mark.parametrize("labelled", [False, True])
def test_a_batch_exposes_what_one_at_a_time_does(labelled: bool) -> None:
    rng = np.random.default_rng(3)
    # Values on the bounds (le is inclusive), between them, above the last, and 0.
    values = np.concatenate([rng.lognormal(-5, 2, 500), np.array(BUCKETS), [0.0, 50.0, 1e-9]])
    ref_reg, bulk_reg = CollectorRegistry(), CollectorRegistry()
    labels = ["hop"] if labelled else []
    ref = Histogram("kwe_x_seconds", "x", labels, buckets=BUCKETS, registry=ref_reg)
    bulk = BulkHistogram("kwe_x_seconds", "x", labelnames=labels, buckets=BUCKETS, registry=bulk_reg)
    ref_child = ref.labels(hop="encode") if labelled else ref
    bulk_child = bulk.labels(hop="encode") if labelled else bulk
    for v in values:
        ref_child.observe(float(v))
    bulk_child.observe_many(values[:300])
    for v in values[300:310]:
        bulk_child.observe(float(v))
    bulk_child.observe_many(list(values[310:]))
    got, want = _samples(bulk_reg), _samples(ref_reg)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12), name


def test_negative_values_count_as_zero_and_an_empty_batch_is_nothing() -> None:
    reg = CollectorRegistry()
    h = BulkHistogram("kwe_y_seconds", "y", buckets=BUCKETS, registry=reg)
    h.observe_many([])
    h.observe_many(np.array([-0.5, 0.00005]))
    s = _samples(reg)
    assert s['kwe_y_seconds_bucket{le="0.0001"}'] == 2 and s["kwe_y_seconds_count"] == 2
    assert s["kwe_y_seconds_sum"] == pytest.approx(0.00005)
    # More values than bounds (sorted and counted per bound): the same rule.
    h.observe_many([-1.0, -0.001, 0.0, 0.0001, 0.0002, 0.5, 1.0, 20.0])
    s = _samples(reg)
    assert s['kwe_y_seconds_bucket{le="0.0001"}'] == 6 and s['kwe_y_seconds_bucket{le="0.001"}'] == 7
    assert s['kwe_y_seconds_bucket{le="1.0"}'] == 9 and s['kwe_y_seconds_bucket{le="+Inf"}'] == 10
    assert s["kwe_y_seconds_sum"] == pytest.approx(0.00005 + 0.0001 + 0.0002 + 0.5 + 1.0 + 20.0)


def test_one_value_repeated_is_that_many_observations_of_it() -> None:
    ref_reg, bulk_reg = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("kwe_r_seconds", "r", buckets=BUCKETS, registry=ref_reg)
    bulk = BulkHistogram("kwe_r_seconds", "r", buckets=BUCKETS, registry=bulk_reg)
    for value, n in [(0.01, 7), (0.003, 1), (-1.0, 2), (20.0, 3), (0.5, 0)]:
        for _ in range(n):
            ref.observe(max(0.0, value))
        bulk.labels().observe_repeated(value, n)
    got, want = _samples(bulk_reg), _samples(ref_reg)
    assert got == pytest.approx(want, rel=1e-12) and got["kwe_r_seconds_count"] == 13


def test_buckets_must_increase() -> None:
    with pytest.raises(ValueError, match="increase"):
        BulkHistogram("kwe_z", "z", buckets=(1.0, 0.5))
