"""How long a consumer group is without a coordinator when the coordinator's node is SIGKILLed.

    .venv/bin/python -m benchmarks.coordinator_outage [--kills 6] [--json PATH]

Issue 46: the worker's 10 s sessions expired before the group found its new coordinator, so every
member lost its partitions and redid its uncommitted window. This measures the gap that a session
must outlive, on the three-node cluster of the tests (`deploy/local/kafka.sh start --brokers 3`, on
127.0.0.1). One probe member per group, in six groups, one per `__consumer_offsets` partition, so
that every node coordinates some; each probe is a librdkafka consumer configured as the worker's
(classic protocol, cooperative-sticky, heartbeat 1 s) but with a 120 s session, so that it never
loses its partitions while it measures. It commits an explicit offset every 100 ms (as the worker
does) and stamps each answer; librdkafka keeps a commit refused for want of a coordinator and sends
it again when one is found, so the first confirmed commit after the kill is the moment the group
can commit and heartbeat again. A node is SIGKILLed (by pid, stamped), kept down 20 s and restarted;
the victims alternate between the active KRaft controller's node and a node that is not it (a
controller lost with the coordinator must first be replaced before anyone can fence the dead broker).

For every group the kill took the coordinator of:
- `outage_s`: from the SIGKILL to the first confirmed commit (what the group cannot do meanwhile);
- `gap_s`: from the last confirmed commit before the kill to that one (what librdkafka's session
  check measures, from the last answered heartbeat; heartbeats and commits go to the same broker);
Groups whose coordinator lived report their longest gap during the kill (`others_gap_s`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from confluent_kafka import Consumer, KafkaError, TopicPartition

from tests.cluster_tools import Cluster, java_hash_partition, start_cluster
from tests.conftest import KAFKA_SH
from worker.kafka.admin import ensure_topics

OFFSETS_PARTITIONS = 6  # offsets.topic.num.partitions of kafka.sh's cluster
COMMIT_EVERY_S = 0.1
DOWN_S = 20.0
PROBE_SESSION_MS = 120_000
# librdkafka's connection errors while a node is down: expected here, and hundreds of lines.
QUIET = logging.getLogger("coordinator_outage.librdkafka")
QUIET.setLevel(logging.CRITICAL)


@dataclass
class Probe:
    """One member of one group: commits every COMMIT_EVERY_S and stamps each answer."""

    group: str
    topic: str
    bootstrap: str
    ok: list[float] = field(default_factory=list)  # monotonic stamps of confirmed commits
    errors: list[tuple[float, str]] = field(default_factory=list)
    lost: list[float] = field(default_factory=list)
    assigned: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        def on_commit(err: KafkaError | None, parts: list[TopicPartition]) -> None:
            now = time.monotonic()
            bad = err if err is not None else next((p.error for p in parts if p.error is not None), None)
            if bad is None:
                self.ok.append(now)
            else:
                self.errors.append((now, str(bad)))

        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group,
                      "partition.assignment.strategy": "cooperative-sticky", "enable.auto.commit": False,
                      "enable.auto.offset.store": False, "session.timeout.ms": PROBE_SESSION_MS,
                      "heartbeat.interval.ms": 1000, "on_commit": on_commit, "logger": QUIET})
        c.subscribe([self.topic], on_assign=lambda cons, ps: self.assigned.set(),
                    on_lost=lambda cons, ps: self.lost.append(time.monotonic()))
        n, due = 0, 0.0
        try:
            while not self.stop.is_set():
                c.consume(num_messages=1, timeout=0.02)
                if self.assigned.is_set() and time.monotonic() >= due:
                    n += 1
                    due = time.monotonic() + COMMIT_EVERY_S
                    try:
                        c.commit(offsets=[TopicPartition(self.topic, 0, n)], asynchronous=True)
                    except Exception as exc:  # noqa: BLE001 - a refused call is a data point, not a failure
                        self.errors.append((time.monotonic(), str(exc)))
        finally:
            c.close()


def group_per_offsets_partition() -> list[str]:
    """One group name per __consumer_offsets partition: every node coordinates some."""
    names: dict[int, str] = {}
    k = 0
    while len(names) < OFFSETS_PARTITIONS:
        name = f"probe-{os.getpid()}-{k}"
        names.setdefault(java_hash_partition(name, OFFSETS_PARTITIONS), name)
        k += 1
    return [names[p] for p in sorted(names)]


def active_controller(cluster: Cluster) -> int:
    libs = subprocess.run(["bash", str(KAFKA_SH), "libs"], env=cluster.env, capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    out = subprocess.run(["java", "-Xmx128m", "-XX:TieredStopAtLevel=1", "-cp", f"{libs}/*",
                          "org.apache.kafka.tools.MetadataQuorumCommand", "--bootstrap-server",
                          cluster.bootstrap.split(",")[0], "describe", "--status"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return int(next(line.split(":", 1)[1] for line in out.splitlines() if line.startswith("LeaderId")))


def coordinators(cluster: Cluster, groups: list[str]) -> dict[str, int]:
    """Each group's coordinator (retried: a node just back answers NOT_COORDINATOR while it loads)."""
    return {g: cluster.group_coordinator(g) for g in groups}


def kill(cluster: Cluster, node: int) -> float:
    pid = int((Path(cluster.env["KWE_KAFKA_RUN"]) / f"node-{node}" / "broker.pid").read_text().strip())
    t = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return t


