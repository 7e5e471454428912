"""Latency through Kafka under open-loop load, on keywords the worker has not seen before, in paired rounds.

    deploy/local/with-kafka.sh .venv/bin/python -m benchmarks.kafka_latency \
        --json benchmarks/results/latency/kafka_latency.json --markdown benchmarks/results/latency/kafka_latency.md
    (or: make bench-latency)

1. Sustained throughput: each worker (`keyword-embedder run`, default settings unless --worker-arg
   or --variant), warm and in its group, embeds a backlog of --backlog keywords published at once.
   Two rates are reported: the whole backlog's (first publish to last embedding, start-up of the
   in-flight bound included) and the steady one (embeddings between the 25th and 95th percentile
   of their output times, divided by that span), which is what a worker keeps up under a long
   backlog. The load levels are fractions of the first variant's steady rate.
2. For each of --rounds rounds, each level, each variant (in an order that rotates per level and
   round, so that no variant always goes first): `keyword-embedder produce --rate R` publishes
   open loop (Poisson by default, each record stamped at send); latency is the output record's
   timestamp minus its input record's, the first 10% of each level left out as warm-up.
3. Every keyword offered in the run is distinct (benchmarks/fresh_keywords.py: the shared query
   files, repeats folded away), so the cache cannot answer a level; each level's cache hit rate
   is scraped from the worker and a level with more than 2% hits is marked as not measuring the model.
4. Per hop: the worker's Prometheus histograms are scraped before and after each level; the
   difference is that level's breakdown (mean and bucket-estimated p50/p99).

5. Transients: every level reports p50/p99 per 5 s window of send time. Each round starts, per
   variant, with a backlog of --catchup-backlog keywords and, the moment its last embedding is
   read, a "catch-up" level at --catchup of the sustained rate whose every window is kept: what
   live traffic sees after a deploy, restart or rebalance that left lag.
6. The generator's own lag: each record's send stamp against the schedule it followed (the same
   seed, worker/benchmark/loadgen.arrivals); a level more than 20 ms behind at p99 is rejected (it
   measured a starved generator) and left out of the medians.
7. Latency at the reader too: the benchmark's readers run during the level, and the time the
   output reader got each record shows what the output stamp (taken at produce()) does not:
   the producer's linger.ms and the broker's acks.
--timeline samples, every 0.5 s of each level, the kernel's Dirty/Writeback pages, the CPU of the
worker, broker and generator, and the worker's paused partitions, in-flight keywords and batch
counters (what the catch-up diagnosis read). --backend runs every worker on that backend.

Per level and variant the report gives the median and quartiles over rounds of p50 and p99, and,
for every variant after the first, the paired ratio of its p99 to the first variant's p99 in the
same round. The box is shared and noisy: compare variants only within one run; the load average
and the CPU seconds of the worker and broker per level are in the JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Consumer
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.fresh_keywords import FreshKeywords, default_sources
from benchmarks.kafka_vs_offline import cpu_seconds
from tests.kafka_tools import WorkerProcess, free_port, http_get, produce_queries
from worker.benchmark.loadgen import arrivals
from worker.kafka.admin import ensure_topics

ROOT = Path(__file__).resolve().parents[1]
LEVELS = (0.5, 0.8)
WARMUP_FRACTION = 0.1
# A level "keeps up" when the last embedding comes at most this long after the last keyword.
KEEPS_UP_DRAIN_S = 2.0
# More cache hits than this and a level measures the cache, not the model.
MAX_HIT_RATE = 0.02
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


def quartiles(values: list[float]) -> dict[str, float]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return {"q1": math.nan, "median": math.nan, "q3": math.nan}
    q1, med, q3 = np.percentile(vals, [25, 50, 75])
    return {"q1": float(q1), "median": float(med), "q3": float(q3)}


# --------------------------------------------------------------------------- transients, generator
# The per-window view: a transient that a level's p99 averages away shows as one bad window.
WINDOW_S = 5.0
# A level whose generator fell behind its schedule by more than this at p99 measured the
# generator (a starved sender bunches records), not the worker: it is rejected.
MAX_GENERATOR_LAG_P99_MS = 20.0


def window_stats(t_send_ms: np.ndarray, latency_ms: np.ndarray, window_s: float = WINDOW_S) -> list[dict[str, Any]]:
    """p50/p99 per `window_s` window of send time, from the first record sent; empty windows are left out."""
    if len(t_send_ms) == 0:
        return []
    t0 = float(np.min(t_send_ms))
    idx = ((t_send_ms - t0) // (window_s * 1000)).astype(int)
    out = []
    for w in range(int(idx.max()) + 1):
        lat = latency_ms[idx == w]
        if len(lat):
            p50, p99 = np.percentile(lat, [50, 99])
            out.append({"start_s": w * window_s, "n": int(len(lat)), "p50_ms": float(p50), "p99_ms": float(p99),
                        "max_ms": float(lat.max())})
    return out


def schedule_lag_ms(sent_ms: np.ndarray, scheduled_s: np.ndarray) -> np.ndarray:
    """How late each record was sent against its schedule (ms): send stamp minus planned time, the
    schedule's origin taken as the earliest (least late) record, since a sender is never early."""
    offset = np.asarray(sent_ms, dtype=np.float64) - 1000.0 * np.asarray(scheduled_s, dtype=np.float64)
    return offset - offset.min() if len(offset) else offset


def generator_verdict(lag_ms: np.ndarray, limit_ms: float = MAX_GENERATOR_LAG_P99_MS) -> dict[str, Any]:
    """The generator's lag (p50/p99/max, ms) and whether the level is valid (p99 within `limit_ms`)."""
    if len(lag_ms) == 0:
        return {"lag_p50_ms": math.nan, "lag_p99_ms": math.nan, "lag_max_ms": math.nan, "valid": False,
                "why": "nothing sent"}
    p50, p99 = np.percentile(lag_ms, [50, 99])
    valid = bool(p99 <= limit_ms)
    return {"lag_p50_ms": float(p50), "lag_p99_ms": float(p99), "lag_max_ms": float(np.max(lag_ms)), "valid": valid,
            "why": "" if valid else f"generator {p99:.0f} ms behind its schedule at p99 (limit {limit_ms:g} ms)"}


