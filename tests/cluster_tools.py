"""The three-broker cluster of tests/system/test_cluster_kafka.py and what its fault scenarios share.

- `Net`: two network namespaces of the test's own, one for the cluster and one for a worker, joined
  by a veth pair whose link the test cuts, slows (tc tbf) or makes lossy (nftables, where the kernel
  allows it); a second veth pair joins the cluster's namespace to this one (the test's producer,
  readers and the other members). The brokers listen on an address on the cluster namespace's
  loopback, so cutting a link never takes their own address away. Only these hosts and loopback.
- `Cluster`: `deploy/local/kafka.sh start --brokers 3` (in the namespace when there is one), node
  restarts, and who leads what: a partition's leader, a group's and a transactional id's coordinator.
- `Stream`: an open-loop keyword stream through a group of members, a read_committed tail that
  stamps each output's arrival, and the per-fault numbers (lost, duplicates, recovery time).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from tests.conftest import KAFKA_SH
from tests.kafka_tools import TopicReader, WorkerProcess, load_queries


class NetUnavailable(RuntimeError):
    """What this machine lacks for network namespaces (the test skips, naming it)."""


def _sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    out = subprocess.run(full, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed: {out.stderr.strip()}")
    return out


@dataclass
class Net:
    """Namespaces `<tag>c` (cluster) and `<tag>w` (worker). Addresses, with N = `octet`:
    10.N.1.1 (cluster, link to the worker) <-> 10.N.1.2 (worker); 10.N.2.1 (cluster) <-> 10.N.2.2
    (here); brokers on 10.N.3.1 (the cluster namespace's loopback), reached through 10.N.1.1 by the
    worker and through 10.N.2.1 from here."""

    tag: str
    octet: int
    made: list[str] = field(default_factory=list)
    drop_rules: bool = False

    @property
    def cluster_ns(self) -> str:
        return f"{self.tag}c"

    @property
    def worker_ns(self) -> str:
        return f"{self.tag}w"

    @property
    def broker_host(self) -> str:
        return f"10.{self.octet}.3.1"

    @property
    def worker_host(self) -> str:
        return f"10.{self.octet}.1.2"

    @property
    def cut_link(self) -> str:  # the cluster's end of the worker link
        return f"{self.tag}cw"

    @property
    def worker_link(self) -> str:  # the worker's end
        return f"{self.tag}wc"

    @classmethod
    def create(cls) -> Net:
        missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
        if missing:
            raise NetUnavailable(f"{', '.join(missing)} not on PATH (Debian: apt-get install iproute2)")
        if os.geteuid() != 0:
            raise NetUnavailable("not root: 'ip netns add' and veth links need CAP_NET_ADMIN")
        used = _sh("ip", "-4", "route", "show", check=False).stdout
        octet = next((n for n in range(200, 250) if f"10.{n}." not in used), None)
        if octet is None:
            raise NetUnavailable("no free 10.N.0.0/16 among 10.200-249 for the test's links")
        net = cls(f"kwe{os.getpid() % 100000}", octet)
        try:
            net._build()
        except Exception as exc:
            net.remove()
            raise NetUnavailable(f"network namespaces or veth links could not be made: {exc}") from exc
        return net

    def _build(self) -> None:
        n, c, w, here = self.octet, self.cluster_ns, self.worker_ns, f"{self.tag}h"
        for ns in (c, w):
            _sh("ip", "netns", "add", ns)
            self.made.append(ns)
            _sh("ip", "link", "set", "lo", "up", ns=ns)
        _sh("ip", "addr", "add", f"10.{n}.3.1/32", "dev", "lo", ns=c)
        # worker <-> cluster: the link that is cut
        _sh("ip", "link", "add", self.cut_link, "netns", c, "type", "veth", "peer", "name", self.worker_link,
            "netns", w)
        _sh("ip", "addr", "add", f"10.{n}.1.1/24", "dev", self.cut_link, ns=c)
        _sh("ip", "link", "set", self.cut_link, "up", ns=c)
        _sh("ip", "addr", "add", f"10.{n}.1.2/24", "dev", self.worker_link, ns=w)
        _sh("ip", "link", "set", self.worker_link, "up", ns=w)
        _sh("ip", "route", "add", "default", "via", f"10.{n}.1.1", ns=w)
        # here <-> cluster
        _sh("ip", "link", "add", here, "type", "veth", "peer", "name", f"{self.tag}ch", "netns", c)
        self.made.append(here)
        _sh("ip", "addr", "add", f"10.{n}.2.1/24", "dev", f"{self.tag}ch", ns=c)
        _sh("ip", "link", "set", f"{self.tag}ch", "up", ns=c)
        _sh("ip", "addr", "add", f"10.{n}.2.2/24", "dev", here)
        _sh("ip", "link", "set", here, "up")
        _sh("ip", "route", "add", f"10.{n}.1.0/24", "via", f"10.{n}.2.1")
        _sh("ip", "route", "add", f"10.{n}.3.1/32", "via", f"10.{n}.2.1")
        # The cluster namespace forwards between here and the worker (the worker's metrics port);
        # the setting is the namespace's own.
        _sh("sysctl", "-q", "-w", "net.ipv4.ip_forward=1", ns=c)

    def cut(self) -> None:
        _sh("ip", "link", "set", self.cut_link, "down", ns=self.cluster_ns)

    def restore(self) -> None:
        _sh("ip", "link", "set", self.cut_link, "up", ns=self.cluster_ns)

    def slow(self, rate: str) -> None:
        """Rate-limits what the worker sends (its outputs, commits) with a token bucket."""
        _sh("tc", "qdisc", "replace", "dev", self.worker_link, "root", "tbf", "rate", rate, "burst", "16kb",
            "latency", "300ms", ns=self.worker_ns)

    def lossy(self, percent: int) -> str | None:
        """Drops a random share of the worker's packets both ways with nftables; returns why not
        where it cannot (nft missing, or the kernel refuses the table)."""
        if shutil.which("nft") is None:
            return "nft not on PATH (Debian: apt-get install nftables)"
        rules = (f"table inet kwe_loss {{ chain inbound {{ type filter hook input priority 0; "
                 f"numgen random mod 100 < {percent} counter drop; }}; chain outbound {{ type filter hook output "
                 f"priority 0; numgen random mod 100 < {percent} counter drop; }}; }}")
        out = _sh("nft", rules, ns=self.worker_ns, check=False)
        if out.returncode != 0:
            return f"nft refused the table: {out.stderr.strip()}"
        self.drop_rules = True
        return None

    def dropped(self) -> int:
        if not self.drop_rules:
            return 0
        out = _sh("nft", "-j", "list", "table", "inet", "kwe_loss", ns=self.worker_ns, check=False)
        total = 0
        for item in orjson.loads(out.stdout or b"{}").get("nftables", []):
            for expr in item.get("rule", {}).get("expr", []):
                total += expr.get("counter", {}).get("packets", 0)
        return total

    def clear(self) -> None:
        _sh("tc", "qdisc", "del", "dev", self.worker_link, "root", ns=self.worker_ns, check=False)
        if self.drop_rules:
            _sh("nft", "delete", "table", "inet", "kwe_loss", ns=self.worker_ns, check=False)
            self.drop_rules = False

    def in_worker_ns(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.worker_ns)

    def remove(self) -> None:
        """Removes every namespace and link it made (the links inside go with their namespace;
        the routes here go with their link)."""
        for name in reversed(self.made):
            if name.endswith("h"):
                _sh("ip", "link", "del", name, check=False)
            else:
                _sh("ip", "netns", "del", name, check=False)
        self.made.clear()


def java_hash_partition(key: str, partitions: int) -> int:
    """Kafka's coordinator partition for a group or transactional id:
    Utils.abs(key.hashCode()) % partitions (Java's String.hashCode over UTF-16 units)."""
    h = 0
    units = key.encode("utf-16-be")
    for i in range(0, len(units), 2):
        h = (31 * h + int.from_bytes(units[i:i + 2], "big")) & 0xFFFFFFFF
    signed = h - (1 << 32) if h >= 1 << 31 else h
    return 0 if signed == -(1 << 31) else abs(signed) % partitions


@dataclass
class Cluster:
    bootstrap: str
    env: dict[str, str]
    net: Net | None

    def kafka_sh(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(KAFKA_SH), *args], env=self.env, capture_output=True, text=True)

    def restart(self, node: int, *, hard: bool = False, down_for: float = 0.0) -> subprocess.Popen[str]:
        """Starts `kafka.sh restart --node N` and returns at once; the node is back when it exits."""
        args = ["restart", "--node", str(node), *(["--hard"] if hard else []), "--down-for", f"{down_for:g}"]
        return subprocess.Popen(["bash", str(KAFKA_SH), *args], env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def restart_now(self, node: int, *, hard: bool = False, down_for: float = 0.0) -> None:
        p = self.restart(node, hard=hard, down_for=down_for)
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out

    def freeze(self, node: int, frozen: bool = True) -> None:
        """SIGSTOP (or SIGCONT) a node's broker process: its connections stay open and nothing on
        them is answered, as with a node that hangs (the controller fences it after
        broker.session.timeout.ms; requests already sent to it wait for their own timeout)."""
        pid = int((Path(self.env["KWE_KAFKA_RUN"]) / f"node-{node}" / "broker.pid").read_text().strip())
        os.kill(pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    @functools.cached_property
    def _admin(self) -> AdminClient:
        return AdminClient({"bootstrap.servers": self.bootstrap})

    def admin(self) -> AdminClient:
        """One client for the cluster's life: a future outlives only the client that made it."""
        return self._admin

    def leader(self, topic: str, partition: int) -> int:
        md = self.admin().list_topics(topic=topic, timeout=20)
        return int(md.topics[topic].partitions[partition].leader)

    def replicas(self, topic: str) -> dict[int, list[int]]:
        """Each partition's replicas, once the brokers' metadata has the topic (a topic just created
        reaches each broker's metadata cache a moment later)."""
        deadline = time.monotonic() + 30
        while True:
            tm = self.admin().list_topics(topic=topic, timeout=20).topics[topic]
            if tm.error is None and tm.partitions or time.monotonic() > deadline:
                return {p: list(m.replicas) for p, m in tm.partitions.items()}
            time.sleep(0.5)

    def group_coordinator(self, group: str) -> int:
        """The group's coordinator, by describe_consumer_groups (retried for 60 s: a fresh cluster answers
        NOT_COORDINATOR until its offsets topic exists, a restarted node while it loads the group)."""
        from confluent_kafka import KafkaException

        deadline = time.monotonic() + 60
        while True:
            # A client of its own each time: after node restarts the long-lived one's describe timed out
            # twice in a row (20 s each) while the cluster answered everyone else.
            admin = AdminClient({"bootstrap.servers": self.bootstrap})
            try:
                desc = admin.describe_consumer_groups([group], request_timeout=10)[group].result(15)
                return int(desc.coordinator.id)
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def tag_coordinated_by(self, node: int, prefix: str) -> str:
        """A stream tag whose group (g-<tag>) the node coordinates, asked with describe_consumer_groups
        (a group that does not exist yet has its coordinator too): two streams' groups on one node
        lose their coordinator to one kill."""
        for k in range(200):
            tag = f"{prefix}{time.monotonic_ns() % 10**6}{k}"
            if self.group_coordinator(f"g-{tag}") == node:
                return tag
        raise AssertionError(f"no group id coordinated by node {node} in 200 tries")

    def transaction_coordinator(self, transactional_id: str) -> int:
        """The leader of the transactional id's __transaction_state partition (what FindCoordinator
        answers; confluent-kafka's admin client has no describe-transactions)."""
        md = self.admin().list_topics(topic="__transaction_state", timeout=20)
        parts = md.topics["__transaction_state"].partitions
        return int(parts[java_hash_partition(transactional_id, len(parts))].leader)

    def wait_in_sync(self, timeout: float = 120.0) -> None:
        """Until every partition has all its replicas in sync (an operator's gate between the steps
        of a rolling restart)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                md = self.admin().list_topics(timeout=10)
                behind = [f"{t}/{p}" for t, tm in md.topics.items() for p, pm in tm.partitions.items()
                          if set(pm.isrs) != set(pm.replicas)]
            except Exception as exc:  # noqa: BLE001 - a node still starting answers errors for a moment
                behind = [str(exc)]
            if not behind:
                return
            assert time.monotonic() < deadline, f"partitions not in sync after {timeout} s: {behind[:5]}"
            time.sleep(1.0)


def start_cluster(run: Path, net: Net | None) -> Iterator[Cluster]:
    env = {**os.environ, "KWE_KAFKA_RUN": str(run)}
    for key in ("KAFKA_PORT", "KAFKA_HEAP_OPTS", "KWE_KAFKA_NETNS", "KAFKA_HOST"):
        env.pop(key, None)
    if net is not None:
        env.update(KWE_KAFKA_NETNS=net.cluster_ns, KAFKA_HOST=net.broker_host)
    try:
        out = subprocess.run(["bash", str(KAFKA_SH), "start", "--brokers", "3"], env=env, capture_output=True,
                             text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        line = out.stdout.strip().splitlines()[-1]
        assert line.startswith("KAFKA_BOOTSTRAP_SERVERS="), out.stdout + out.stderr
        yield Cluster(line.split("=", 1)[1], env, net)
    finally:
        subprocess.run(["bash", str(KAFKA_SH), "stop"], env=env, capture_output=True, check=False)


@dataclass
class FaultResult:
    name: str
    start: float
    end: float
    since: float | None = None  # where its stretch of the stream begins (a backlog queued for it); None: start
    backlog: int = 0  # IDs queued at once for it, on top of the open-loop rate
    lost_partitions: int = 0  # "partitions lost" events of the stream's members during the fault
    recovery_goal_s: float | None = None  # the test's bound on recovery_s, where this fault has its own
    baseline: float = 0.0  # outputs/s in the BASELINE_S before the fault
    # from the fault's end until a RECOVERY_WINDOW_S window runs at >= 80% (under a backlog: or the
    # backlog queued before the fault's end is all out)
    recovery_s: float | None = None
    lowest: float = 0.0  # the slowest RECOVERY_WINDOW_S window from the fault's start to its recovery, outputs/s
    ids: int = 0  # IDs sent from this fault's segment (its start to the next fault's start)
    lost: int = 0
    duplicates: int = 0
    note: str = ""

    def line(self, guarantee: str, stream_ids: int) -> str:
        rec = "never" if self.recovery_s is None else f"{self.recovery_s:.1f} s"
        backlog = f" | backlog {self.backlog}, partitions lost {self.lost_partitions}" if self.backlog else ""
        return (f"{guarantee:<13} | {self.name:<44} | lost {self.lost} | duplicates {self.duplicates} "
                f"({100 * self.duplicates / max(stream_ids, 1):.2f}% of {stream_ids}) | fault {self.end - self.start:.1f} s"
                f" | before {self.baseline:.0f}/s, lowest {self.lowest:.0f}/s | recovery {rec}{backlog}"
                f"{' | ' + self.note if self.note else ''}")


BASELINE_S = 8.0
RECOVERY_WINDOW_S = 4.0


class Stream:
    """An open-loop stream of `rate` keywords/s (unique IDs, real query texts) into a 6-partition
    input topic, a group of worker members, and a read_committed tail of the output topic that
    stamps each record's arrival. `fault()` waits until the group has caught up, measures the rate
    before, runs the fault and records its window; `finish()` stops the load, waits for every ID
    and stops the members (each must exit 0)."""

    def __init__(self, cluster: Cluster, tag: str, guarantee: str, tmp: Path, *, rate: float,
                 extra: Sequence[str] = ()) -> None:
        from worker.kafka.admin import ensure_topics

        self.cluster, self.tag, self.guarantee, self.tmp, self.rate = cluster, tag, guarantee, tmp, rate
        self.topics = (f"kw-{tag}", f"emb-{tag}", f"dlq-{tag}")
        ensure_topics(cluster.bootstrap, {self.topics[0]: 6, self.topics[1]: 6, self.topics[2]: 1})
        self.extra = ["--processing-guarantee", guarantee, "--intra-op-threads", "1", "--dispatchers", "1",
                      "--output-encoding", "base64-f16", "--stall-timeout-s", "60", *extra]
        self.group = f"g-{tag}"
        self.members: dict[str, WorkerProcess] = {}
        self.leaving: set[str] = set()  # members stopped on purpose
        self.sent: list[tuple[str, float]] = []
        self.arrivals: list[tuple[str, float]] = []
        self.faults: list[FaultResult] = []
        self.fault_running: str | None = None
        self.failed_deliveries: list[str] = []
        self._burst = 0  # IDs queued at once on top of the rate (a backlog); written by burst(), read by the feed
        self._stop = threading.Event()  # the load stops
        self._done = threading.Event()  # the tail stops
        self._texts = [t for _, t in load_queries()]
        self._reader = TopicReader(cluster.bootstrap, self.topics[1], f"r-{tag}", isolation="read_committed")
        self._threads = [threading.Thread(target=self._feed, name=f"feed-{tag}", daemon=True),
                         threading.Thread(target=self._tail, name=f"tail-{tag}", daemon=True)]

    # -- members
    def member(self, name: str, *, prefix: Sequence[str] = (), host: str = "127.0.0.1",
               extra: Sequence[str] = ()) -> WorkerProcess:
        w = WorkerProcess(self.cluster.bootstrap, *self.topics, self.group, self.tmp / f"{self.tag}-{name}.log",
                          [*self.extra, "--member-id", name, *extra], prefix=prefix, host=host).start()
        self.members[name] = w
        return w

    def leave(self, name: str) -> None:
        """SIGTERM on purpose: a member leaving the group; it must exit 0."""
        self.leaving.add(name)
        code = self.members[name].stop()
        assert code == 0, f"{name} exited {code} when asked to leave:\n{self.members[name].log()[-3000:]}"

    def check_members(self) -> None:
        """A member that exits on its own fails the test, in both guarantees. (Exactly-once members
        used to exit when a coordinator's node was SIGKILLed and a transactional call hung inside
        librdkafka, issues 5456 and 5511; a new producer now takes over in the process:
        worker/ledger/exactly_once/transactions.py `take_over`, counted by `take_overs`.)"""
        for name, w in list(self.members.items()):
            assert w.proc is not None
            if name in self.leaving or w.proc.poll() is None:
                continue
            raise AssertionError(f"member {name} exited on its own ({w.proc.returncode}) in "
                                 f"{self.guarantee}:\n{w.log()[-4000:]}")

    def take_overs(self) -> list[str]:
        """Each exactly-once take-over of a hung or fenced producer, as '<member>: <partitions rewound>'."""
        return [f"{name}: {e.get('partitions')} ({e.get('reason', 'hung')}; hung commit landed for "
                f"{e.get('hung_commit_landed_for')})"
                for name, w in self.members.items()
                for e in w.events("a new producer took over; partitions rewound to their committed offsets")]

    def transactional_id(self, member: str) -> str:
        from worker.kafka.client_config import transactional_id

        return transactional_id(self.group, member)

    # -- load and tail
    def start(self) -> None:
        for w in self.members.values():
            w.wait_ready(180)
        for t in self._threads:
            t.start()

    def _feed(self) -> None:
        def delivered(err: object, msg: object) -> None:
            if err is not None:
                self.failed_deliveries.append(str(err))

        p = Producer({"bootstrap.servers": self.cluster.bootstrap, "enable.idempotence": True, "linger.ms": 20,
                      "message.timeout.ms": 900000})
        t0, i = time.monotonic(), 0
        while not self._stop.is_set():
            due = int((time.monotonic() - t0) * self.rate) + self._burst
            while i < due:
                qid = f"{self.tag}-{i:06d}"
                value = orjson.dumps({"id": qid, "text": self._texts[i % len(self._texts)]})
                try:
                    p.produce(self.topics[0], key=qid.encode(), value=value, on_delivery=delivered)
                except BufferError:
                    break
                self.sent.append((qid, time.monotonic()))
                i += 1
            p.poll(0.05)
        left = p.flush(300)
        if left:
            self.failed_deliveries.append(f"{left} input records not delivered at the end")

    def _tail(self) -> None:
        """Stamps each output record's first arrival. A record read again at the same partition
        and offset is one record, not a duplicate: the reader itself re-reads when its own group
        rebalances during a fault (no committed offsets: it starts over from the earliest) or its
        fetch position is reset. A duplicate is a second record with the same ID."""
        seen = 0
        where: set[tuple[int, int]] = set()
        while not self._done.is_set():
            self._reader.poll(0.3)
            now = time.monotonic()
            fresh = self._reader.records[seen:]
            seen += len(fresh)
            for r in fresh:
                if (r.partition, r.offset) not in where:
                    where.add((r.partition, r.offset))
                    self.arrivals.append((r.key or "", now))

    def burst(self, n: int) -> None:
        """Queues n more IDs at once (a backlog the members drain at their own pace)."""
        self._burst += n

    def lost_partitions(self) -> int:
        """'partitions lost' events so far, all members: a session that expired, a member fenced."""
        return sum(len(w.events("partitions lost")) for w in self.members.values())

    def arrived(self) -> set[str]:
        return {k for k, _ in list(self.arrivals)}

    def wait_caught_up(self, timeout: float = 120.0, lag_s: float = 2.0) -> None:
        """Until every ID sent more than lag_s ago has arrived (with a transaction interval's
        visibility delay in exactly-once)."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_members()
            cut = time.monotonic() - lag_s
            want = {q for q, t in list(self.sent) if t < cut}
            missing = want - self.arrived()
            if not missing:
                return
            assert time.monotonic() < deadline, (f"{self.guarantee}: {len(missing)} IDs not arrived after "
                                                 f"{timeout} s, e.g. {sorted(missing)[:3]}")
            time.sleep(0.5)

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.check_members()
            time.sleep(0.25)

    def finish(self) -> None:
        """After the last fault: long enough to see its recovery, then every ID and a clean stop."""
        self.wait_caught_up(timeout=180)
        self.sleep(RECOVERY_WINDOW_S + 4)
        self._stop.set()
        self._threads[0].join(320)
        want = {q for q, _ in self.sent}
        deadline = time.monotonic() + 180
        while want - self.arrived():
            self.check_members()
            assert time.monotonic() < deadline, f"{len(want - self.arrived())} IDs never arrived"
            time.sleep(0.5)
        time.sleep(3.0)  # late duplicates
        self._done.set()
        self._threads[1].join(30)
        for name, w in self.members.items():
            if name not in self.leaving:
                code = w.stop()
                assert code == 0, f"{name} exited {code} on SIGTERM:\n{w.log()[-3000:]}"

    def close(self) -> None:
        self._stop.set()
        self._done.set()
        for t in self._threads:
            if t.is_alive():
                t.join(30)
        for w in self.members.values():
            if w.proc and w.proc.poll() is None:
                w.kill()
        self._reader.close()

    # -- numbers
    def measure(self) -> list[FaultResult]:
        times = sorted(t for _, t in self.arrivals)

        def rate(a: float, b: float) -> float:
            import bisect
            return (bisect.bisect_left(times, b) - bisect.bisect_left(times, a)) / (b - a)

        counts = Counter(k for k, _ in self.arrivals)
        first: dict[str, float] = {}
        for k, at in self.arrivals:
            first.setdefault(k, at)
        starts = [f.start if f.since is None else f.since for f in self.faults] + [float("inf")]
        for i, f in enumerate(self.faults):
            before = f.start - BASELINE_S if not f.backlog or f.since is None else f.since
            f.baseline = rate(before, f.start) if f.start > before else 0.0
            # Under a backlog the rate before is the members' full speed, and it comes back only while
            # the backlog lasts: the fault has recovered too once everything queued before its end is out.
            drained = float("inf")
            if f.backlog:
                queued = [first.get(q, float("inf")) for q, ts in self.sent if starts[i] <= ts < f.end]
                drained = max(queued, default=f.end)
            t = f.end
            f.recovery_s = None
            while t + RECOVERY_WINDOW_S <= (times[-1] if times else 0):
                if rate(t, t + RECOVERY_WINDOW_S) >= 0.8 * f.baseline or t >= drained:
                    f.recovery_s = t - f.end
                    break
                t += 0.25
            top = f.end + (f.recovery_s or 0.0)
            windows = [rate(a, a + RECOVERY_WINDOW_S) for a in
                       (f.start + k * 0.5 for k in range(int(max(0.0, top - f.start) / 0.5) + 1))]
            f.lowest = min(windows) if windows else 0.0
            lo = -float("inf") if i == 0 else starts[i]
            segment = [q for q, ts in self.sent if lo <= ts < starts[i + 1]]
            f.ids = len(segment)
            f.lost = sum(1 for q in segment if counts[q] == 0)
            f.duplicates = sum(counts[q] - 1 for q in segment if counts[q] > 1)
        return self.faults

    def report(self) -> str:
        ids = len(self.sent)
        counts = Counter(k for k, _ in self.arrivals)
        dups = sorted(k for k, n in counts.items() if n > 1)
        lines = [f.line(self.guarantee, ids) for f in self.measure()]
        lines.append(f"{self.guarantee:<13} | stream: {ids} IDs at {self.rate:g}/s, {len(counts)} arrived, "
                     f"{sum(counts.values()) - len(counts)} duplicates{(' e.g. ' + ', '.join(dups[:5])) if dups else ''}"
                     f"; the reader read {self._reader.rereads} records again (same offsets, not counted)")
        # Where both copies of a duplicate sit (partition@offset): the lead to which write repeated it.
        lines += [f"{self.guarantee:<13} | {q}: " + ", ".join(f"p{p}@{o}" for p, o, _ in self._reader.where(q))
                  for q in dups[:5]]
        lines += [f"{self.guarantee:<13} | a new producer took over in {t}" for t in self.take_overs()]
        text = "\n".join(lines)
        path = os.environ.get("KWE_CLUSTER_REPORT")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(text + "\n")
        return text


def fault(streams: Sequence[Stream], name: str, action: Callable[[], str | None], *, backlog: int = 0,
          recovery_goal_s: float | None = None) -> None:
    """One fault under every stream at once: each has caught up and run BASELINE_S at its rate
    before it; the fault's window is the action's (from the first kill to the last node back).

    `backlog`: that many IDs are queued at once in each stream once it has caught up, and the fault
    comes once a quarter of them are out in every stream (not BASELINE_S later: with repeated texts
    answered by the cache a stream drained 20,000 in about 10 s), so it lands with three quarters
    still queued, every member's in-flight window full and its commit point trailing by that window
    (at the open-loop rate the window is nearly empty, and a fault that loses it costs a handful of
    duplicates however it is handled). Its rate before is measured from the backlog's start."""
    for st in streams:
        st.wait_caught_up()
    since = time.monotonic()
    lost_before = [st.lost_partitions() for st in streams]
    end = time.monotonic() + BASELINE_S
    if backlog:
        seen = [len(st.arrivals) for st in streams]
        for st in streams:
            st.burst(backlog)
        deadline = time.monotonic() + 120
        while any(len(st.arrivals) < n + backlog // 4 for st, n in zip(streams, seen)):
            for st in streams:
                st.check_members()
            assert time.monotonic() < deadline, "a quarter of the backlog was not out within 120 s"
            time.sleep(0.1)
        end = time.monotonic()
    while time.monotonic() < end:
        for st in streams:
            st.check_members()
        time.sleep(0.25)
    start = time.monotonic()
    for st in streams:
        st.fault_running = name
    note = action() or ""
    stop = time.monotonic()
    for st, before in zip(streams, lost_before):
        st.faults.append(FaultResult(name, start, stop, since=since if backlog else None, backlog=backlog,
                                     lost_partitions=st.lost_partitions() - before,
                                     recovery_goal_s=recovery_goal_s, note=note))
        st.check_members()
        st.fault_running = None
