"""Where a keyword's time goes under open-loop load: threads, GIL, cores, call prices, flow control, the broker.

    deploy/local/with-kafka.sh .venv/bin/python -m benchmarks.latency_diagnosis --rate 250 \
        --variant old="--merge-buckets=false --intra-op-threads=0 --dispatchers=1" --variant new= \
        --json benchmarks/results/latency/latency_diagnosis.json

Each variant is one `keyword-embedder run` on topics of its own; variants take turns for --rounds
rounds at the same offered rate (fresh keywords each time, benchmarks/fresh_keywords.py). During
the middle of each level it takes:
- py-spy (PyPI; `pip install py-spy`) twice for --profile-s seconds: once with --idle (where each
  Python thread is, wall clock) and once with --gil (which thread holds the GIL); per thread, the
  share of samples in ONNX Runtime's Session.run, in the tokenizer, in librdkafka calls, idle;
- every OS thread's CPU seconds from /proc (ONNX Runtime's pool, librdkafka's threads, Python's);
- the worker's metrics: mean batch, backend seconds per call, the cost model's live/idle slowdown
  (the same call shapes timed on the idle worker at start), paused partitions;
- the broker's CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from benchmarks.fresh_keywords import FreshKeywords, default_sources
from benchmarks.kafka_vs_offline import cpu_seconds, kafka_bootstrap_from_env
from benchmarks.latency_report import quartiles
from benchmarks.latency_rounds import Side, _reader, backlog_round, kafka_level
from tests.kafka_tools import WorkerProcess, http_get
from worker.kafka.admin import ensure_topics

ROOT = Path(__file__).resolve().parents[1]

# Frames that tell what a sampled Python thread is doing (matched against "function (file)").
ACTIVITIES = (
    ("onnxruntime run", re.compile(r"\brun \(.*onnxruntime")),
    ("tokenizer", re.compile(r"\bencode \(.*worker/intake/tokenize\.py")),
    ("json/encode output", re.compile(r"worker/formats/messages\.py|orjson")),
    ("consume (librdkafka)", re.compile(r"\bconsume \(.*worker/kafka/consumer\.py")),
    ("produce/poll (librdkafka)", re.compile(r"\b(produce|poll|flush) \(.*worker/kafka/producer\.py")),
    ("bucketer wait", re.compile(r"\bwait \(.*threading\.py")),
)


def py_spy(pid: int, seconds: float, gil: bool, out: Path) -> dict[str, dict[str, float]]:
    """Per Python thread: share of samples per activity (raw py-spy output, collapsed stacks)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    cmd = [exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200", "--threads",
           "--format", "raw", "--output", str(out), "--nonblocking"]
    cmd += ["--gil"] if gil else ["--idle"]
    subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=True)
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        thread = re.sub(r" \(0x[0-9a-f]+\)| \([0-9]+\)", "", frames[0])
        what = next((name for name, rx in ACTIVITIES if any(rx.search(f) for f in frames[1:])), "other")
        counts[thread][what] += int(n)
    total = sum(sum(c.values()) for c in counts.values()) if gil else None
    result = {}
    for thread, c in counts.items():
        denom = total if gil else sum(c.values())
        result[thread] = {k: round(v / denom, 4) for k, v in c.most_common()}
    return result


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per OS thread name (threads of the same name summed)."""
    out: dict[str, float] = defaultdict(float)
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[re.sub(r"\d+$", "N", name)] += (int(fields[11]) + int(fields[12])) / tick
    return dict(out)


def gauges(url: str) -> dict[str, float]:
    body = http_get(url + "/metrics")[1].decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
            if line and not line.startswith("#")}


def observe(side: Side, broker_pid: int | None, start_after: float, profile_s: float,
            tmp: Path, into: dict[str, Any]) -> None:
    """Runs beside a level: waits, then profiles and samples the worker."""
    time.sleep(start_after)
    assert side.worker.proc is not None
    pid = side.worker.proc.pid
    cpu0, broker0, t0 = thread_cpu(pid), cpu_seconds(broker_pid), time.monotonic()
    paused: list[float] = []
    stop = threading.Event()

    def sample_paused() -> None:
        while not stop.wait(2.0):  # a /metrics render holds the GIL: sample rarely, as Prometheus does
            g = gauges(side.worker.url)
            paused.append(g.get("kwe_paused_partitions", 0.0))

    sampler = threading.Thread(target=sample_paused, daemon=True)
    sampler.start()
    try:
        into["wall"] = py_spy(pid, profile_s, False, tmp / f"{side.name}-wall.txt")
        into["gil"] = py_spy(pid, profile_s, True, tmp / f"{side.name}-gil.txt")
    except (subprocess.SubprocessError, OSError) as exc:
        into["py_spy_error"] = str(exc)
    stop.set()
    sampler.join()
    span = time.monotonic() - t0
    cpu1 = thread_cpu(pid)
    into["cores_used_by_thread"] = {k: round((cpu1.get(k, 0) - cpu0.get(k, 0)) / span, 3)
                                    for k in sorted(cpu1, key=lambda k: cpu0.get(k, 0) - cpu1.get(k, 0))
                                    if cpu1.get(k, 0) - cpu0.get(k, 0) > 0.01 * span}
    into["broker_cores"] = round((cpu_seconds(broker_pid) - broker0) / span, 3)
    into["paused_partitions_mean"] = sum(paused) / len(paused) if paused else math.nan
    g = gauges(side.worker.url)
    into["cost_model_slowdown"] = g.get("kwe_cost_model_slowdown", math.nan)
    into["prices_live_ms"] = {k.split('term="')[1].split('"')[0]: 1000 * v for k, v in g.items()
                              if k.startswith("kwe_cost_model_seconds") and 'source="live"' in k}
    into["prices_calibrated_ms"] = {k.split('term="')[1].split('"')[0]: 1000 * v for k, v in g.items()
                                    if k.startswith("kwe_cost_model_seconds") and 'source="calibrated"' in k}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, required=True, help="offered keywords/s (open loop, Poisson)")
    ap.add_argument("--duration", type=float, default=24.0)
    ap.add_argument("--profile-s", type=float, default=8.0, help="seconds of each py-spy capture")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backlog", type=int, default=0, help="also measure the sustained rate from a backlog of N")
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME=ARGS (`run` flags as shell words); NAME@PATH=ARGS runs the worker of the checkout at PATH")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bootstrap = kafka_bootstrap_from_env()
    pool = FreshKeywords(default_sources())
    run_dir = Path(os.environ.get("KWE_KAFKA_RUN", Path.home() / ".cache" / "keyword-embedder" / "kafka" / "run"))
    broker_pid = int((run_dir / "broker.pid").read_text()) if (run_dir / "broker.pid").is_file() else None
    tmp = Path(tempfile.mkdtemp(prefix="kwe-diag-"))
    sides: list[Side] = []
    results: dict[str, list[dict[str, Any]]] = defaultdict(list)
    sustained: dict[str, Any] = {}
    try:
        for spec in args.variant:
            name, _, rest = spec.partition("=")
            name, _, root = name.partition("@")
            run = f"diag-{name}-{uuid.uuid4().hex[:6]}"
            topics = (f"{run}-in", f"{run}-out", f"{run}-dlq")
            ensure_topics(bootstrap, {topics[0]: 6, topics[1]: 6, topics[2]: 1})
            worker = WorkerProcess(bootstrap, *topics, run, tmp / f"{name}.log",
                                   ("--cache-bytes", "0", *shlex.split(rest)),
                                   root=Path(root).resolve() if root else ROOT).start()
            sides.append(Side(name, shlex.split(rest), worker, topics, _reader(bootstrap, f"{run}-rin", topics[0]),
                              _reader(bootstrap, f"{run}-rout", topics[1])))
        for side in sides:
            side.worker.wait_ready(180)
            backlog_round(side, pool.take(500), bootstrap, f"warmup-{side.name}-")
            if args.backlog:
                sustained[side.name] = backlog_round(side, pool.take(args.backlog), bootstrap, f"peak-{side.name}-")
                print(f"{side.name}: sustained {sustained[side.name]}", flush=True)
        for rnd in range(args.rounds):
            order = sides[rnd % len(sides):] + sides[:rnd % len(sides)]
            for side in order:
                extra: dict[str, Any] = {}
                watcher = threading.Thread(target=observe, args=(side, broker_pid, args.duration / 4, args.profile_s,
                                                                 tmp, extra))
                watcher.start()
                level = kafka_level(side, pool.take(math.ceil(args.rate * args.duration)), bootstrap, args.rate,
                                    args.duration, rnd, "poisson", tmp, broker_pid)
                watcher.join()
                hops = level.pop("hops")
                backend = hops.get("kwe_backend_seconds", {})
                res = {**level, **extra, "backend_ms_per_call": backend.get("mean_ms", math.nan),
                       "queue_wait": hops.get("kwe_queue_wait_seconds"), "hops": hops}
                results[side.name].append(res)
                run_share = {t: v.get("onnxruntime run", 0) for t, v in extra.get("wall", {}).items()}
                print(f"round {rnd} {side.name:>8}: p50 {res['p50_ms']:6.0f} p99 {res['p99_ms']:6.0f} ms, batch "
                      f"{res['mean_batch']:.2f}, {res['backend_ms_per_call']:.1f} ms/call, slowdown "
                      f"{extra.get('cost_model_slowdown', math.nan):.2f}, broker {extra.get('broker_cores')} cores, "
                      f"paused {extra.get('paused_partitions_mean', math.nan):.2f}\n"
                      f"    in Session.run (wall share): {run_share}\n"
                      f"    GIL holders: {extra.get('gil')}\n    cores by thread: {extra.get('cores_used_by_thread')}",
                      flush=True)
    finally:
        for side in sides:
            side.close()
    summary = {name: {"p50_ms": quartiles([r["p50_ms"] for r in rs]), "p99_ms": quartiles([r["p99_ms"] for r in rs]),
                      "mean_batch": quartiles([r["mean_batch"] for r in rs]),
                      "backend_ms_per_call": quartiles([r["backend_ms_per_call"] for r in rs]),
                      "cost_model_slowdown": quartiles([r.get("cost_model_slowdown", math.nan) for r in rs])}
               for name, rs in results.items()}
    report = {"command": " ".join(["python -m benchmarks.latency_diagnosis", *sys.argv[1:]]), "rate": args.rate,
              "load_average": os.getloadavg(), "sustained": sustained, "summary": summary, "runs": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=float) + "\n")
    print(json.dumps(summary, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
