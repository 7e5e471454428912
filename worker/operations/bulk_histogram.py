"""A Prometheus histogram observed a batch at a time.

prometheus_client's Histogram takes a lock and bisects its bounds per observation: about 1.5 us
on this project's machines, and the worker observes five per-keyword latencies (time in the
topic, poll to submit, queue wait, produce to ack, end to end), which cost more CPU than
everything else the worker does for a keyword but tokenizing it (benchmarks/host/). Here a batch
of observations is sorted once and counted with a bisect per bound, under one lock. The
exposition is the same as a Histogram's (`_bucket{le}`, `_count`, `_sum`, the same `le` strings),
so dashboards, alerts and recording rules read it unchanged; there is no `_created` series.

Why not numpy: `np.searchsorted` gives up the interpreter lock for its loop, whatever the size,
and every such release hands the lock to another of the worker's threads, which on another core
costs more than the counting (through the broker, the worker's CPU a keyword 0.884x (0.856-0.911)
with numpy out of these paths, 4 paired rounds; docs/performance.md, The host path). A sort and
a few dozen bisects stay in C and keep the lock.

Threads: any thread observes; one lock per labelled child guards its counts and sum; a scrape
copies them under the same lock.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString


class HistogramChild:
    """One label combination's buckets, count and sum."""

    def __init__(self, bounds: np.ndarray) -> None:
        self._bound_list = bounds.tolist()  # bisected, in C and holding the interpreter lock
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

    def observe_many(self, values: Iterable[float] | np.ndarray) -> None:
        """Observes every value; a value below 0 counts as 0 (a clock step, not a negative time)."""
        if isinstance(values, np.ndarray):
            values = values.tolist()
        clamped = [v if v > 0.0 else 0.0 for v in values]
        if not clamped:
            return
        if len(clamped) <= len(self._bound_list):
            # Fewer values than bounds (a live stream's small polls): a bisect each is cheaper.
            where = [bisect.bisect_left(self._bound_list, v) for v in clamped]
            total = sum(clamped)
            with self._lock:
                counts = self._counts
                for i in where:
                    counts[i] += 1
                self._sum += total
            return
        clamped.sort()
        # How many values are <= each bound (le is inclusive): bucket i holds those above bound i-1.
        at_most = [bisect.bisect_right(clamped, bound) for bound in self._bound_list]
        total = sum(clamped)
        with self._lock:
            counts = self._counts
            below = 0
            for i, n in enumerate(at_most):
                counts[i] += n - below
                below = n
            counts[-1] += len(clamped) - below
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
