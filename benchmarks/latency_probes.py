"""The latency benchmark's probes of the worker and the box: what benchmarks/kafka_latency.py reads beside a level.

- `scrape`: the worker's Prometheus histograms and cache counters; `cache_hit_rate` and
  `hop_breakdown` (per hop: count, mean, bucket-estimated p50/p99) between two scrapes;
- `_sample_timeline`: every 0.5 s of a level (--timeline), the kernel's Dirty/Writeback pages
  (`_meminfo`), the CPU of worker, broker and generator, and the worker's flow-control and
  batching counters;
- `box_ticks` and `busy_share`: the whole machine's busy share over a span (/proc/stat);
- `rss_bytes`: a process's resident set size (the overload round, tests/system/test_faults_kafka.py).

Linux only (/proc); no Kafka client here.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.kafka_vs_offline import cpu_seconds
from tests.kafka_tools import http_get

CACHE_COUNTERS = ("kwe_cache_hits_total", "kwe_cache_joined_total", "kwe_cache_misses_total")


# --------------------------------------------------------------------------- scraping the worker
def scrape(url: str) -> dict[tuple[str, str], float]:
    """(sample name, le) -> value for every kwe_*_seconds histogram and the cache counters."""
    _, body = http_get(url + "/metrics")
    out: dict[tuple[str, str], float] = defaultdict(float)
    for fam in text_string_to_metric_families(body.decode() if isinstance(body, bytes) else body):
        if fam.name.startswith("kwe_cache_"):
            for s in fam.samples:
                out[(s.name, "")] += s.value
            continue
        if fam.type != "histogram" or not (fam.name.endswith("_seconds") or fam.name == "kwe_batch_size"):
            continue
        for s in fam.samples:
            # kwe_hop_seconds{hop="encode"} -> kwe_hop_encode_seconds: one row per hop.
            name = s.name.replace("hop_seconds", f"hop_{s.labels['hop']}_seconds") if "hop" in s.labels else s.name
            out[(name, s.labels.get("le", ""))] += s.value
    return dict(out)


def cache_hit_rate(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> float:
    """Share of the level's looked-up keywords answered by the cache (hits and joins); 0 with the cache off."""
    delta = {name: after.get((name, ""), 0.0) - before.get((name, ""), 0.0) for name in CACHE_COUNTERS}
    looked_up = sum(delta.values())
    return (delta["kwe_cache_hits_total"] + delta["kwe_cache_joined_total"]) / looked_up if looked_up else 0.0


def hop_breakdown(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[str, Any]:
    """Per histogram: observations, mean and bucket-estimated p50/p99 (ms) between two scrapes."""
    names = {k[0][: -len("_count")] for k in after if k[0].endswith("_seconds_count")}
    result = {}
    for name in sorted(names):
        count = after.get((f"{name}_count", ""), 0) - before.get((f"{name}_count", ""), 0)
        if count <= 0:
            continue
        total = after.get((f"{name}_sum", ""), 0) - before.get((f"{name}_sum", ""), 0)
        edges = sorted((float(le), after[(n, le)] - before.get((n, le), 0)) for (n, le) in after
                       if n == f"{name}_bucket")
        result[name] = {"count": int(count), "mean_ms": 1000 * total / count,
                        "p50_ms": _quantile(edges, 0.5), "p99_ms": _quantile(edges, 0.99)}
    return result


def _quantile(edges: list[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile: linear inside the bucket that holds the q-th observation."""
    if not edges or edges[-1][1] <= 0:
        return math.nan
    rank = q * edges[-1][1]
    lo_edge, lo_count = 0.0, 0.0
    for edge, cum in edges:
        if cum >= rank:
            if math.isinf(edge):
                return 1000 * lo_edge
            frac = (rank - lo_count) / (cum - lo_count) if cum > lo_count else 1.0
            return 1000 * (lo_edge + (edge - lo_edge) * frac)
        lo_edge, lo_count = edge, cum
    return 1000 * lo_edge


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Dirty", "Writeback"):
            out[name.lower() + "_kb"] = int(rest.split()[0])
    return out


def _sample_timeline(pid: int | None, metrics_url: str, broker_pid: int | None, gen_pid: Callable[[], int | None],
                     stop: threading.Event, into: list[dict[str, Any]], every_s: float = 0.5) -> None:
    """Beside a level: the kernel's dirty/writeback pages, the CPU of the worker (`pid`), broker and
    generator, and (every other sample, a scrape holds the worker's GIL) the flow control and batching
    counters of its /metrics at `metrics_url`."""
    t0 = time.monotonic()
    k = 0
    while not stop.wait(every_s):
        row: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 2), **_meminfo(),
                               "worker_cpu_s": cpu_seconds(pid), "broker_cpu_s": cpu_seconds(broker_pid),
                               "generator_cpu_s": cpu_seconds(gen_pid()), "load1": os.getloadavg()[0]}
        if k % 2 == 0:
            try:
                body = http_get(metrics_url)[1].decode()
            except OSError:
                body = ""
            for line in body.splitlines():
                if line.startswith(("kwe_paused_partitions ", "kwe_in_flight_keywords ", "kwe_batch_size_count",
                                    "kwe_batch_size_sum", "kwe_consumed_messages_total", "kwe_produced_messages_total",
                                    "kwe_queue_wait_seconds_sum", "kwe_queue_wait_seconds_count",
                                    "kwe_backend_seconds_sum", "kwe_backend_seconds_count", "kwe_hop_seconds_sum",
                                    "kwe_hop_seconds_count", "kwe_real_tokens_total", "kwe_padded_tokens_total",
                                    "kwe_merged_batches_total")):
                    name, _, value = line.rpartition(" ")
                    key = name.split("{")[0]
                    if 'hop="' in name:
                        key += "_" + name.split('hop="')[1].split('"')[0]
                    row[key] = row.get(key, 0.0) + float(value)
        k += 1
        into.append(row)


def box_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far (/proc/stat), for the share busy in a span."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    except (OSError, ValueError):
        return 0, 0
    return sum(fields) - fields[3] - fields[4], sum(fields)  # idle and iowait are not busy


def busy_share(t0: tuple[int, int], t1: tuple[int, int]) -> float:
    return (t1[0] - t0[0]) / (t1[1] - t0[1]) if t1[1] > t0[1] else math.nan


def rss_bytes(pid: int | None) -> int:
    """Resident set size of a process (VmRSS), 0 when unknown."""
    if pid is None:
        return 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
