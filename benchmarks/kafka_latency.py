"""Latency through Kafka under open-loop load, beside the same bucketer offline, in one run.

    deploy/local/with-kafka.sh .venv/bin/python benchmarks/kafka_latency.py \
        --json benchmarks/results/kafka_latency.json --markdown benchmarks/results/kafka_latency.md
    (or: make bench-latency)

1. Sustained throughput: one `keyword-embedder run` (default settings unless --worker-arg), warm
   and in its group, embeds a backlog of N keywords published at once (as benchmarks/kafka_vs_offline.py).
2. For each load level (25/50/80/90% of that throughput): `keyword-embedder produce --rate R
   --duration D` publishes open-loop (Poisson), each record stamped at send; latency is the
   output record's timestamp minus its input record's (both read back from the topics), the
   first 10% of each level left out as warm-up. Paired with it, in the same run and in
   alternating order: worker.benchmark.load.run_open_loop, the same bucketer, backend and settings on the
   same queries at the same rate, with no Kafka.
3. Per hop: the worker's Prometheus histograms (kwe_*_seconds) are scraped before and after
   each level; the difference is that level's breakdown (mean and bucket-estimated p50/p99).

`--variant NAME=ARGS` adds workers with other settings (e.g. `--variant nospin=--ort-allow-spinning=false`):
each has its own topics and group; every variant and the offline run see the same offered rates
(from the first variant's throughput) in rotating order, so their ratios are paired.
The box is shared and noisy: compare variants only within one run; the load average at the
start and the CPU seconds of the worker and broker per level are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Consumer
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kafka_vs_offline import DEFAULT_DATA, FALLBACK_DATA, cpu_seconds, kafka_round  # noqa: E402
from tests.kafka_tools import WorkerProcess, http_get  # noqa: E402
from worker.config import Settings, add_setting_flags, load_settings  # noqa: E402
from worker.kafka.admin import ensure_topics  # noqa: E402
from worker.keyword_files import read_keywords  # noqa: E402

LEVELS = (0.25, 0.5, 0.8, 0.9)
WARMUP_FRACTION = 0.1
# A level "keeps up" when the last embedding comes at most this long after the last keyword.
KEEPS_UP_DRAIN_S = 2.0


# --------------------------------------------------------------------------- per-hop histograms
def scrape(url: str) -> dict[tuple[str, str], float]:
    """(sample name, le) -> value for every kwe_*_seconds histogram, summed over other labels."""
    _, body = http_get(url + "/metrics")
    out: dict[tuple[str, str], float] = defaultdict(float)
    for fam in text_string_to_metric_families(body.decode() if isinstance(body, bytes) else body):
        if fam.type != "histogram" or not (fam.name.endswith("_seconds") or fam.name == "kwe_batch_size"):
            continue
        for s in fam.samples:
            # kwe_hop_seconds{hop="encode"} -> kwe_hop_encode_seconds: one row per hop.
            name = s.name.replace("hop_seconds", f"hop_{s.labels['hop']}_seconds") if "hop" in s.labels else s.name
            out[(name, s.labels.get("le", ""))] += s.value
    return dict(out)


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


# --------------------------------------------------------------------------- one Kafka side
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


def _reader(bootstrap: str, group: str, topic: str) -> Consumer:
    # Earliest: the topics are this run's own, and a reader whose group join is slow on a busy box
    # must not start past the records it waits for (with "latest" it would wait forever).
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, "fetch.wait.max.ms": 5})
    c.subscribe([topic])
    return c


def _collect(reader: Consumer, into: dict[str, int], prefix: str, want: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    have = sum(k.startswith(prefix) for k in into)
    while have < want and time.monotonic() < deadline:
        for msg in reader.consume(1000, timeout=0.2):
            if msg.error() or msg.key() is None:
                continue
            key = msg.key().decode()
            if key.startswith(prefix) and key not in into:
                into[key] = msg.timestamp()[1]
                have += 1


def kafka_level(side: Side, rows: list[tuple[str, str]], bootstrap: str, rate: float, duration: float,
                seed: int, tmp: Path, broker_pid: int | None) -> dict[str, Any]:
    tag = f"{side.name}-{uuid.uuid4().hex[:6]}-"
    src = tmp / f"{tag}.tsv"
    src.write_text("".join(f"{tag}{q}\t{t}\n" for q, t in rows), encoding="utf-8")
    before = scrape(side.worker.url)
    cpu0 = (cpu_seconds(side.worker.proc.pid if side.worker.proc else None), cpu_seconds(broker_pid))
    out = subprocess.run([sys.executable, "-m", "worker.cli", "produce", "--bootstrap-servers", bootstrap,
                          "--topic", side.topics[0], "--input", str(src), "--rate", f"{rate:.3f}", "--duration",
                          str(duration), "--seed", str(seed), "--no-progress"],
                         cwd=ROOT, capture_output=True, text=True, timeout=duration + 120)
    if out.returncode != 0:
        raise SystemExit(f"produce failed: {out.stderr}")
    sent = int(out.stdout.split()[1])
    _collect(side.in_reader, side.in_ts, tag, sent, 60)
    _collect(side.out_reader, side.out_ts, tag, sent, max(60.0, duration * 3))
    cpu1 = (cpu_seconds(side.worker.proc.pid if side.worker.proc else None), cpu_seconds(broker_pid))
    after = scrape(side.worker.url)
    keys = [k for k in side.in_ts if k.startswith(tag)]
    missing = sum(k not in side.out_ts for k in keys)
    t_in = np.array([side.in_ts[k] for k in keys if k in side.out_ts], dtype=np.float64)
    lat = np.array([side.out_ts[k] - side.in_ts[k] for k in keys if k in side.out_ts], dtype=np.float64)
    t0 = t_in.min()
    keep = t_in >= t0 + duration * 1000 * WARMUP_FRACTION
    late = t_in >= t0 + duration * 1000 * 0.75
    drain_s = (max(side.out_ts[k] for k in keys if k in side.out_ts) - t_in.max()) / 1000
    p50, p95, p99 = np.percentile(lat[keep], [50, 95, 99])
    batches = after.get(("kwe_batch_size_count", ""), 0) - before.get(("kwe_batch_size_count", ""), 0)
    batched = after.get(("kwe_batch_size_sum", ""), 0) - before.get(("kwe_batch_size_sum", ""), 0)
    for k in keys:  # the maps only grow otherwise
        side.in_ts.pop(k, None)
        side.out_ts.pop(k, None)
    return {"sent": sent, "missing": missing, "n": int(keep.sum()), "achieved_per_s": sent / duration,
            "p50_ms": float(p50), "p95_ms": float(p95), "p99_ms": float(p99), "max_ms": float(lat[keep].max()),
            "last_quarter_p50_ms": float(np.percentile(lat[late], 50)) if late.any() else math.nan,
            "drain_s": drain_s, "mean_batch": batched / batches if batches else math.nan, "keeps_up": missing == 0 and drain_s <= KEEPS_UP_DRAIN_S,
            "producer_report": out.stdout.strip(), "worker_cpu_s": round(cpu1[0] - cpu0[0], 2),
            "broker_cpu_s": round(cpu1[1] - cpu0[1], 2), "hops": hop_breakdown(before, after)}


def offline_level(encoded: list[Any], settings: Settings, backend: Any, profile: Any, rate: float,
                  duration: float, seed: int, load: float) -> dict[str, Any]:
    from worker.benchmark.load import run_open_loop
    from worker.benchmark.policies import BucketerOptions

    options = BucketerOptions(max_queue_delay_ms=settings.max_queue_delay_ms, dispatchers=settings.dispatchers,
                              pad_to=settings.pad_to if settings.pad_to != "auto" else None)
    lvl = run_open_loop(encoded, profile, backend, rate=rate, seconds=duration, options=options, seed=seed,
                        load=load, warmup_fraction=WARMUP_FRACTION)
    return {"n": lvl.n, "p50_ms": lvl.p50_ms, "p95_ms": lvl.p95_ms, "p99_ms": lvl.p99_ms, "max_ms": lvl.max_ms,
            "mean_batch": lvl.mean_batch}


def settings_from(worker_args: list[str]) -> Settings:
    """The settings a worker started with these flags would have (for the offline twin)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_setting_flags(parser)
    known, _ = parser.parse_known_args(worker_args)
    return load_settings(known, env={})


