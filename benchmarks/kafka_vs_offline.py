"""What Kafka costs: end-to-end keywords/s through the broker against the same pipeline offline.

Run with a broker (the script starts none itself):
    deploy/local/with-kafka.sh .venv/bin/python -m benchmarks.kafka_vs_offline --json benchmarks/results/kafka/kafka_vs_offline.json

kafka:   one `keyword-embedder run` process (default settings), already in its group and warm;
         a round publishes N keywords and ends when the last embedding is read back from the
         output topic (produce + consume + worker, through a single-node broker on the same box).
offline: in this process, the same path without Kafka: tokenize in consume-sized chunks, the
         worker's own Bucketer and backend, the same in-flight window (max_in_flight).
Rounds alternate the order of the two; the ratio kafka/offline is paired per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import orjson
from confluent_kafka import Consumer, Producer

from tests.kafka_tools import WorkerProcess
from worker.batching.bucketer import Bucketer
from worker.benchmark.report import quartiles
from worker.formats.keyword_files import read_keywords
from worker.intake.flow import CONSUME_BATCH
from worker.kafka.admin import ensure_topics
from worker.settings.schema import Settings

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "queries" / "msmarco-passage-dev.tsv"
FALLBACK_DATA = ROOT / "tests" / "data" / "queries" / "terabyte05-20k.tsv"


def offline_round(texts: list[str], settings: Settings, tokenizer, backend, profile) -> float:  # noqa: ANN001
    """Seconds to embed texts with the worker's bucketer, fed through the in-flight window.

    Not worker.benchmark.policies.run_bucketed: that one takes pre-tokenized items and keeps tokenization out
    of its timing, while the worker tokenizes each consumed chunk as it goes, overlapped with
    inference; the offline side of this comparison has to pay for the same work the same way.
    """
    window = settings.max_in_flight
    done = threading.Semaphore(0)
    room = threading.Condition()
    pending = [0]

    def on_complete(seqs, rows, stats) -> None:  # noqa: ANN001
        with room:
            pending[0] -= len(seqs)
            room.notify_all()
        for _ in seqs:
            done.release()

    def on_error(seqs, exc) -> None:  # noqa: ANN001
        raise SystemExit(f"backend failed: {exc!r}")

    bucketer = Bucketer(profile, backend, on_complete, on_error=on_error,
                        max_queue_delay_ms=settings.max_queue_delay_ms, dispatchers=settings.dispatchers,
                        pad_to=settings.pad_to)
    bucketer.start()
    start = time.perf_counter()
    seq = 0
    for i in range(0, len(texts), CONSUME_BATCH):
        chunk = texts[i:i + CONSUME_BATCH]
        with room:
            room.wait_for(lambda: pending[0] + len(chunk) <= window)
            pending[0] += len(chunk)
        for enc in tokenizer.encode(chunk):
            bucketer.submit(seq, enc.ids)
            seq += 1
    for _ in range(len(texts)):
        done.acquire()
    elapsed = time.perf_counter() - start
    bucketer.stop()
    return elapsed


def publish_keywords(bootstrap: str, topic: str, rows: list[tuple[str, str]], tag: str) -> None:
    """Each (id, text) as {"id": "<tag>-<id>", "text"} keyed by that id, flushed (the rounds' input)."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True})
    for qid, text in rows:
        key = f"{tag}-{qid}"
        while True:
            try:
                producer.produce(topic, key=key.encode(), value=orjson.dumps({"id": key, "text": text}))
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    producer.flush(60)


def kafka_round(tag: str, rows: list[tuple[str, str]], bootstrap: str, topic_in: str, reader: Consumer, *,
                published: Callable[[], None] | None = None) -> float:
    """Publishes the rows and reads every embedding back; seconds from the first publish (or from
    `published`'s return, when given: it runs once everything is published) to the last embedding."""
    want = {f"{tag}-{qid}" for qid, _ in rows}
    start = time.perf_counter()
    publish_keywords(bootstrap, topic_in, rows, tag)
    if published is not None:
        published()
        start = time.perf_counter()
    deadline = time.monotonic() + 600
    while want:
        for msg in reader.consume(1000, timeout=0.05):
            if not msg.error():
                want.discard(msg.key().decode())
        if time.monotonic() > deadline:
            raise SystemExit(f"{len(want)} embeddings missing after 600 s")
    return time.perf_counter() - start


BROKER_PID = Path.home() / ".cache" / "keyword-embedder" / "kafka" / "run" / "broker.pid"


def kafka_bootstrap_from_env() -> str:
    """The broker a Kafka benchmark runs against (KAFKA_BOOTSTRAP_SERVERS), or exit saying how to get one."""
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        raise SystemExit("set KAFKA_BOOTSTRAP_SERVERS (run through deploy/local/with-kafka.sh)")
    return bootstrap


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process (all its threads), from /proc; 0 when unknown."""
    if pid is None:
        return 0.0
    try:
        return stat_cpu_seconds(Path(f"/proc/{pid}/stat"))
    except OSError:
        return 0.0


def stat_cpu_seconds(stat: Path) -> float:
    """User + system CPU time in a /proc stat file (a process's, or one thread's under task/);
    OSError when it is gone."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA if DEFAULT_DATA.exists() else FALLBACK_DATA)
    ap.add_argument("-n", type=int, default=0, help="keywords per round (0: the whole file)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--worker-arg", action="append", default=[],
                    help="Extra `keyword-embedder run` argument for the Kafka side (repeatable), e.g. "
                         "--worker-arg=--output-encoding --worker-arg=base64-f32")
    args = ap.parse_args()
    bootstrap = kafka_bootstrap_from_env()
    rows = list(read_keywords(args.data, limit=args.n or None))

    from worker.backend_choice.select import load_backend
    from worker.intake.tokenize import KeywordTokenizer

    # The same assembly as the worker: the model read once, every "auto" resolved.
    loaded = load_backend(Settings())
    settings, backend, profile = loaded.settings, loaded.backend, loaded.profile
    tokenizer = KeywordTokenizer.from_model(loaded.model)

    # The broker shares this box's cores in the local setup; its CPU time is reported apart.
    broker_pid = int(BROKER_PID.read_text()) if BROKER_PID.is_file() else None
    run = f"bench-{uuid.uuid4().hex[:6]}"
    topic_in, topic_out, topic_dlq = f"{run}-in", f"{run}-out", f"{run}-dlq"
    ensure_topics(bootstrap, {topic_in: 6, topic_out: 6, topic_dlq: 1})
    logdir = Path(tempfile.mkdtemp(prefix="kwe-bench-"))
    worker = WorkerProcess(bootstrap, topic_in, topic_out, topic_dlq, run, logdir / "worker.log",
                           tuple(args.worker_arg)).start()
    # The reader must not add its own fetch wait to the end of a round.
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{run}-reader", "auto.offset.reset": "latest",
                       "enable.auto.commit": False, "fetch.wait.max.ms": 5})
    reader.subscribe([topic_out])
    try:
        worker.wait_ready(120)
        reader.consume(1, timeout=3.0)  # join before the first round publishes
        texts = [t for _, t in rows]
        kafka_round("warmup", rows[:500], bootstrap, topic_in, reader)
        offline_round(texts[:500], settings, tokenizer, backend, profile)
        results = []
        for r in range(args.rounds):
            order = ("kafka", "offline") if r % 2 == 0 else ("offline", "kafka")
            t: dict[str, float] = {}
            cpu: dict[str, float] = {}
            for which in order:
                procs = {"worker": worker.proc.pid if worker.proc else None, "broker": broker_pid,
                         "bench": os.getpid()}
                before = {k: cpu_seconds(p) for k, p in procs.items()}
                t[which] = (kafka_round(f"r{r}", rows, bootstrap, topic_in, reader) if which == "kafka"
                            else offline_round(texts, settings, tokenizer, backend, profile))
                for k, p in procs.items():
                    cpu[f"{which}_{k}_cpu_s"] = round(cpu_seconds(p) - before[k], 2)
            kw = {k: len(rows) / v for k, v in t.items()}
            results.append({"round": r, "order": list(order), "kafka_kw_s": kw["kafka"],
                            "offline_kw_s": kw["offline"], "ratio": kw["kafka"] / kw["offline"], **cpu})
            print(f"round {r}: kafka {kw['kafka']:7.0f} kw/s  offline {kw['offline']:7.0f} kw/s  "
                  f"ratio {kw['kafka'] / kw['offline']:.3f}  | kafka round CPU s: worker "
                  f"{cpu['kafka_worker_cpu_s']}, broker {cpu['kafka_broker_cpu_s']}, producer+reader "
                  f"{cpu['kafka_bench_cpu_s']}; offline round CPU s: {cpu['offline_bench_cpu_s']}", flush=True)
    finally:
        reader.close()
        worker.stop()
    ratio = quartiles([x["ratio"] for x in results])
    summary = {
        "dataset": str(args.data.name), "n": len(rows), "rounds": args.rounds, "cpu_count": os.cpu_count(),
        "backend": backend.name, "profile": profile.name, "worker_args": args.worker_arg,
        "kafka_keywords_per_s": statistics.median(x["kafka_kw_s"] for x in results),
        "offline_keywords_per_s": statistics.median(x["offline_kw_s"] for x in results),
        "ratio_kafka_over_offline": ratio, "kafka_cost": 1 - ratio["median"],
        # CPU seconds of the worker process per Kafka round over the offline round's: the part of
        # the cost that stays on the worker's machine when the broker runs elsewhere.
        "worker_cpu_over_offline_cpu": quartiles([x["kafka_worker_cpu_s"] / x["offline_bench_cpu_s"]
                                                  for x in results if x["offline_bench_cpu_s"] > 0]),
        "broker_cpu_s_per_kafka_round": statistics.median(x["kafka_broker_cpu_s"] for x in results),
        "rounds_detail": results,
    }
    print(f"kafka/offline: median {ratio['median']:.3f} (q1 {ratio['q1']:.3f}, q3 {ratio['q3']:.3f}); "
          f"Kafka costs {1 - ratio['median']:.1%} (target <= 15%); worker CPU / offline CPU: median "
          f"{summary['worker_cpu_over_offline_cpu']['median']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
