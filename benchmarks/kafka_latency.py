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
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import uuid
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.fresh_keywords import FreshKeywords, default_sources
from benchmarks.kafka_vs_offline import kafka_bootstrap_from_env
from benchmarks.latency_report import level_line, merge_reports, partition_line, windows_line, write_report
from benchmarks.latency_rounds import ROOT, Side, _reader, backlog_round, kafka_level, overload_round
from tests.kafka_tools import WorkerProcess, free_port
from worker.kafka.admin import ensure_topics

# This module is the CLI: the rounds are in latency_rounds.py, what they read beside a level in
# latency_probes.py, and the report (summary, Markdown, --merge) in latency_report.py.
LEVELS = (0.5, 0.8)


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
    bootstrap = kafka_bootstrap_from_env()
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


if __name__ == "__main__":
    sys.exit(main())