# --------------------------------------------------------------------------- report
def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# Latency through Kafka (open loop) vs offline, one run\n",
             f"Command: `{report['command']}`  ",
             f"Conditions: {report['conditions']}\n",
             "| variant | load | offered kw/s | p50 ms | p95 ms | p99 ms | max ms | keeps up (drain s) | mean batch | "
             "offline p50 / p99 ms | offline mean batch |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for lvl in report["levels"]:
        off = lvl["offline"]
        for name, k in lvl["kafka"].items():
            lines.append(f"| {name} | {lvl['load']:.0%} | {lvl['rate']:.0f} | {k['p50_ms']:.0f} | {k['p95_ms']:.0f} | "
                         f"{k['p99_ms']:.0f} | {k['max_ms']:.0f} | {'yes' if k['keeps_up'] else 'NO'} "
                         f"({k['drain_s']:.1f}) | {k.get('mean_batch', math.nan):.1f} | {off['p50_ms']:.0f} / "
                         f"{off['p99_ms']:.0f} | {off.get('mean_batch', math.nan):.1f} |")
    lines += ["", "## Where the time goes (per hop; mean / p50 / p99 ms, p50 and p99 estimated from "
              "histogram buckets)", ""]
    hops = sorted({h for lvl in report["levels"] for k in lvl["kafka"].values() for h in k["hops"]})
    lines.append("| variant | load | " + " | ".join(h.removeprefix("kwe_").removesuffix("_seconds") for h in hops) + " |")
    lines.append("|---|---:|" + "---:|" * len(hops))
    for lvl in report["levels"]:
        for name, k in lvl["kafka"].items():
            cells = []
            for h in hops:
                v = k["hops"].get(h)
                cells.append(f"{v['mean_ms']:.1f} / {v['p50_ms']:.1f} / {v['p99_ms']:.0f}" if v else "")
            lines.append(f"| {name} | {lvl['load']:.0%} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA if DEFAULT_DATA.exists() else FALLBACK_DATA)
    ap.add_argument("--backlog", type=int, default=4000, help="keywords in the throughput round")
    ap.add_argument("--levels", type=float, nargs="+", default=list(LEVELS))
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of open-loop load per level")
    ap.add_argument("--worker-arg", action="append", default=[], help="`run` flag for the first variant (repeatable)")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=ARGS: another worker with these `run` flags (shell words), e.g. nospin=--ort-allow-spinning=false")
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        raise SystemExit("set KAFKA_BOOTSTRAP_SERVERS (run through deploy/local/with-kafka.sh)")
    rows = list(read_keywords(args.data))
    variants = [("default" if not args.worker_arg else "base", list(args.worker_arg))]
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        variants.append((name, shlex.split(rest)))

    run_dir = Path(os.environ.get("KWE_KAFKA_RUN", Path.home() / ".cache" / "keyword-embedder" / "kafka" / "run"))
    broker_pid = int((run_dir / "broker.pid").read_text()) if (run_dir / "broker.pid").is_file() else None
    tmp = Path(tempfile.mkdtemp(prefix="kwe-latency-"))
    load_avg = os.getloadavg()
    sides: list[Side] = []
    try:
        for name, wargs in variants:
            run = f"lat-{name}-{uuid.uuid4().hex[:6]}"
            topics = (f"{run}-in", f"{run}-out", f"{run}-dlq")
            ensure_topics(bootstrap, {topics[0]: 6, topics[1]: 6, topics[2]: 1})
            worker = WorkerProcess(bootstrap, *topics, run, tmp / f"{name}.log", tuple(wargs)).start()
            sides.append(Side(name, wargs, worker, topics, _reader(bootstrap, f"{run}-rin", topics[0]),
                              _reader(bootstrap, f"{run}-rout", topics[1])))
        for side in sides:
            side.worker.wait_ready(180)
            side.in_reader.consume(1, timeout=3.0)
            side.out_reader.consume(1, timeout=3.0)
            kafka_round(f"warmup-{side.name}", rows[:500], bootstrap, side.topics[0], side.out_reader)
        peaks = {}
        for side in sides:
            n = min(args.backlog, len(rows))
            peaks[side.name] = n / kafka_round(f"peak-{side.name}", rows[:n], bootstrap, side.topics[0],
                                               side.out_reader)
            print(f"sustained from a backlog: {side.name} {peaks[side.name]:.0f} kw/s", flush=True)
        peak = peaks[sides[0].name]

        offline: tuple[Any, ...] | None = None
        if not args.no_offline:
            from worker.backends.select import load_backend
            from worker.tokenize import KeywordTokenizer

            loaded = load_backend(settings_from(sides[0].args))
            settings, backend, profile = loaded.settings, loaded.backend, loaded.profile
            tokenizer = KeywordTokenizer.from_model(loaded.model)
            encoded = tokenizer.encode([t for _, t in rows])
            offline = (encoded, settings, backend, profile)

        levels = []
        for i, load in enumerate(args.levels):
            rate = peak * load
            order: list[str] = [s.name for s in sides] + ([] if offline is None else ["offline"])
            k = i % len(order)
            order = order[k:] + order[:k]
            lvl: dict[str, Any] = {"load": load, "rate": rate, "kafka": {}, "offline": {}}
            for which in order:
                if which == "offline":
                    assert offline is not None
                    lvl["offline"] = offline_level(*offline, rate=rate, duration=args.duration, seed=i, load=load)
                    res = lvl["offline"]
                else:
                    side = next(s for s in sides if s.name == which)
                    res = lvl["kafka"][which] = kafka_level(side, rows, bootstrap, rate, args.duration, i, tmp,
                                                            broker_pid)
                print(f"{load:4.0%} {rate:6.0f} kw/s {which:>10}: p50 {res['p50_ms']:7.0f}  p95 {res['p95_ms']:7.0f}  "
                      f"p99 {res['p99_ms']:7.0f}  max {res['max_ms']:7.0f} ms"
                      + (f"  drain {res['drain_s']:.1f} s" if "drain_s" in res else ""), flush=True)
            lvl.setdefault("offline", {})
            levels.append(lvl)
    finally:
        for side in sides:
            side.in_reader.close()
            side.out_reader.close()
            side.worker.stop()
    if offline is None:
        for lvl in levels:
            lvl["offline"] = {"p50_ms": math.nan, "p99_ms": math.nan}
    report = {
        "command": " ".join(["benchmarks/kafka_latency.py", *sys.argv[1:]]),
        "conditions": (f"{os.cpu_count()} cores shared with the broker and other users; load average at the start "
                       f"{load_avg[0]:.1f}; {args.duration:g} s per level; dataset {args.data.name}"),
        "load_average_at_start": load_avg, "cpu_count": os.cpu_count(), "dataset": args.data.name,
        "duration_s": args.duration, "variants": dict(variants), "sustained_kw_s": peaks, "levels": levels,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=float) + "\n")
    if args.markdown:
        args.markdown.write_text(render_markdown(report))
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
