"""Latency through Kafka under open-loop load, on keywords the worker has not seen before, in paired rounds.

    deploy/local/with-kafka.sh .venv/bin/python benchmarks/kafka_latency.py \
        --json benchmarks/results/kafka_latency.json --markdown benchmarks/results/kafka_latency.md
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

Per level and variant the report gives the median and quartiles over rounds of p50 and p99, and,
for every variant after the first, the paired ratio of its p99 to the first variant's p99 in the
same round. The box is shared and noisy: compare variants only within one run; the load average
and the CPU seconds of the worker and broker per level are in the JSON.
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

from benchmarks.fresh_keywords import FreshKeywords, default_sources  # noqa: E402
from benchmarks.kafka_vs_offline import cpu_seconds  # noqa: E402
from tests.kafka_tools import WorkerProcess, http_get, produce_queries  # noqa: E402
from worker.kafka.admin import ensure_topics  # noqa: E402

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

    def close(self) -> None:
        """Close the readers and stop the worker (SIGTERM, the graceful path)."""
        self.in_reader.close()
        self.out_reader.close()
        self.worker.stop()


def _reader(bootstrap: str, group: str, topic: str) -> Consumer:
    # Earliest: the topics are this run's own, and a reader whose group join is slow on a busy box
    # must not start past the records it waits for. The record timestamps carry the latency, so
    # the readers need not fetch eagerly: a long fetch wait keeps their load off the broker.
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, "fetch.wait.max.ms": 200})
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


def backlog_round(side: Side, rows: list[tuple[str, str]], bootstrap: str, tag: str) -> dict[str, float]:
    """Publish `rows` at once; the whole-backlog and the steady rate (keywords/s) of the embeddings."""
    t0_ms = time.time() * 1000
    produce_queries(bootstrap, side.topics[0], [(f"{tag}{qid}", text) for qid, text in rows])
    _collect(side.out_reader, side.out_ts, tag, len(rows), 600)
    times = np.sort(np.array([side.out_ts.pop(f"{tag}{q}") for q, _ in rows if f"{tag}{q}" in side.out_ts],
                             dtype=np.float64))
    if len(times) < len(rows):
        raise SystemExit(f"{side.name}: {len(rows) - len(times)} embeddings of the backlog missing after 600 s")
    lo, hi = np.percentile(times, [25, 95])
    inside = int(((times >= lo) & (times <= hi)).sum())
    return {"whole_kw_s": len(rows) / max(1e-3, (times[-1] - t0_ms) / 1000),
            "steady_kw_s": inside / max(1e-3, (hi - lo) / 1000), "n": len(rows)}


def kafka_level(side: Side, rows: list[tuple[str, str]], bootstrap: str, rate: float, duration: float,
                seed: int, spacing: str, tmp: Path, broker_pid: int | None) -> dict[str, Any]:
    tag = f"{side.name}-{uuid.uuid4().hex[:6]}-"
    src = tmp / f"{tag}.tsv"
    src.write_text("".join(f"{tag}{q}\t{t}\n" for q, t in rows), encoding="utf-8")
    before = scrape(side.worker.url)
    cpu0 = (cpu_seconds(side.worker.proc.pid if side.worker.proc else None), cpu_seconds(broker_pid))
    # No --duration: the file holds exactly rate x duration fresh keywords and is sent once.
    out = subprocess.run([sys.executable, "-m", "worker.cli", "produce", "--bootstrap-servers", bootstrap,
                          "--topic", side.topics[0], "--input", str(src), "--rate", f"{rate:.3f}",
                          "--spacing", spacing, "--seed", str(seed), "--no-progress"],
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
    hit_rate = cache_hit_rate(before, after)
    for k in keys:  # the maps only grow otherwise
        side.in_ts.pop(k, None)
        side.out_ts.pop(k, None)
    return {"sent": sent, "missing": missing, "n": int(keep.sum()), "achieved_per_s": sent / duration,
            "p50_ms": float(p50), "p95_ms": float(p95), "p99_ms": float(p99), "max_ms": float(lat[keep].max()),
            "last_quarter_p50_ms": float(np.percentile(lat[late], 50)) if late.any() else math.nan,
            "drain_s": drain_s, "mean_batch": batched / batches if batches else math.nan,
            "keeps_up": missing == 0 and drain_s <= KEEPS_UP_DRAIN_S,
            "cache_hit_rate": hit_rate, "measures_model": hit_rate <= MAX_HIT_RATE,
            "producer_report": out.stdout.strip(), "worker_cpu_s": round(cpu1[0] - cpu0[0], 2),
            "broker_cpu_s": round(cpu1[1] - cpu0[1], 2), "hops": hop_breakdown(before, after)}


# --------------------------------------------------------------------------- report
def summarise(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per level and variant: quartiles over rounds of p50/p99, and the paired p99 ratio to the first variant."""
    first = report["variant_order"][0]
    rows = []
    for load in report["levels"]:
        runs = report["runs"][str(load)]
        for name in report["variant_order"]:
            mine = runs[name]
            row = {"load": load, "variant": name, "rate": report["rates"][str(load)],
                   "p50": quartiles([r["p50_ms"] for r in mine]), "p99": quartiles([r["p99_ms"] for r in mine]),
                   "mean_batch": quartiles([r["mean_batch"] for r in mine]),
                   "max_hit_rate": max(r["cache_hit_rate"] for r in mine),
                   "all_keep_up": all(r["keeps_up"] for r in mine), "missing": sum(r["missing"] for r in mine),
                   "rounds": len(mine)}
            if name != first:
                row["p99_ratio_to_first"] = quartiles([r["p99_ms"] / b["p99_ms"]
                                                       for r, b in zip(mine, runs[first]) if b["p99_ms"] > 0])
            rows.append(row)
    return rows


