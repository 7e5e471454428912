"""`keyword-embedder backfill` against `keyword-embedder run` over the same history, paired: does the
range's bookkeeping (the captured ends, the gate over each poll, the per-partition end commits)
cost the backlog rate anything?

    deploy/local/with-kafka.sh .venv/bin/python -m benchmarks.backfill_ab -n 6000 --rounds 6 \
        --json benchmarks/results/kafka/backfill_ab.json

One input topic (6 partitions) holds N real keywords. A round runs each side once, in an order
that rotates: `run` in a fresh group (it starts at the earliest offset) or `backfill` of the
whole history in a fresh group, each into an output topic of its own, ONNX Runtime, the embedding
cache off. The rate is N over the span from the first output record's timestamp to the last one's,
so neither process's start-up (model load, group join) counts; the ratio backfill/run is paired
per round (the box is shared and noisy: only same-round ratios mean anything).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer

from benchmarks.kafka_vs_offline import FALLBACK_DATA, kafka_bootstrap_from_env, publish_keywords
from worker.benchmark.report import quartiles
from worker.formats.keyword_files import read_keywords
from worker.kafka.admin import ensure_topics

ROOT = Path(__file__).resolve().parents[1]


def output_span(bootstrap: str, topic: str, want: int, timeout_s: float, proc: subprocess.Popen[bytes]) -> float:
    """Seconds from the first output record's timestamp to the last, once `want` distinct keys are out."""
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic}-reader", "auto.offset.reset": "earliest",
                       "enable.auto.commit": False, "isolation.level": "read_committed"})
    reader.subscribe([topic])
    keys: set[bytes] = set()
    first, last = float("inf"), 0.0
    deadline = time.monotonic() + timeout_s
    try:
        while len(keys) < want:
            if time.monotonic() > deadline:
                raise SystemExit(f"{topic}: {len(keys)} of {want} outputs after {timeout_s} s")
            for msg in reader.consume(1000, timeout=0.2):
                if msg.error() is None:
                    keys.add(msg.key())
                    ts = msg.timestamp()[1] / 1000.0
                    first, last = min(first, ts), max(last, ts)
            if proc.poll() not in (None, 0):
                raise SystemExit(f"{topic}: the worker exited with {proc.returncode}")
    finally:
        reader.close()
    return last - first


def side(kind: str, bootstrap: str, topic_in: str, n: int, logdir: Path, timeout_s: float) -> float:
    run_id = f"bf-{kind}-{uuid.uuid4().hex[:6]}"
    out, dlq = f"{run_id}-out", f"{run_id}-dlq"
    ensure_topics(bootstrap, {out: 6, dlq: 1})
    common = ["--bootstrap-servers", bootstrap, "--input-topic", topic_in, "--output-topic", out,
              "--dead-letter-topic", dlq, "--backend", "onnxruntime", "--cache-bytes", "0", "--log-format", "json"]
    if kind == "run":
        cmd = [sys.executable, "-m", "worker.cli", "run", *common, "--group-id", run_id]
    else:
        cmd = [sys.executable, "-m", "worker.cli", "backfill", *common, "--group-id", run_id, "--no-progress"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KWE_")}
    with (logdir / f"{run_id}.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        span = output_span(bootstrap, out, n, timeout_s, proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return n / span if span > 0 else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=FALLBACK_DATA)
    ap.add_argument("-n", "--n", type=int, default=6000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bootstrap = kafka_bootstrap_from_env()
    rows = list(read_keywords(args.data, limit=args.n))
    topic_in = f"bf-in-{uuid.uuid4().hex[:6]}"
    ensure_topics(bootstrap, {topic_in: 6})
    # Distinct keys: the same query ID may repeat in the file.
    publish_keywords(bootstrap, topic_in, [(f"{i}-{qid}", text) for i, (qid, text) in enumerate(rows)], "bf")
    logdir = Path(tempfile.mkdtemp(prefix="kwe-backfill-ab-"))
    results: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = ("run", "backfill") if r % 2 == 0 else ("backfill", "run")
        got = {kind: side(kind, bootstrap, topic_in, len(rows), logdir, args.timeout) for kind in order}
        results.append({"round": r, "order": list(order), "run_kw_s": got["run"], "backfill_kw_s": got["backfill"],
                        "ratio": got["backfill"] / got["run"]})
        print(f"round {r}: run {got['run']:7.0f} kw/s  backfill {got['backfill']:7.0f} kw/s  "
              f"ratio {got['backfill'] / got['run']:.3f}", flush=True)
    ratio = quartiles([x["ratio"] for x in results])
    print(f"backfill/run: median {ratio['median']:.3f} (q1 {ratio['q1']:.3f}, q3 {ratio['q3']:.3f})")
    if args.json:
        args.json.write_text(json.dumps({"dataset": args.data.name, "n": len(rows), "rounds": args.rounds,
                                         "cpu_count": os.cpu_count(), "ratio_backfill_over_run": ratio,
                                         "run_kw_s": quartiles([x["run_kw_s"] for x in results]),
                                         "backfill_kw_s": quartiles([x["backfill_kw_s"] for x in results]),
                                         "rounds_detail": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
