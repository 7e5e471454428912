"""One /metrics for several worker processes: each child's exposition, parsed, every sample given
the child's label (`process="0"`, ...), merged family by family and rendered again. A machine stays
one scrape target however many processes it runs; `sum without (process)` gives the machine's
totals, and a dashboard that sums by pod needs no change. Plus `kwe_worker_process_up{process}`:
1 while that child runs.

Runs on a probe request thread at scrape time; it reads only the texts it is given.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge_expositions(texts: Sequence[tuple[str, str]], *, label: str,
                      up: Sequence[tuple[str, bool]] = ()) -> bytes:
    """The expositions `texts` ((label value, text) pairs) as one, each sample labelled `label`."""
    merged: dict[str, Metric] = {}
    for value, text in texts:
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                into.samples.append(Sample(s.name, {**s.labels, label: value}, s.value, s.timestamp, s.exemplar))
    families = list(merged.values())
    if up:
        gauge = GaugeMetricFamily("kwe_worker_process_up", "1 while the worker process runs (run --processes).",
                                  labels=[label])
        for value, running in up:
            gauge.add_metric([value], 1.0 if running else 0.0)
        families.append(gauge)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)