def windows_line(windows: list[dict[str, Any]], key: str = "p99_ms") -> str:
    return " / ".join(f"{w[key]:.0f}" for w in windows)


# --------------------------------------------------------------------------- one worker
@dataclass
class Side:
    name: str
    args: list[str]
    worker: WorkerProcess
    topics: tuple[str, str, str]
    in_reader: Consumer
    out_reader: Consumer
    in_ts: dict[str, int] = field(default_factory=dict)
    out_ts: dict[str, int] = field(default_factory=dict)
    # When the reader got each output record (ms, wall clock): the record timestamp is stamped at
    # produce(), before the producer's linger and the broker's acks; this is after both.
    recv_ts: dict[str, float] = field(default_factory=dict)
    # The input partition of each record (the overload round's per-partition report).
    in_part: dict[str, int] = field(default_factory=dict)

    def close(self) -> None:
        """Close the readers and stop the worker (SIGTERM, the graceful path)."""
        self.in_reader.close()
        self.out_reader.close()
        self.worker.stop()


def _reader(bootstrap: str, group: str, topic: str) -> Consumer:
    # Earliest: the topics are this run's own, and a reader whose group join is slow on a busy box
    # must not start past the records it waits for. The broker answers a fetch as soon as a record
    # arrives (fetch.min.bytes 1), so the wait bound only sets how often an idle reader asks.
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, "fetch.wait.max.ms": 100})
    c.subscribe([topic])
    return c


def _drain(reader: Consumer, into: dict[str, int], recv: dict[str, float] | None, timeout_s: float,
           parts: dict[str, int] | None = None) -> int:
    """One read: waits up to timeout_s for a record, then takes what is already fetched; returns how many."""
    # consume(n, timeout) returns early only once it has n records: wait for one, then take the rest.
    msgs = reader.consume(1, timeout=timeout_s)
    if msgs:
        msgs += reader.consume(1000, timeout=0)
    now_ms = time.time() * 1000
    got = 0
    for msg in msgs:
        if msg.error() or msg.key() is None:
            continue
        key = msg.key().decode()
        if key not in into:
            into[key] = msg.timestamp()[1]
            if recv is not None:
                recv[key] = now_ms
            if parts is not None:
                parts[key] = msg.partition()
            got += 1
    return got


def _collect(reader: Consumer, into: dict[str, int], prefix: str, want: int, timeout_s: float,
             recv: dict[str, float] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    have = sum(k.startswith(prefix) for k in into)
    while have < want and time.monotonic() < deadline:
        _drain(reader, into, recv, 0.2)
        have = sum(k.startswith(prefix) for k in into)


def backlog_round(side: Side, rows: list[tuple[str, str]], bootstrap: str, tag: str) -> dict[str, float]:
    """Publish `rows` at once; the whole-backlog and the steady rate (keywords/s) of the embeddings."""
    t0_ms = time.time() * 1000
    produce_queries(bootstrap, side.topics[0], [(f"{tag}{qid}", text) for qid, text in rows])
    _collect(side.out_reader, side.out_ts, tag, len(rows), 600)
    times = np.sort(np.array([side.out_ts.pop(f"{tag}{q}") for q, _ in rows if f"{tag}{q}" in side.out_ts],
                             dtype=np.float64))
    for q, _ in rows:
        side.recv_ts.pop(f"{tag}{q}", None)
    if len(times) < len(rows):
        raise SystemExit(f"{side.name}: {len(rows) - len(times)} embeddings of the backlog missing after 600 s")
    lo, hi = np.percentile(times, [25, 95])
    inside = int(((times >= lo) & (times <= hi)).sum())
    return {"whole_kw_s": len(rows) / max(1e-3, (times[-1] - t0_ms) / 1000),
            "steady_kw_s": inside / max(1e-3, (hi - lo) / 1000), "n": len(rows),
            "drained_at_ms": float(times[-1])}


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Dirty", "Writeback"):
            out[name.lower() + "_kb"] = int(rest.split()[0])
    return out


def _sample_timeline(side: Side, broker_pid: int | None, gen_pid: Callable[[], int | None], stop: threading.Event,
                     into: list[dict[str, Any]], every_s: float = 0.5) -> None:
    """Beside a level: the kernel's dirty/writeback pages, the CPU of worker, broker and generator,
    and (every other sample, a scrape holds the worker's GIL) its flow control and batching counters."""
    t0 = time.monotonic()
    pid = side.worker.proc.pid if side.worker.proc else None
    k = 0
    while not stop.wait(every_s):
        row: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 2), **_meminfo(),
                               "worker_cpu_s": cpu_seconds(pid), "broker_cpu_s": cpu_seconds(broker_pid),
                               "generator_cpu_s": cpu_seconds(gen_pid()), "load1": os.getloadavg()[0]}
        if k % 2 == 0:
            try:
                body = http_get(side.worker.url + "/metrics")[1].decode()
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


