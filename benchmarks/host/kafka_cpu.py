"""The worker process's CPU per keyword through the real broker, with the model taken out and with
it, paired: how much of a keyword's cost is the worker's own (intake, batching, output, delivery,
librdkafka's threads) and how much the model's.

    deploy/local/with-kafka.sh .venv/bin/python -m benchmarks.host.kafka_cpu --rounds 4 \
        --sides null model null@/tmp/kwe-base --json benchmarks/results/host/kafka_cpu.json

Sides: `null` (benchmarks/host/null_worker.py: unit vectors, no compute), `model` (the real worker,
`--backend` as given, default onnxruntime), each optionally `@ROOT` for another checkout (a
baseline). Each side is one worker process with the default settings and the embedding cache off
(every keyword is tokenized, batched and encoded), its own topics (6 partitions) and group. A round
publishes N keywords to each side in turn (the order rotates) and reads every embedding back; the
side's CPU is its process's user + system time from /proc over that span, divided by N, and how
it splits by thread (`thread_seconds`: the main thread that polls, each of the worker's named
threads, librdkafka's `rdk:*`). Paired
per round: on a shared, noisy box only same-round ratios mean anything.

By default the worker runs while the round is published, as a live stream: its polls bring what
arrived since the last one. With --backlog the worker is stopped (SIGSTOP) while the round is
published and measured from its SIGCONT: a backlog, polls of up to 500 records.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient

from benchmarks.host.pipeline_bench import DEFAULT_DATA, paired_ratios, quartiles, runner_dir
from benchmarks.kafka_vs_offline import BROKER_PID, cpu_seconds, kafka_bootstrap_from_env, kafka_round, stat_cpu_seconds
from tests.kafka_tools import free_port
from worker.formats.keyword_files import read_keywords
from worker.kafka.admin import ensure_topics

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Side:
    name: str
    kind: str  # "null" or "model"
    root: Path
    backend: str
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    port: int = field(default_factory=free_port)
    topics: tuple[str, str, str] = ("", "", "")
    reader: Any = None
    bootstrap: str = ""

    def start(self, bootstrap: str, runner: Path, logdir: Path) -> None:
        run = f"cpu-{self.kind}-{uuid.uuid4().hex[:6]}"
        self.topics, self.bootstrap = (f"{run}-in", f"{run}-out", f"{run}-dlq"), bootstrap
        ensure_topics(bootstrap, {self.topics[0]: 6, self.topics[1]: 6, self.topics[2]: 1})
        where = ["--bootstrap-servers", bootstrap, "--input-topic", self.topics[0], "--output-topic", self.topics[1],
                 "--group-id", run, "--metrics-port", str(self.port), "--metrics-host", "127.0.0.1"]
        if self.kind.startswith("relay"):
            cmd = [sys.executable, "-m", "kwe_host.kafka_relay", "run", *where,
                   *(["--batch"] if self.kind == "relay-batch" else []),
                   *(["--headers"] if self.kind == "relay-headers" else [])]
        else:
            module = "kwe_host.null_worker" if self.kind == "null" else "worker.cli"
            cmd = [sys.executable, "-m", module, "run", *where, "--dead-letter-topic", self.topics[2],
                   "--log-format", "json", "--backend", "onnxruntime" if self.kind == "null" else self.backend,
                   "--cache-bytes", "0", *self.extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KWE_")}
        env["PYTHONPATH"] = str(runner)
        log = (logdir / f"{run}.log").open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.root, env=env)
        log.close()
        self.reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{run}-reader",
                                "auto.offset.reset": "earliest", "enable.auto.commit": False,
                                "fetch.wait.max.ms": 5})
        self.reader.subscribe([self.topics[1]])

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name}: worker exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"{self.name}: not ready after {timeout} s")

    def stop(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.bootstrap:
            # Rounds of 200,000 static-model vectors leave gigabytes a side: runs kept in the broker
            # filled a 70 GB disk in one day (2026-12-07).
            admin = AdminClient({"bootstrap.servers": self.bootstrap})  # held until the futures answer
            for done in admin.delete_topics(list(self.topics), operation_timeout=30).values():
                done.result(30)


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of the process's threads by what they are, from /proc: the main thread (which
    polls the consumer), the worker's named threads (kwe-output, kwe-delivery, kwe-bucket-form,
    kwe-dispatch-N together; worker/core/os_threads.py), librdkafka's (rdk:main,
    rdk:broker<N>, ...: `librdkafka`), and `other` (threads without a name of their own, such as a
    checkout's from before the names)."""
    groups: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            comm = (task / "comm").read_text().strip()
            seconds = stat_cpu_seconds(task / "stat")
        except OSError:
            continue  # a thread that ended meanwhile
        if task.name == str(pid):
            group = "main"
        elif comm.startswith("rdk:"):
            group = "librdkafka"
        elif comm.startswith("kwe-dispatch"):
            group = "kwe-dispatch"
        elif comm.startswith("kwe-"):
            group = comm
        else:
            group = "other"
        groups[group] = groups.get(group, 0.0) + seconds
    return groups


