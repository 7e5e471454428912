"""The latency benchmark's rounds against one worker: what benchmarks/kafka_latency.py runs.

- `Side`: one worker (`keyword-embedder run`), its topics and the benchmark's readers of its input
  and output (`_reader`, `_drain`, `_collect`), with the stamps they read;
- `backlog_round`: a backlog published at once, the whole-backlog and the steady rate;
- `kafka_level`: one open-loop level at a rate, latency at the output stamp and at the reader,
  per window, per hop, the generator's lag, cache hits, CPU (and --timeline's samples);
- `overload_round`: --overload's high then low phase, RSS, the drain, per partition.

Also used by benchmarks/latency_diagnosis.py and tests/system/test_overload_kafka.py.
"""

from __future__ import annotations

import itertools
import math
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Consumer

from benchmarks.fresh_keywords import FreshKeywords
from benchmarks.kafka_vs_offline import cpu_seconds
from benchmarks.latency_probes import (_sample_timeline, box_ticks, busy_share, cache_hit_rate, hop_breakdown,
                                       rss_bytes, scrape)
from benchmarks.latency_report import (MAX_HIT_RATE, generator_verdict, overload_verdict, partition_spread,
                                       schedule_lag_ms, window_stats)
from tests.kafka_tools import WorkerProcess, produce_queries
from worker.benchmark.loadgen import arrivals

ROOT = Path(__file__).resolve().parents[1]
WARMUP_FRACTION = 0.1
# A level "keeps up" when the last embedding comes at most this long after the last keyword.
KEEPS_UP_DRAIN_S = 2.0


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
    pid = side.worker.proc.pid if side.worker.proc else None
    sampler = threading.Thread(target=_sample_timeline, args=(pid, side.worker.url + "/metrics", broker_pid,
                                                              lambda: gen.pid, stop, samples),
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