def kafka_level(side: Side, rows: list[tuple[str, str]], bootstrap: str, rate: float, duration: float,
                seed: int, spacing: str, tmp: Path, broker_pid: int | None, *,
                warmup_fraction: float = WARMUP_FRACTION, timeline: bool = False) -> dict[str, Any]:
    """One open-loop level: `rows` sent at `rate`; latency at the worker's output stamp and at the reader.

    The readers run during the level, so the reader's receive time is when the record became readable.
    warmup_fraction=0 keeps the first seconds (the catch-up level: they are what it measures)."""
    tag = f"{side.name}-{uuid.uuid4().hex[:6]}-"
    src = tmp / f"{tag}.tsv"
    src.write_text("".join(f"{tag}{q}\t{t}\n" for q, t in rows), encoding="utf-8")
    before = scrape(side.worker.url)
    cpu0 = (cpu_seconds(side.worker.proc.pid if side.worker.proc else None), cpu_seconds(broker_pid))
    # The whole box's CPU while the generator sends (the worker, the broker, the generator, the
    # readers): how close to saturated the level ran. The generator's own CPU is what the waited-for
    # children used meanwhile (it is the only child that ends in the level).
    box0, children0 = box_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
    # No --duration: the file holds exactly rate x duration fresh keywords and is sent once.
    gen = subprocess.Popen([sys.executable, "-m", "worker.cli", "produce", "--bootstrap-servers", bootstrap,
                            "--topic", side.topics[0], "--input", str(src), "--rate", f"{rate:.3f}",
                            "--spacing", spacing, "--seed", str(seed), "--no-progress"],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_timeline, args=(side, broker_pid, lambda: gen.pid, stop, samples),
                               daemon=True) if timeline else None
    jstat = None
    if sampler:
        sampler.start()
        exe = shutil.which("jstat") or (str(Path(os.readlink(f"/proc/{broker_pid}/exe")).with_name("jstat"))
                                        if broker_pid else None)
        if broker_pid and exe and Path(exe).is_file():
            # One sampler process for the level: the broker's GC time (its JVM pauses hold every fetch and ack).
            jstat = subprocess.Popen([exe, "-gcutil", "-t", str(broker_pid), "1000"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
    give_up = time.monotonic() + duration + 120
    while gen.poll() is None and time.monotonic() < give_up:
        _drain(side.out_reader, side.out_ts, side.recv_ts, 0.05)
        _drain(side.in_reader, side.in_ts, None, 0)
    if gen.poll() is None:
        gen.kill()
    stdout, stderr = gen.communicate()
    box1, children1 = box_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
    if gen.returncode != 0:
        raise SystemExit(f"produce failed: {stderr}")
    sent = int(stdout.split()[1])
    _collect(side.in_reader, side.in_ts, tag, sent, 60)
    _collect(side.out_reader, side.out_ts, tag, sent, max(60.0, duration * 3), side.recv_ts)
    stop.set()
    if sampler:
        sampler.join()
    broker_gc: list[str] = []
    if jstat is not None:
        jstat.terminate()
        broker_gc = [line for line in jstat.communicate()[0].splitlines() if line.strip()]
    cpu1 = (cpu_seconds(side.worker.proc.pid if side.worker.proc else None), cpu_seconds(broker_pid))
    after = scrape(side.worker.url)
    order = [f"{tag}{q}" for q, _ in rows]
    keys = [k for k in order if k in side.in_ts]
    missing = sum(k not in side.out_ts for k in keys)
    # The schedule the generator followed (the same seed and rate: worker/benchmark/loadgen.arrivals), in file order.
    planned = np.fromiter(itertools.islice(arrivals(rate, float("inf"), spacing, seed=seed), len(order)), np.float64)
    position = {k: i for i, k in enumerate(order)}
    gen_lag = schedule_lag_ms(np.array([side.in_ts[k] for k in keys], dtype=np.float64),
                              planned[[position[k] for k in keys]])
    verdict = generator_verdict(gen_lag)
    done = [k for k in keys if k in side.out_ts]
    t_in = np.array([side.in_ts[k] for k in done], dtype=np.float64)
    lat = np.array([side.out_ts[k] - side.in_ts[k] for k in done], dtype=np.float64)
    at_reader = np.array([side.recv_ts.get(k, math.nan) - side.in_ts[k] for k in done], dtype=np.float64)
    t0 = t_in.min()
    keep = t_in >= t0 + duration * 1000 * warmup_fraction
    late = t_in >= t0 + duration * 1000 * 0.75
    drain_s = (max(side.out_ts[k] for k in done) - t_in.max()) / 1000
    p50, p95, p99 = np.percentile(lat[keep], [50, 95, 99])
    seen = keep & ~np.isnan(at_reader)
    r50, r99 = np.percentile(at_reader[seen], [50, 99]) if seen.any() else (math.nan, math.nan)
    batches = after.get(("kwe_batch_size_count", ""), 0) - before.get(("kwe_batch_size_count", ""), 0)
    batched = after.get(("kwe_batch_size_sum", ""), 0) - before.get(("kwe_batch_size_sum", ""), 0)
    hit_rate = cache_hit_rate(before, after)
    for k in order:  # the maps only grow otherwise
        side.in_ts.pop(k, None)
        side.out_ts.pop(k, None)
        side.recv_ts.pop(k, None)
    res = {"sent": sent, "missing": missing, "n": int(keep.sum()), "achieved_per_s": sent / duration,
           "p50_ms": float(p50), "p95_ms": float(p95), "p99_ms": float(p99), "max_ms": float(lat[keep].max()),
           "reader_p50_ms": float(r50), "reader_p99_ms": float(r99),
           "windows": window_stats(t_in, lat), "reader_windows": window_stats(t_in[~np.isnan(at_reader)],
                                                                                at_reader[~np.isnan(at_reader)]),
           "generator": verdict, "valid": verdict["valid"],
           "last_quarter_p50_ms": float(np.percentile(lat[late], 50)) if late.any() else math.nan,
           "drain_s": drain_s, "mean_batch": batched / batches if batches else math.nan,
           "keeps_up": missing == 0 and drain_s <= KEEPS_UP_DRAIN_S,
           "cache_hit_rate": hit_rate, "measures_model": hit_rate <= MAX_HIT_RATE,
           "producer_report": stdout.strip(), "worker_cpu_s": round(cpu1[0] - cpu0[0], 2),
           "broker_cpu_s": round(cpu1[1] - cpu0[1], 2),
           "generator_cpu_s": round(children1.ru_utime + children1.ru_stime
                                    - children0.ru_utime - children0.ru_stime, 2),
           "box_busy": busy_share(box0, box1), "hops": hop_breakdown(before, after)}
    if timeline:
        res["timeline"] = samples
        res["broker_gc"] = broker_gc  # jstat -gcutil -t every second: ..., YGC YGCT FGC FGCT ... GCT
    return res


def level_line(label: str, rate: float, name: str, res: dict[str, Any]) -> str:
    g = res["generator"]
    return (f"{label} {rate:6.0f} kw/s {name:>10}: p50 {res['p50_ms']:6.0f}  p99 {res['p99_ms']:6.0f}  "
            f"reader p50/p99 {res['reader_p50_ms']:5.0f}/{res['reader_p99_ms']:5.0f}  batch {res['mean_batch']:5.1f}  "
            f"hits {res['cache_hit_rate']:.1%}  drain {res['drain_s']:.1f} s  missing {res['missing']}  "
            f"box busy {res.get('box_busy', math.nan):.0%}  "
            f"gen lag p99 {g['lag_p99_ms']:.0f} ms{'' if res['valid'] else ' REJECTED'}\n"
            f"    p99 by {WINDOW_S:g} s window: {windows_line(res['windows'])}")


# --------------------------------------------------------------------------- overload
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


def overload_verdict(t_send_ms: np.ndarray, t_out_ms: np.ndarray, high_end_ms: float, *, goal_p99_ms: float,
                     settle_s: float = 10.0, caught_up_s: float = 1.0) -> dict[str, Any]:
    """After an overload phase ending at high_end_ms: the backlog it left, when the lag reached zero
    and how fast it drained, and the p99 of what was sent from settle_s after that on, against the goal.

    The lag at a moment is what was sent and not yet written. Records sent after the overload
    queue behind its backlog in their partitions, so the lag reaches zero only once they are
    out too, later than the overload's own last record (kept as `overload_out_s`). Under a
    steady stream the lag never reaches 0 exactly: "zero" is the first moment it holds no more
    than `caught_up_s` of what arrives after the overload."""
    high = t_send_ms < high_end_ms
    backlog = int((high & (t_out_ms > high_end_ms)).sum())
    overload_out_ms = float(t_out_ms[high].max()) if high.any() else high_end_ms
    sends, outs = np.sort(t_send_ms), np.sort(t_out_ms)
    # Only while the stream still flows: once sending stops, any lag reaches zero.
    end_ms = float(sends[-1]) if len(sends) else high_end_ms
    arrivals = sends[sends >= high_end_ms]
    low_rate = len(arrivals) / max(1e-3, (float(arrivals[-1]) - high_end_ms) / 1000) if len(arrivals) > 1 else 0.0
    grid = np.arange(high_end_ms, end_ms + 1.0, 100.0)
    lag = np.searchsorted(sends, grid, side="right") - np.searchsorted(outs, grid, side="right")
    zero = np.nonzero(lag <= low_rate * caught_up_s)[0]
    drained_ms = float(grid[zero[0]]) if len(zero) else end_ms
    after = t_send_ms >= drained_ms + settle_s * 1000
    lat = t_out_ms - t_send_ms
    p99_after = float(np.percentile(lat[after], 99)) if after.any() else math.nan
    drain_s = max(0.0, (drained_ms - high_end_ms) / 1000)
    return {"backlog_at_high_end": backlog, "drain_s": drain_s, "lag_zero": bool(len(zero)),
            "overload_out_s": max(0.0, (overload_out_ms - high_end_ms) / 1000),
            "drain_kw_s": backlog / drain_s if drain_s > 0 else math.nan,
            "p99_after_settle_ms": p99_after, "n_after_settle": int(after.sum()),
            "settled": bool(after.any() and p99_after <= goal_p99_ms)}


def partition_spread(t_send_ms: np.ndarray, t_out_ms: np.ndarray, partition: np.ndarray,
                     high_end_ms: float) -> dict[str, Any]:
    """Per input partition, of the records sent during the overload (before high_end_ms): how
    many, their wait's p50/p99 (ms), and when the partition's backlog reached zero (its last such
    record written, seconds after the overload ended); and the spread of those drain times, which
    is 0 when the worker serves its partitions fairly and the drain's length when it serves them
    one after another."""
    high = t_send_ms < high_end_ms
    rows = {}
    for p in np.unique(partition[high]):
        mine = high & (partition == p)
        wait = t_out_ms[mine] - t_send_ms[mine]
        p50, p99 = np.percentile(wait, [50, 99])
        rows[str(int(p))] = {"n": int(mine.sum()), "p50_ms": float(p50), "p99_ms": float(p99),
                             "drained_s": max(0.0, float(t_out_ms[mine].max() - high_end_ms) / 1000)}
    drained = [r["drained_s"] for r in rows.values()]
    return {"partitions": rows, "drain_spread_s": (max(drained) - min(drained)) if drained else math.nan}


def partition_line(spread: dict[str, Any]) -> str:
    """`p0 p50/p99 ms, drained at s | ...` for the overload's printout."""
    return " | ".join(f"p{p} {r['p50_ms'] / 1000:.1f}/{r['p99_ms'] / 1000:.1f} s, 0 at +{r['drained_s']:.1f} s"
                      for p, r in sorted(spread["partitions"].items(), key=lambda kv: int(kv[0])))


def overload_round(side: Side, pool: FreshKeywords, bootstrap: str, peak: float, tmp: Path, *, high: float,
                   high_s: float, low: float, low_s: float, goal_p99_ms: float, seed: int = 7) -> dict[str, Any]:
    """high x peak for high_s seconds, then low x peak for low_s, open loop; RSS sampled throughout."""
    pid = side.worker.proc.pid if side.worker.proc else None
    rss: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        t0 = time.monotonic()
        while not stop.wait(0.5):
            rss.append((round(time.monotonic() - t0, 2), rss_bytes(pid)))

    rss0 = rss_bytes(pid)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tag = f"ov-{side.name}-{uuid.uuid4().hex[:6]}-"
    phases = []
    for k, (frac, secs) in enumerate(((high, high_s), (low, low_s))):
        want = math.ceil(peak * frac * secs)
        rows: list[tuple[str, str]] = []
        while len(rows) < want:  # more than the pool holds when recycled (cache off): take it in parts
            rows += pool.take(min(want - len(rows), max(1, len(pool) // 2)))
        src = tmp / f"{tag}{k}.tsv"
        # The position in the ID: a recycled pool repeats its IDs, every record needs its own.
        src.write_text("".join(f"{tag}{k}-{i}-{q}\t{t}\n" for i, (q, t) in enumerate(rows)), encoding="utf-8")
        start_ms = time.time() * 1000
        gen = subprocess.Popen([sys.executable, "-m", "worker.cli", "produce", "--bootstrap-servers", bootstrap,
                                "--topic", side.topics[0], "--input", str(src), "--rate", f"{peak * frac:.3f}",
                                "--seed", str(seed + k), "--no-progress"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while gen.poll() is None:
            _drain(side.out_reader, side.out_ts, None, 0.05)
            _drain(side.in_reader, side.in_ts, None, 0, side.in_part)
        out, err = gen.communicate()
        if gen.returncode != 0:
            raise SystemExit(f"produce failed: {err}")
        phases.append({"load": frac, "rate": peak * frac, "seconds": secs, "sent": int(out.split()[1]),
                       "start_ms": start_ms, "end_ms": time.time() * 1000, "producer_report": out.strip()})
    sent = sum(p["sent"] for p in phases)
    deadline = time.monotonic() + 60
    while sum(k.startswith(tag) for k in side.in_ts) < sent and time.monotonic() < deadline:
        _drain(side.in_reader, side.in_ts, None, 0.2, side.in_part)
    _collect(side.out_reader, side.out_ts, tag, sent, 300)
    stop.set()
    sampler.join()
    keys = [k for k in side.in_ts if k.startswith(tag)]
    done = [k for k in keys if k in side.out_ts]
    t_in = np.array([side.in_ts[k] for k in done], dtype=np.float64)
    t_out = np.array([side.out_ts[k] for k in done], dtype=np.float64)
    high_end = float(max(side.in_ts[k] for k in keys if k.startswith(f"{tag}0-")))
    verdict = overload_verdict(t_in, t_out, high_end, goal_p99_ms=goal_p99_ms)
    spread = partition_spread(t_in, t_out, np.array([side.in_part[k] for k in done]), high_end)
    low_phase = t_in > high_end
    for k in keys:
        side.in_ts.pop(k, None)
        side.out_ts.pop(k, None)
        side.in_part.pop(k, None)
    peak_rss = max((b for _, b in rss), default=rss0)
    return {"phases": phases, "sent": sent, "missing": sent - len(done), "rss_start_bytes": rss0,
            "rss_peak_bytes": peak_rss, "rss_growth_mib": (peak_rss - rss0) / 2**20, "rss": rss,
            **verdict, "goal_p99_ms": goal_p99_ms, "by_partition": spread,
            "low_phase_windows": window_stats(t_in[low_phase], (t_out - t_in)[low_phase]),
            "high_phase_windows": window_stats(t_in[~low_phase], (t_out - t_in)[~low_phase])}


# --------------------------------------------------------------------------- report
def summarise(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per level and variant: quartiles over rounds of p50/p99, and the paired p99 ratio to the first variant."""
    first = report["variant_order"][0]
    rows = []
    for load in report["levels"]:
        runs = report["runs"][str(load)]
        for name in report["variant_order"]:
            every = runs[name]
            # A level whose generator fell behind its schedule measured the generator: left out.
            mine = [r for r in every if r.get("valid", True)] or every
            row = {"load": load, "variant": name, "rate": report["rates"][str(load)],
                   "rejected": sum(not r.get("valid", True) for r in every),
                   "reader_p50": quartiles([r.get("reader_p50_ms", math.nan) for r in mine]),
                   "reader_p99": quartiles([r.get("reader_p99_ms", math.nan) for r in mine]),
                   "p50": quartiles([r["p50_ms"] for r in mine]), "p99": quartiles([r["p99_ms"] for r in mine]),
                   "mean_batch": quartiles([r["mean_batch"] for r in mine]),
                   # Older reports have no box_busy: nan, shown as "-".
                   "box_busy": quartiles([r.get("box_busy", math.nan) for r in mine]),
                   "max_hit_rate": max(r["cache_hit_rate"] for r in mine),
                   "all_keep_up": all(r["keeps_up"] for r in mine), "missing": sum(r["missing"] for r in mine),
                   "rounds": len(mine)}
            if name != first:
                row["p99_ratio_to_first"] = quartiles([r["p99_ms"] / b["p99_ms"] for r, b in zip(every, runs[first])
                                                       if b["p99_ms"] > 0 and r.get("valid", True)
                                                       and b.get("valid", True)])
            rows.append(row)
    return rows


def _q(q: dict[str, float], fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(q['median'])} ({fmt.format(q['q1'])}-{fmt.format(q['q3'])})"


def render_markdown(report: dict[str, Any]) -> str:
    lines = ["# Latency through Kafka (open loop, keywords not seen before in the run)\n",
             f"Command: `{report['command']}`  ",
             f"Conditions: {report['conditions']}\n",
             *([f"Merged from: {'; '.join(f'`{c}`' for c in report['merged_from'])}\n"] if report.get("merged_from") else []),
             "Sustained from a backlog (keywords/s): " + "; ".join(
                 f"{n}: steady {s['steady_kw_s']:.0f}, whole backlog {s['whole_kw_s']:.0f} ({s['n']:,} keywords)"
                 for n, s in report["sustained"].items()) + "\n",
             f"Medians over {report['rounds']} paired rounds, (q1-q3) in brackets. Cache hits: the highest "
             f"of the rounds; a level above {MAX_HIT_RATE:.0%} does not measure the model.\n",
             "Latency is the output record's timestamp (stamped at produce()) minus the input's (stamped at send); "
             "at the reader it is when the benchmark's reader got the output record, after the producer's linger "
             f"and the broker's acks. A level whose generator was more than {MAX_GENERATOR_LAG_P99_MS:g} ms behind "
             "its schedule at p99 is rejected and left out of the medians.\n",
             "| variant | load | offered kw/s | p50 ms | p99 ms | at the reader p50 / p99 ms | "
             "p99 / first variant's (paired) | mean batch | box busy | cache hits | every ID out, keeps up | "
             "rejected |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for row in summarise(report):
        ratio = _q(row["p99_ratio_to_first"], "{:.2f}") if "p99_ratio_to_first" in row else "-"
        hits = f"{row['max_hit_rate']:.1%}" + ("" if row["max_hit_rate"] <= MAX_HIT_RATE else " (cache, not model)")
        busy = "-" if math.isnan(row["box_busy"]["median"]) else f"{row['box_busy']['median']:.0%}"
        lines.append(f"| {row['variant']} | {row['load']:.0%} | {row['rate']:.0f} | {_q(row['p50'])} | "
                     f"{_q(row['p99'])} | {row['reader_p50']['median']:.0f} / {row['reader_p99']['median']:.0f} | "
                     f"{ratio} | {_q(row['mean_batch'], '{:.1f}')} | {busy} | {hits} | "
                     f"{'yes' if row['all_keep_up'] and not row['missing'] else 'NO'} "
                     f"(missing {row['missing']}) | {row['rejected']} |")
    if report.get("overload"):
        lines += ["", render_overload(report)]
    lines += ["", render_windows(report)]
    lines += ["", "## Where the time goes (per hop, last round; mean / p50 / p99 ms, p50 and p99 estimated "
              "from histogram buckets)", ""]
    last = {(load, name): report["runs"][str(load)][name][-1] for load in report["levels"]
            for name in report["variant_order"] if report["runs"][str(load)].get(name)}
    hops = sorted({h for r in last.values() for h in r["hops"]})
    lines.append("| variant | load | " + " | ".join(h.removeprefix("kwe_").removesuffix("_seconds") for h in hops) + " |")
    lines.append("|---|---:|" + "---:|" * len(hops))
    for (load, name), r in last.items():
        cells = [(f"{v['mean_ms']:.1f} / {v['p50_ms']:.1f} / {v['p99_ms']:.0f}" if (v := r["hops"].get(h)) else "")
                 for h in hops]
        lines.append(f"| {name} | {load:.0%} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_overload(report: dict[str, Any]) -> str:
    """--overload: per variant, what was lost, memory, the drain, and how alike the partitions drained."""
    lines = ["## Overload\n",
             "The lag is what was sent and not yet written; it counts as zero once it holds at most one second of "
             "the low phase's arrivals. Drain spread: between the first and the last partition whose overload "
             "records were all written.\n",
             "| variant | phases | sent | missing | RSS growth MiB | backlog at the overload's end | its last record "
             "out, s after | lag zero at, s after | p99 from 10 s after it, ms | drain spread s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, ov in report["overload"].items():
        phases = ", then ".join(f"{p['load']:g}x ({p['rate']:.0f} kw/s) for {p['seconds']:g} s" for p in ov["phases"])
        zero = f"{ov['drain_s']:.1f}" if ov.get("lag_zero", True) else "not reached"
        p99 = "-" if math.isnan(ov["p99_after_settle_ms"]) else f"{ov['p99_after_settle_ms']:.0f}"
        lines.append(f"| {name} | {phases} | {ov['sent']} | {ov['missing']} | {ov['rss_growth_mib']:.1f} | "
                     f"{ov['backlog_at_high_end']} | {ov.get('overload_out_s', ov['drain_s']):.1f} | {zero} | {p99} | "
                     f"{ov['by_partition']['drain_spread_s']:.1f} |")
    lines += ["", "By partition (the overload's records: wait p50/p99, and when the partition's backlog reached "
              "zero):", ""]
    lines += [f"- {name}: {partition_line(ov['by_partition'])}" for name, ov in report["overload"].items()]
    return "\n".join(lines) + "\n"


def render_windows(report: dict[str, Any]) -> str:
    """Every level, round and variant: p99 (and p50) per window, the catch-up level first."""
    lines = [f"## p50 / p99 by {WINDOW_S:g} s window of send time (ms), every round\n",
             "| level | variant | round | p50 by window | p99 by window | generator lag p99 ms |",
             "|---|---|---:|---|---|---:|"]
    catchup = report.get("catchup") or {}
    blocks = []
    if catchup.get("load"):
        blocks.append((f"catch-up {catchup['load']:.0%} (after {catchup['backlog']:,})", catchup["runs"]))
    blocks += [(f"{load:.0%}", report["runs"][str(load)]) for load in report["levels"]]
    for label, runs in blocks:
        for name in report["variant_order"]:
            for rnd, r in enumerate(runs.get(name, [])):
                lines.append(f"| {label} | {name} | {rnd} | {windows_line(r['windows'], 'p50_ms')} | "
                             f"{windows_line(r['windows'])} | {r['generator']['lag_p99_ms']:.0f}"
                             f"{'' if r.get('valid', True) else ' (rejected)'} |")
    return "\n".join(lines) + "\n"


def merge_reports(reports: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """Invocations of the same levels and variants (e.g. one round each, same --peak) as one report:
    their rounds side by side, in the order given."""
    first = reports[0]
    for r in reports[1:]:
        if r["levels"] != first["levels"] or r["variant_order"] != first["variant_order"]:
            raise SystemExit("--merge: the reports must have the same --levels and variants")
    runs = {lvl: {name: [x for r in reports for x in r["runs"][lvl].get(name, [])] for name in first["variant_order"]}
            for lvl in first["runs"]}
    loads = [r["load_average_at_start"][0] for r in reports] + [r["load_average_at_end"][0] for r in reports]
    return {**first, "command": command, "rounds": sum(r["rounds"] for r in reports), "runs": runs,
            "merged_from": [r["command"] for r in reports],
            "conditions": first["conditions"] + f"; {len(reports)} invocations merged, load average "
                                                f"{min(loads):.1f}-{max(loads):.1f} at their starts and ends"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, nargs="+", default=None,
                    help="query files (id<TAB>text); default: every ../shared/data/queries/*.tsv, else the shipped samples")
    ap.add_argument("--backlog", type=int, default=8000, help="keywords in each worker's throughput round")
    ap.add_argument("--levels", type=float, nargs="*", default=list(LEVELS),
                    help="steady levels, as fractions of the first variant's sustained rate")
    ap.add_argument("--catchup", type=float, default=0.5,
                    help="each round, per variant: a backlog of --catchup-backlog, and the moment its last embedding "
                         "is read a level at this fraction (every window kept); 0: none")
    ap.add_argument("--catchup-backlog", type=int, default=8000)
    ap.add_argument("--catchup-duration", type=float, default=25.0, help="seconds of the catch-up level")
    ap.add_argument("--catchup-restart", action="store_true",
                    help="diagnosis: on odd rounds, restart the worker between the backlog and the catch-up level (does the "
                         "transient live in the worker's state or outside it?)")
    ap.add_argument("--overload", type=float, nargs=4, metavar=("HIGH", "HIGH_S", "LOW", "LOW_S"), default=None,
                    help="instead of the levels: HIGH x the sustained rate for HIGH_S seconds, then LOW x for LOW_S, "
                         "e.g. 2 60 0.5 60; reports RSS growth, what was lost, the drain and the p99 after it")
    ap.add_argument("--goal-p99-ms", type=float, default=100.0, help="--overload: the low level's p99 goal")
    ap.add_argument("--peak", type=float, default=None,
                    help="use this as 100%% (keywords/s) instead of the first variant's measured steady rate "
                         "(runs split over several invocations then offer the same rates)")
    ap.add_argument("--backend", default=None, help="`run --backend` for every worker (default: the worker's own)")
    ap.add_argument("--timeline", action="store_true",
                    help="sample every 0.5 s during each level: Dirty/Writeback pages, worker/broker/generator CPU, "
                         "the worker's paused partitions, in-flight keywords and batch counters (in the JSON)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of open-loop load per level and round")
    ap.add_argument("--spacing", choices=("poisson", "fixed"), default="poisson")
    ap.add_argument("--worker-arg", action="append", default=[], help="`run` flag for the first variant (repeatable)")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=ARGS: another worker with these `run` flags (shell words), e.g. t1=--intra-op-threads=1")
    ap.add_argument("--baseline-root", type=Path, action="append", default=[],
                    help="a checkout of another commit whose worker runs as one more variant (default settings), "
                         "named after its commit: the same run pairs this code against that one")
    ap.add_argument("--cache-off", action="store_true",
                    help="run every worker with --cache-bytes 0; keywords may then repeat across levels (the pool "
                         "is recycled when used up), which lets long levels and large backlogs fit the data")
    ap.add_argument("--seed", type=int, default=0, help="shuffle of the keyword pool")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--merge", type=Path, nargs="+", default=None,
                    help="measure nothing: merge these --json reports (same levels and variants) into --json/--markdown")
    args = ap.parse_args()
    if args.merge:
        merged = merge_reports([json.loads(p.read_text()) for p in args.merge],
                               " ".join(["python -m benchmarks.kafka_latency", *sys.argv[1:]]))
        write_report(merged, args.json, args.markdown)
        return 0
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        raise SystemExit("set KAFKA_BOOTSTRAP_SERVERS (run through deploy/local/with-kafka.sh)")
    pool = FreshKeywords(args.data or default_sources(), seed=args.seed, recycle=args.cache_off)
    # The first variant is named after what it runs: --backend's word (e.g. "auto"), else "default".
    first = "base" if args.worker_arg else (args.backend or "default")
    variants = [(first, list(args.worker_arg))]
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        variants.append((name, shlex.split(rest)))
    roots = {name: ROOT for name, _ in variants}
    for root in args.baseline_root:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        variants.append((f"at-{sha}", []))
        roots[f"at-{sha}"] = root.resolve()
    print(f"{len(pool):,} distinct keywords in {', '.join(p.name for p in pool.sources)}", flush=True)

    run_dir = Path(os.environ.get("KWE_KAFKA_RUN", Path.home() / ".cache" / "keyword-embedder" / "kafka" / "run"))
    broker_pid = int((run_dir / "broker.pid").read_text()) if (run_dir / "broker.pid").is_file() else None
    tmp = Path(tempfile.mkdtemp(prefix="kwe-latency-"))
    load_avg = os.getloadavg()
    sides: list[Side] = []
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {str(level): defaultdict(list) for level in args.levels}
    catchup_runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    overload: dict[str, dict[str, Any]] = {}
    catchup_sustained: dict[str, list[dict[str, float]]] = defaultdict(list)
    sustained: dict[str, dict[str, float]] = {}
    rates: dict[str, float] = {}
    peak = math.nan
    try:
        for name, wargs in variants:
            run = f"lat-{name}-{uuid.uuid4().hex[:6]}"
            topics = (f"{run}-in", f"{run}-out", f"{run}-dlq")
            ensure_topics(bootstrap, {topics[0]: 6, topics[1]: 6, topics[2]: 1})
            cache = (*(("--cache-bytes", "0") if args.cache_off else ()),
                     *(("--backend", args.backend) if args.backend else ()))
            worker = WorkerProcess(bootstrap, *topics, run, tmp / f"{name}.log", (*cache, *wargs),
                                   root=roots[name]).start()
            sides.append(Side(name, wargs, worker, topics, _reader(bootstrap, f"{run}-rin", topics[0]),
                              _reader(bootstrap, f"{run}-rout", topics[1])))
        for side in sides:
            side.worker.wait_ready(180)
            side.in_reader.consume(1, timeout=3.0)
            side.out_reader.consume(1, timeout=3.0)
            backlog_round(side, pool.take(500), bootstrap, f"warmup-{side.name}-")
        for side in sides:
            sustained[side.name] = backlog_round(side, pool.take(args.backlog), bootstrap, f"peak-{side.name}-")
            s = sustained[side.name]
            print(f"sustained from a backlog of {args.backlog:,}: {side.name} steady {s['steady_kw_s']:.0f} kw/s, "
                  f"whole backlog {s['whole_kw_s']:.0f} kw/s", flush=True)
        peak = args.peak or sustained[sides[0].name]["steady_kw_s"]
        if args.overload:
            high, high_s, low, low_s = args.overload
            for side in sides:
                ov = overload_round(side, pool, bootstrap, peak, tmp, high=high, high_s=high_s, low=low, low_s=low_s,
                                    goal_p99_ms=args.goal_p99_ms)
                overload[side.name] = ov
                print(f"overload {side.name}: {high:g}x {peak * high:.0f} kw/s for {high_s:g} s, then {low:g}x for "
                      f"{low_s:g} s: sent {ov['sent']}, missing {ov['missing']}, RSS growth {ov['rss_growth_mib']:.1f} "
                      f"MiB, backlog {ov['backlog_at_high_end']}, its last record out {ov['overload_out_s']:.1f} s "
                      f"after the overload, lag zero {'at' if ov['lag_zero'] else 'not reached by the end,'} "
                      f"+{ov['drain_s']:.1f} s ({ov['drain_kw_s']:.0f} kw/s), p99 from 10 s after it "
                      f"{ov['p99_after_settle_ms']:.0f} ms (goal {args.goal_p99_ms:g}); low-phase p99 by window: "
                      f"{windows_line(ov['low_phase_windows'])}",
                      flush=True)
                print(f"  overload records by partition (wait p50/p99, backlog zero at): "
                      f"{partition_line(ov['by_partition'])}; drain spread {ov['by_partition']['drain_spread_s']:.1f} s",
                      flush=True)
            args.levels, args.rounds, args.catchup = [], 0, 0
        per_second = sum(peak * lvl for lvl in args.levels) * len(sides) * args.rounds
        catchup_need = (args.catchup_backlog + math.ceil(peak * args.catchup * args.catchup_duration)) \
            * len(sides) * args.rounds if args.catchup else 0
        if not args.cache_off and catchup_need > pool.left:
            raise SystemExit(f"the catch-up levels need {catchup_need:,} fresh keywords but {pool.left:,} are left; "
                             "use --cache-off, fewer --rounds or a smaller --catchup-backlog")
        left = pool.left - catchup_need
        if per_second and not args.cache_off and per_second * args.duration + len(args.levels) * len(sides) * args.rounds > left:
            # Never recycle keywords (the cache would answer them): shorten the levels instead.
            fits = 0.98 * left / per_second - 0.1
            if fits < 2.0:
                raise SystemExit(f"the levels need {per_second * args.duration:,.0f} fresh keywords but "
                                 f"{left:,} are left; use fewer --rounds/--levels or a smaller --backlog")
            print(f"only {left:,} fresh keywords left: {fits:.1f} s per level instead of {args.duration:g} s",
                  flush=True)
            args.duration = fits
        step = 0
        for rnd in range(args.rounds):
            if args.catchup:
                rate = peak * args.catchup
                k = rnd % len(sides)
                for side in sides[k:] + sides[:k]:
                    # The backlog, then at once (the moment its last embedding is read) live traffic.
                    s = backlog_round(side, pool.take(args.catchup_backlog), bootstrap, f"cu{rnd}-{side.name}-")
                    catchup_sustained[side.name].append(s)
                    if args.catchup_restart and rnd % 2 == 1:
                        side.worker.stop()
                        side.worker = replace(side.worker, proc=None, metrics_port=free_port()).start()
                        side.worker.wait_ready(180)
                    res = kafka_level(side, pool.take(math.ceil(rate * args.catchup_duration)), bootstrap, rate,
                                      args.catchup_duration, 500 + rnd, args.spacing, tmp, broker_pid,
                                      warmup_fraction=0.0, timeline=args.timeline)
                    res["backlog"] = s
                    catchup_runs[side.name].append(res)
                    print(level_line(f"round {rnd} catch-up {args.catchup:4.0%} (backlog {s['steady_kw_s']:.0f} kw/s)",
                                     rate, side.name, res), flush=True)
            for i, load in enumerate(args.levels):
                rate = rates[str(load)] = peak * load
                names = [s.name for s in sides]
                k = step % len(names)
                step += 1
                for which in names[k:] + names[:k]:
                    side = next(s for s in sides if s.name == which)
                    rows = pool.take(math.ceil(rate * args.duration))
                    res = kafka_level(side, rows, bootstrap, rate, args.duration, 1000 * rnd + i, args.spacing,
                                      tmp, broker_pid, timeline=args.timeline)
                    runs[str(load)][which].append(res)
                    print(level_line(f"round {rnd} {load:4.0%}", rate, which, res), flush=True)
    finally:
        for side in sides:
            side.close()
    report = {
        "command": " ".join(["python -m benchmarks.kafka_latency", *sys.argv[1:]]),
        "conditions": (f"{os.cpu_count()} cores shared with the broker and other users; load average at the start "
                       f"{load_avg[0]:.1f}; {args.duration:g} s per level, {args.spacing} spacing; "
                       f"{len(pool):,} distinct keywords from {', '.join(p.name for p in pool.sources)}"
                       + (f"; cache off, pool recycled {pool.recycled} times" if args.cache_off else
                          "; none offered twice")),
        "load_average_at_start": load_avg, "load_average_at_end": os.getloadavg(), "cpu_count": os.cpu_count(),
        "duration_s": args.duration, "rounds": args.rounds, "levels": args.levels,
        "variants": dict(variants), "roots": {k: str(v) for k, v in roots.items()}, "variant_order": [n for n, _ in variants], "sustained": sustained,
        "rates": rates, "runs": {k: dict(v) for k, v in runs.items()}, "backend": args.backend or "default",
        "peak_kw_s": peak if sides and sustained else None, "overload": overload,
        "catchup": {"load": args.catchup, "backlog": args.catchup_backlog, "duration_s": args.catchup_duration,
                    "rate": peak * args.catchup,
                    "runs": dict(catchup_runs), "sustained": dict(catchup_sustained)},
    }
    write_report(report, args.json, args.markdown)
    return 0


def write_report(report: dict[str, Any], json_path: Path | None, markdown_path: Path | None) -> None:
    """The report as --json and --markdown ask, and as markdown on stdout."""
    if json_path:
        json_path.write_text(json.dumps(report, indent=2, default=float) + "\n")
    if markdown_path:
        markdown_path.write_text(render_markdown(report))
    print(render_markdown(report))


if __name__ == "__main__":
    sys.exit(main())
