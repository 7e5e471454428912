"""A Prometheus histogram observed a batch at a time.

prometheus_client's Histogram takes a lock and bisects its bounds per observation: about 1.5 us
on this project's machines, and the worker observes five per-keyword latencies (time in the
topic, poll to submit, queue wait, produce to ack, end to end), which cost more CPU than
everything else the worker does for a keyword but tokenizing it (benchmarks/host/). Here a batch
of observations is one numpy bincount under one lock, whatever its size. The exposition is the
same as a Histogram's (`_bucket{le}`, `_count`, `_sum`, the same `le` strings), so dashboards,
alerts and recording rules read it unchanged; there is no `_created` series.

Threads: any thread observes; one lock per labelled child guards its counts and sum; a scrape
copies them under the same lock.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterator, Sequence

import numpy as np
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

# Up to this many values an observe_many bisects each (measured: below ~30 values numpy's per-call
# cost is the larger; above, its loop is).
SMALL_BATCH = 24


class HistogramChild:
    """One label combination's buckets, count and sum."""

    def __init__(self, bounds: np.ndarray) -> None:
        self._bounds = bounds
        self._bound_list = bounds.tolist()  # one value: bisect beats numpy's per-call overhead
        self._lock = threading.Lock()
        # Plain ints, one per bucket; the last one: above every bound (+Inf).
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self._bound_list, value)
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def observe_repeated(self, value: float, n: int) -> None:
        """`n` observations of one value (a poll's keywords, submitted together); below 0 counts as 0."""
        if n <= 0:
            return
        value = max(0.0, float(value))
        i = bisect.bisect_left(self._bound_list, value)
        with self._lock:
            self._counts[i] += n
            self._sum += value * n

    def observe_many(self, values: Sequence[float] | np.ndarray) -> None:
        """Observes every value; a value below 0 counts as 0 (a clock step, not a negative time)."""
        n = len(values)
        if n == 0:
            return
        if n <= SMALL_BATCH:
            # numpy's fixed cost per call (asarray, maximum, searchsorted, bincount, sum: ~10 us in
            # all) is what a live stream's small polls pay most: a bisect each is cheaper up to here.
            clamped = [v if v > 0.0 else 0.0 for v in (values.tolist() if isinstance(values, np.ndarray) else values)]
            where = [bisect.bisect_left(self._bound_list, v) for v in clamped]
            total = float(sum(clamped))
            with self._lock:
                counts = self._counts
                for i in where:
                    counts[i] += 1
                self._sum += total
            return
        arr = np.maximum(np.asarray(values, dtype=np.float64), 0.0)
        # side="left": a value equal to a bound falls in that bound's bucket (le is inclusive).
        added = np.bincount(np.searchsorted(self._bounds, arr, side="left"), minlength=len(self._counts)).tolist()
        total = float(arr.sum())
        with self._lock:
            counts = self._counts
            for i, c in enumerate(added):
                counts[i] += c
            self._sum += total

    def snapshot(self) -> tuple[np.ndarray, float]:
        with self._lock:
            return np.array(self._counts, dtype=np.int64), self._sum


class BulkHistogram(Collector):
    def __init__(self, name: str, documentation: str, *, buckets: Sequence[float],
                 labelnames: Sequence[str] = (), registry: CollectorRegistry | None = None) -> None:
        bounds = [float(b) for b in buckets if not math.isinf(b)]
        if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"{name}: buckets must increase, got {list(buckets)}")
        self.name = name
        self._doc = documentation
        self._bounds = np.asarray(bounds, dtype=np.float64)
        self._le = [floatToGoString(b) for b in bounds] + ["+Inf"]
        self._labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        if not self._labelnames:
            self._children[()] = HistogramChild(self._bounds)
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str, **named: str) -> HistogramChild:
        key = tuple(str(v) for v in values) if values else tuple(str(named[n]) for n in self._labelnames)
        if len(key) != len(self._labelnames):
            raise ValueError(f"{self.name}: labels {self._labelnames}, got {key}")
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children.setdefault(key, HistogramChild(self._bounds))
        return child

    def observe(self, value: float) -> None:
        self._children[()].observe(value)

    def observe_many(self, values: Sequence[float] | np.ndarray) -> None:
        self._children[()].observe_many(values)

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self._doc, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self._doc, labels=self._labelnames)
        with self._lock:
            children = list(self._children.items())
        for key, child in children:
            counts, total = child.snapshot()
            cumulative = np.cumsum(counts)
            family.add_metric(list(key), buckets=[(le, float(c)) for le, c in zip(self._le, cumulative)],
                              sum_value=total)
        yield family