def _q(q: dict[str, float], fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(q['median'])} ({fmt.format(q['q1'])}-{fmt.format(q['q3'])})"


def render_markdown(report: dict[str, Any]) -> str:
    lines = ["# Latency through Kafka (open loop, keywords not seen before in the run)\n",
             f"Command: `{report['command']}`  ",
             f"Conditions: {report['conditions']}\n",
             "Sustained from a backlog (keywords/s): " + "; ".join(
                 f"{n}: steady {s['steady_kw_s']:.0f}, whole backlog {s['whole_kw_s']:.0f} ({s['n']:,} keywords)"
                 for n, s in report["sustained"].items()) + "\n",
             f"Medians over {report['rounds']} paired rounds, (q1-q3) in brackets. Cache hits: the highest "
             f"of the rounds; a level above {MAX_HIT_RATE:.0%} does not measure the model.\n",
             "| variant | load | offered kw/s | p50 ms | p99 ms | p99 / first variant's (paired) | mean batch | "
             "cache hits | every ID out, keeps up |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in summarise(report):
        ratio = _q(row["p99_ratio_to_first"], "{:.2f}") if "p99_ratio_to_first" in row else "-"
        hits = f"{row['max_hit_rate']:.1%}" + ("" if row["max_hit_rate"] <= MAX_HIT_RATE else " (cache, not model)")
        lines.append(f"| {row['variant']} | {row['load']:.0%} | {row['rate']:.0f} | {_q(row['p50'])} | "
                     f"{_q(row['p99'])} | {ratio} | {_q(row['mean_batch'], '{:.1f}')} | {hits} | "
                     f"{'yes' if row['all_keep_up'] and not row['missing'] else 'NO'} "
                     f"(missing {row['missing']}) |")
    lines += ["", "## Where the time goes (per hop, last round; mean / p50 / p99 ms, p50 and p99 estimated "
              "from histogram buckets)", ""]
    last = {(load, name): report["runs"][str(load)][name][-1] for load in report["levels"]
            for name in report["variant_order"]}
    hops = sorted({h for r in last.values() for h in r["hops"]})
    lines.append("| variant | load | " + " | ".join(h.removeprefix("kwe_").removesuffix("_seconds") for h in hops) + " |")
    lines.append("|---|---:|" + "---:|" * len(hops))
    for (load, name), r in last.items():
        cells = [(f"{v['mean_ms']:.1f} / {v['p50_ms']:.1f} / {v['p99_ms']:.0f}" if (v := r["hops"].get(h)) else "")
                 for h in hops]
        lines.append(f"| {name} | {load:.0%} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, nargs="+", default=None,
                    help="query files (id<TAB>text); default: every ../shared/data/queries/*.tsv, else the shipped samples")
    ap.add_argument("--backlog", type=int, default=8000, help="keywords in each worker's throughput round")
    ap.add_argument("--levels", type=float, nargs="+", default=list(LEVELS))
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
    args = ap.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        raise SystemExit("set KAFKA_BOOTSTRAP_SERVERS (run through deploy/local/with-kafka.sh)")
    pool = FreshKeywords(args.data or default_sources(), seed=args.seed, recycle=args.cache_off)
    variants = [("default" if not args.worker_arg else "base", list(args.worker_arg))]
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
    sustained: dict[str, dict[str, float]] = {}
    rates: dict[str, float] = {}
    try:
        for name, wargs in variants:
            run = f"lat-{name}-{uuid.uuid4().hex[:6]}"
            topics = (f"{run}-in", f"{run}-out", f"{run}-dlq")
            ensure_topics(bootstrap, {topics[0]: 6, topics[1]: 6, topics[2]: 1})
            cache = ("--cache-bytes", "0") if args.cache_off else ()
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
        peak = sustained[sides[0].name]["steady_kw_s"]
        per_second = sum(peak * lvl for lvl in args.levels) * len(sides) * args.rounds
        if not args.cache_off and per_second * args.duration + len(args.levels) * len(sides) * args.rounds > pool.left:
            # Never recycle keywords (the cache would answer them): shorten the levels instead.
            fits = 0.98 * pool.left / per_second - 0.1
            if fits < 2.0:
                raise SystemExit(f"the levels need {per_second * args.duration:,.0f} fresh keywords but "
                                 f"{pool.left:,} are left; use fewer --rounds/--levels or a smaller --backlog")
            print(f"only {pool.left:,} fresh keywords left: {fits:.1f} s per level instead of {args.duration:g} s",
                  flush=True)
            args.duration = fits
        step = 0
        for rnd in range(args.rounds):
            for i, load in enumerate(args.levels):
                rate = rates[str(load)] = peak * load
                names = [s.name for s in sides]
                k = step % len(names)
                step += 1
                for which in names[k:] + names[:k]:
                    side = next(s for s in sides if s.name == which)
                    rows = pool.take(math.ceil(rate * args.duration))
                    res = kafka_level(side, rows, bootstrap, rate, args.duration, 1000 * rnd + i, args.spacing,
                                      tmp, broker_pid)
                    runs[str(load)][which].append(res)
                    print(f"round {rnd} {load:4.0%} {rate:6.0f} kw/s {which:>10}: p50 {res['p50_ms']:7.0f}  "
                          f"p99 {res['p99_ms']:7.0f}  max {res['max_ms']:7.0f} ms  batch {res['mean_batch']:5.1f}  "
                          f"hits {res['cache_hit_rate']:.1%}  drain {res['drain_s']:.1f} s  missing {res['missing']}",
                          flush=True)
    finally:
        for side in sides:
            side.close()
    report = {
        "command": " ".join(["benchmarks/kafka_latency.py", *sys.argv[1:]]),
        "conditions": (f"{os.cpu_count()} cores shared with the broker and other users; load average at the start "
                       f"{load_avg[0]:.1f}; {args.duration:g} s per level, {args.spacing} spacing; "
                       f"{len(pool):,} distinct keywords from {', '.join(p.name for p in pool.sources)}"
                       + (f"; cache off, pool recycled {pool.recycled} times" if args.cache_off else
                          "; none offered twice")),
        "load_average_at_start": load_avg, "load_average_at_end": os.getloadavg(), "cpu_count": os.cpu_count(),
        "duration_s": args.duration, "rounds": args.rounds, "levels": args.levels,
        "variants": dict(variants), "roots": {k: str(v) for k, v in roots.items()}, "variant_order": [n for n, _ in variants], "sustained": sustained,
        "rates": rates, "runs": {k: dict(v) for k, v in runs.items()},
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=float) + "\n")
    if args.markdown:
        args.markdown.write_text(render_markdown(report))
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