def poll_thread_cpus(pid: int) -> str:
    """The CPUs the worker's poll (main) thread may run on now, as the kernel lists them ("1", "0-1")."""
    try:
        with open(f"/proc/{pid}/task/{pid}/status", encoding="ascii") as f:
            return next((line.split()[1] for line in f if line.startswith("Cpus_allowed_list:")), "")
    except OSError:
        return ""


def parse_side(spec: str, backend: str) -> Side:
    """`KIND[@ROOT][#FLAGS]`: FLAGS are extra `run` flags of this side only (space-separated)."""
    spec, _, flags = spec.partition("#")
    kind, _, root = spec.partition("@")
    if kind not in ("null", "model", "relay", "relay-batch", "relay-headers"):
        raise SystemExit(f"side {spec!r}: null, model, relay, relay-batch or relay-headers, optionally @ROOT")
    name = f"{spec}#{flags}" if flags else spec
    return Side(name, kind, Path(root).resolve() if root else ROOT, backend, flags.split())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", nargs="+", default=["null", "model"])
    ap.add_argument("--backend", default="onnxruntime", help="the model side's backend")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("-n", "--n", type=int, default=8000, help="keywords per side and round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--worker-args", default="", help="extra `run` flags for every side (one string)")
    ap.add_argument("--backlog", action="store_true",
                    help="publish each round while the worker is stopped, then measure it working the backlog")
    ap.add_argument("--neighbour", type=int, default=None, metavar="CPU",
                    help="once every side is ready, a process spinning on this CPU for the rest of the run "
                         "(another pod taking it: where does each side's poll thread go?)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bootstrap = kafka_bootstrap_from_env()
    rows = list(read_keywords(args.data))
    sides = [parse_side(s, args.backend) for s in args.sides]
    for side in sides:
        side.extra = args.worker_args.split() + side.extra
    broker_pid = int(BROKER_PID.read_text()) if BROKER_PID.is_file() else None
    logdir = Path(tempfile.mkdtemp(prefix="kwe-kafka-cpu-"))
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        runner = runner_dir(Path(tmp))
        for name in ("null_worker.py", "kafka_relay.py"):
            shutil.copy(Path(__file__).with_name(name), runner / "kwe_host" / name)
        neighbour = None
        try:
            for side in sides:
                side.start(bootstrap, runner, logdir)
            for side in sides:
                side.wait_ready()
                side.reader.consume(1, timeout=3.0)
                kafka_round(f"warm-{side.name}", rows[:1000], bootstrap, side.topics[0], side.reader)
            if args.neighbour is not None:
                spin = f"import os\nos.sched_setaffinity(0, {{{args.neighbour}}})\nwhile True: pass"
                neighbour = subprocess.Popen([sys.executable, "-c", spin])
            at = 0
            for r in range(args.rounds):
                order = sides[r % len(sides):] + sides[:r % len(sides)]
                got: dict[str, Any] = {}
                for side in order:
                    # Past the end of the data the rows come round again: a pass number keeps every
                    # ID unique, or the round would end at the first pass's last embedding.
                    batch = []
                    for i in range(at, at + args.n):
                        qid, text = rows[i % len(rows)]
                        batch.append((f"{qid}.{i // len(rows)}", text))
                    at += args.n
                    assert side.proc is not None
                    proc = side.proc
                    marks: dict[str, Any] = {}

                    def mark() -> None:
                        marks["cpu"], marks["threads"] = cpu_seconds(proc.pid), thread_seconds(proc.pid)
                        marks["broker"] = cpu_seconds(broker_pid)

                    def resume() -> None:
                        mark()
                        proc.send_signal(signal.SIGCONT)

                    if args.backlog:
                        proc.send_signal(signal.SIGSTOP)
                    else:
                        mark()
                    try:
                        wall = kafka_round(f"r{r}-{side.name}", batch, bootstrap, side.topics[0], side.reader,
                                           published=resume if args.backlog else None)
                    finally:
                        proc.send_signal(signal.SIGCONT)
                    cpu, broker = cpu_seconds(proc.pid) - marks["cpu"], cpu_seconds(broker_pid) - marks["broker"]
                    # A thread that ended during the round (a helper) is left out of the split, not of `cpu`.
                    threads = {k: (v - marks["threads"].get(k, 0.0)) * 1e6 / args.n
                               for k, v in thread_seconds(proc.pid).items()}
                    rdk = threads.get("librdkafka", 0.0)
                    got[side.name] = {"keywords_per_s": args.n / wall, "worker_cpu_us_per_keyword": cpu * 1e6 / args.n,
                                      "librdkafka_cpu_us_per_keyword": rdk,
                                      "broker_cpu_us_per_keyword": broker * 1e6 / args.n,
                                      "thread_cpu_us_per_keyword": threads,
                                      "poll_thread_cpus": poll_thread_cpus(proc.pid)}
                results.append({"round": r, "order": [s.name for s in order], "sides": got})
                print(f"round {r}: " + "  ".join(f"{k}: {v['keywords_per_s']:6.0f} kw/s worker "
                                                  f"{v['worker_cpu_us_per_keyword']:6.1f} us/kw "
                                                  f"(librdkafka {v['librdkafka_cpu_us_per_keyword']:4.1f}; "
                                                  f"poll thread on {v['poll_thread_cpus']})"
                                                  for k, v in got.items()), flush=True)
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
            for side in sides:
                side.stop()
    summary: dict[str, Any] = {"data": args.data.name, "n": args.n, "rounds_run": len(results),
                               "cpu_count": os.cpu_count(), "worker_args": args.worker_args,
                               "regime": "backlog" if args.backlog else "live", "neighbour_cpu": args.neighbour,
                               "sides": {},
                               "ratios": {}}
    for side in sides:
        per = [x["sides"][side.name] for x in results]
        summary["sides"][side.name] = {k: quartiles([p[k] for p in per]) for k in per[0]
                                       if k not in ("thread_cpu_us_per_keyword", "poll_thread_cpus")}
        groups = sorted({g for p in per for g in p["thread_cpu_us_per_keyword"]})
        by_thread = {g: quartiles([p["thread_cpu_us_per_keyword"].get(g, 0.0) for p in per]) for g in groups}
        summary["sides"][side.name]["thread_cpu_us_per_keyword"] = by_thread
        c = summary["sides"][side.name]["worker_cpu_us_per_keyword"]
        split = ", ".join(f"{g} {q['median']:.1f}" for g, q in sorted(by_thread.items(), key=lambda x: -x[1]["median"]))
        print(f"{side.name}: worker {c['median']:.1f} us/keyword ({c['q1']:.1f}-{c['q3']:.1f}); by thread: {split}")
    first = sides[0].name
    for side in sides[1:]:
        for key, label, what in (("worker_cpu_us_per_keyword", "worker_cpu", "worker CPU per keyword"),
                                 ("keywords_per_s", "keywords_per_s", "keywords/s")):
            q = paired_ratios(results, side.name, first, key)
            summary["ratios"][f"{side.name}/{first} {label}"] = q
            balanced = f"; order-balanced {q['balanced']:.3f}" if "balanced" in q else ""
            print(f"{side.name}/{first} {what}: median {q['median']:.3f} (q1 {q['q1']:.3f}, q3 {q['q3']:.3f}){balanced}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**summary, "rounds": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