def one_kill(cluster: Cluster, probes: list[Probe], victim: int, controller: int) -> dict[str, object]:
    groups = [p.group for p in probes]
    before = coordinators(cluster, groups)
    hit = [p for p in probes if before[p.group] == victim]
    t_kill = kill(cluster, victim)
    back = cluster.restart(victim, hard=True, down_for=DOWN_S)
    # No admin calls while the node is down: librdkafka 2.16's admin client aborted the process
    # (rd_kafka_enq_once_del_source_return: Assertion `eonce->refcnt > 0') when describe_consumer_groups
    # timed out on a group without a coordinator.
    out, _ = back.communicate()
    assert back.returncode == 0, out
    cluster.wait_in_sync()
    time.sleep(3.0)
    after = coordinators(cluster, groups)
    rows = []
    for p in probes:
        before_ok = [t for t in p.ok if t < t_kill]
        after_ok = [t for t in p.ok if t >= t_kill]
        first = after_ok[0] if after_ok else None
        stamps = sorted(p.ok)
        window = [t for t in stamps if t_kill - 2 <= t <= t_kill + 60]
        longest = max((b - a for a, b in zip(window, window[1:])), default=None)
        rows.append({
            "group": p.group, "coordinator_before": before[p.group], "hit": p in hit,
            "outage_s": round(first - t_kill, 2) if first is not None and p in hit else None,
            "gap_s": round(first - before_ok[-1], 2) if first is not None and before_ok and p in hit else None,
            "coordinator_after": after[p.group],
            "others_gap_s": round(longest, 2) if longest is not None and p not in hit else None,
            "lost": [round(t - t_kill, 2) for t in p.lost if t >= t_kill],
            "errors": sorted({e for t, e in p.errors if t >= t_kill})[:6],
        })
    return {"victim": victim, "was_controller": victim == controller, "groups": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    run = Path(tempfile.mkdtemp(prefix="kwe-coord-")) / "run"
    gen = start_cluster(run, None)
    cluster = next(gen)
    probes: list[Probe] = []
    threads: list[threading.Thread] = []
    kills: list[dict[str, object]] = []
    try:
        topic = f"probe-in-{os.getpid()}"
        ensure_topics(cluster.bootstrap, {topic: 1})
        probes = [Probe(g, topic, cluster.bootstrap) for g in group_per_offsets_partition()]
        threads = [threading.Thread(target=p.run, name=p.group, daemon=True) for p in probes]
        for t in threads:
            t.start()
        for p in probes:
            assert p.assigned.wait(120), f"{p.group} never got its partition"
        time.sleep(3.0)
        for k in range(args.kills):
            controller = active_controller(cluster)
            led = set(coordinators(cluster, [p.group for p in probes]).values()) - {-1}
            if k % 2 == 0:
                victim = controller
            else:
                victim = next((n for n in sorted(led) if n != controller), controller)
            print(f"kill {k + 1}/{args.kills}: node {victim} (controller: {controller})", file=sys.stderr, flush=True)
            result = one_kill(cluster, probes, victim, controller)
            kills.append(result)
            for row in result["groups"]:  # type: ignore[union-attr]
                if row["hit"]:
                    print(f"  {row['group']}: outage {row['outage_s']} s, gap {row['gap_s']} s, coordinator "
                          f"{row['coordinator_before']} -> {row['coordinator_after']}, lost {row['lost']}",
                          file=sys.stderr, flush=True)
    finally:
        for p in probes:
            p.stop.set()
        for t in threads:
            t.join(30)
        try:
            next(gen)
        except StopIteration:
            pass
    hit = [r for k in kills for r in k["groups"] if r["hit"]]  # type: ignore[union-attr]

    def summary(rows: list[dict[str, object]], key: str) -> dict[str, float | int | None]:
        xs = sorted(float(r[key]) for r in rows if r[key] is not None)  # type: ignore[arg-type]
        return {"n": len(xs), "min": xs[0] if xs else None, "median": statistics.median(xs) if xs else None,
                "max": xs[-1] if xs else None}

    with_ctl = [r for k in kills if k["was_controller"] for r in k["groups"] if r["hit"]]  # type: ignore[union-attr]
    without = [r for k in kills if not k["was_controller"] for r in k["groups"] if r["hit"]]  # type: ignore[union-attr]
    report = {
        "what": "seconds a group is without a coordinator after its node is SIGKILLed (three-node KRaft cluster)",
        "command": "python -m benchmarks.coordinator_outage --kills %d" % args.kills,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "probe": {"session_timeout_ms": PROBE_SESSION_MS, "heartbeat_interval_ms": 1000,
                  "commit_every_s": COMMIT_EVERY_S, "down_s": DOWN_S},
        "gap_s": summary(hit, "gap_s"), "outage_s": summary(hit, "outage_s"),
        "gap_s_controller_killed_too": summary(with_ctl, "gap_s"),
        "gap_s_controller_alive": summary(without, "gap_s"),
        "others_gap_s": summary([r for k in kills for r in k["groups"] if not r["hit"]], "others_gap_s"),  # type: ignore[union-attr]
        "lost": sum(len(r["lost"]) for k in kills for r in k["groups"]),  # type: ignore[union-attr,misc]
        "kills": kills,
    }
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "kills"}, indent=1))


if __name__ == "__main__":
    main()
