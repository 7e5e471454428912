"""Exactly-once mode against a real broker (a broker of this module's own: it is hard-restarted).

- Chaos: three members on 6 partitions, 10,000 real queries plus bad records, one member
  SIGKILLed mid-stream, another SIGTERMed and restarted, the broker hard-restarted once. A
  read_committed reader sees every ID exactly once and every bad record once on the DLQ. The
  same scenario at-least-once prints its duplicates, for comparison. The group begins above the
  log start (issue 32, finding 2): records produced and committed before the members start stand
  for earlier work, and none of them may be written (exactly-once) or be missing from the count.
- Zombie: a member stopped (SIGSTOP) past its transaction timeout while its successor (the same
  member identity, as a restarted pod) takes over is fenced when it resumes: it exits non-zero
  and nothing it wrote after the stop is visible.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from tests.conftest import KAFKA_SH
from tests.kafka_tools import TopicReader, WorkerProcess, end_offsets, load_queries, produce, produce_queries
from worker.kafka.admin import ensure_topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

QUERIES = 10_000
BAD = 30
PRIOR = 600  # processed before the test: produced, and the group's offsets committed past them


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    env = {**os.environ, "KWE_KAFKA_RUN": str(tmp_path_factory.mktemp("eos") / "broker")}
    env.pop("KAFKA_PORT", None)
    out = subprocess.run(["bash", str(KAFKA_SH), "start"], env=env, capture_output=True, text=True, check=True)
    try:
        yield out.stdout.strip().splitlines()[-1].split("=", 1)[1], env
    finally:
        subprocess.run(["bash", str(KAFKA_SH), "stop"], env=env, capture_output=True, check=False)


def bad_records(start: int, n: int) -> list[tuple[bytes, bytes]]:
    kinds = [b"{not json", orjson.dumps({"text": "no id"}), orjson.dumps({"id": "x", "text": "   "})]
    return [(f"bad-{i}".encode(), kinds[i % len(kinds)]) for i in range(start, start + n)]


class Members:
    """The group as Kubernetes runs it: a member that exits on its own is restarted (same
    identity); the ones the test kills or stops on purpose are left alone."""

    def __init__(self, bootstrap: str, names: tuple[str, str, str], group: str, tmp: Path, extra: list[str]) -> None:
        self.bootstrap, self.names, self.group, self.tmp, self.extra = bootstrap, names, group, tmp, extra
        self.extra_for: dict[str, list[str]] = {}  # one member's own arguments
        self.workers: dict[str, WorkerProcess] = {}
        self.left_alone: set[str] = set()
        self.restarts: list[tuple[str, int]] = []

    def start(self, member: str) -> WorkerProcess:
        w = WorkerProcess(self.bootstrap, *self.names, self.group, self.tmp / f"{member}.log",
                          [*self.extra, *self.extra_for.get(member, []), "--member-id", member]).start()
        self.workers[member] = w
        return w

    def tick(self) -> None:
        for member, w in list(self.workers.items()):
            assert w.proc is not None
            if member not in self.left_alone and w.proc.poll() is not None:
                self.restarts.append((member, w.proc.returncode))
                self.start(member)

    def wait(self, reader: TopicReader, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(reader.ids()) < count:
            assert time.monotonic() < deadline, f"only {len(reader.ids())} of {count} IDs after {timeout} s"
            reader.poll(0.3)
            self.tick()

    def kill_all(self) -> None:
        for w in self.workers.values():
            if w.proc and w.proc.poll() is None:
                w.kill()


def chaos(broker: tuple[str, dict[str, str]], tmp: Path, guarantee: str) -> tuple[Counter[str], Counter[tuple], Members]:
    bootstrap, env = broker
    tag = guarantee.replace("-", "")
    names = (f"kw-{tag}", f"emb-{tag}", f"dlq-{tag}")
    ensure_topics(bootstrap, {names[0]: 6, names[1]: 6, names[2]: 1})
    queries = load_queries(0, QUERIES)
    group = Members(bootstrap, names, f"g-{tag}", tmp,
                    ["--processing-guarantee", guarantee, "--intra-op-threads", "1",
                     "--transaction-timeout-ms", "20000", "--log-level", "debug"])
    # m0 is SIGKILLed and never comes back: a 10 s session (the worker's is 30 s) hands its partitions
    # on 20 s sooner, which is all the session changes here.
    group.extra_for["m0"] = ["--kafka-config", "session.timeout.ms=10000"]
    out = TopicReader(bootstrap, names[1], f"r-{tag}", isolation="read_committed")
    dlq = TopicReader(bootstrap, names[2], f"d-{tag}", isolation="read_committed")
    third = QUERIES // 3
    prior = load_queries(QUERIES, PRIOR)
    try:
        # The group begins above the log start: a reset to the log start (librdkafka's resets go to
        # auto.offset.reset, earliest) then differs from where the members began.
        produce_queries(bootstrap, names[0], prior)
        ends = end_offsets(bootstrap, names[0], 6)
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{tag}", "enable.auto.commit": False})
        c.commit(offsets=[TopicPartition(names[0], p, off) for p, off in ends.items()], asynchronous=False)
        c.close()
        produce_queries(bootstrap, names[0], queries[:third])
        produce(bootstrap, names[0], bad_records(0, BAD // 3))
        for m in ("m0", "m1", "m2"):
            group.start(m)
        for w in group.workers.values():
            w.wait_ready()
        group.wait(out, 1500, 120)
        group.left_alone.add("m0")
        group.workers["m0"].kill()  # SIGKILL mid-stream; not restarted
        produce_queries(bootstrap, names[0], queries[third:2 * third])
        produce(bootstrap, names[0], bad_records(BAD // 3, BAD // 3))
        group.wait(out, third + 1500, 150)
        group.left_alone.add("m1")
        assert group.workers["m1"].stop() == 0, group.workers["m1"].log()[-3000:]  # SIGTERM: drains, commits
        group.left_alone.discard("m1")
        group.start("m1")  # restarted with the same identity
        produce_queries(bootstrap, names[0], queries[2 * third:])
        produce(bootstrap, names[0], bad_records(2 * (BAD // 3), BAD - 2 * (BAD // 3)))
        group.wait(out, 2 * third + 500, 150)
        subprocess.run(["bash", str(KAFKA_SH), "restart", "--hard"], env=env, capture_output=True, text=True,
                       check=True)
        group.wait(out, QUERIES, 200)
        deadline = time.monotonic() + 60
        while len(dlq.records) < BAD and time.monotonic() < deadline:
            dlq.poll(0.5)
            group.tick()
        out.settle(3.0)
        dlq.settle(1.0)
        for member in ("m1", "m2"):
            assert group.workers[member].stop() == 0, group.workers[member].log()[-3000:]
    finally:
        group.kill_all()
        out.close()
        dlq.close()
    ids = out.key_counts()
    before = {q for q, _ in prior} & set(ids)
    print(f"\n{guarantee}: {len(before)} records from before the group began written again")
    if guarantee == "exactly-once":
        assert not before, f"records committed before the members began written again: {sorted(before)[:5]}"
    for q in before:
        del ids[q]
    if out.rereads:
        print(f"\n{guarantee}: the reader received {out.rereads} records twice (same partition and offset; not "
              "duplicates on the topic)")
    for key in [k for k, n in ids.items() if n > 1][:5]:
        print(f"{guarantee}: ID {key} on the output topic at (partition, offset, timestamp ms) {out.where(key)}")
    assert set(ids) == {q for q, _ in queries}, "IDs missing or unexpected on the output topic"
    bad = Counter((r.value["source"]["partition"], r.value["source"]["offset"]) for r in dlq.records)
    assert len(bad) == BAD, f"{len(bad)} distinct bad records dead-lettered, {BAD} expected"
    return ids, bad, group


def test_exactly_once_chaos_every_id_and_every_bad_record_once(broker: tuple[str, dict[str, str]],
                                                                tmp_path: Path) -> None:
    ids, bad, group = chaos(broker, tmp_path, "exactly-once")
    dups = sum(n - 1 for n in ids.values())
    print(f"\nexactly-once: {len(ids)} IDs, {dups} duplicates, {sum(bad.values()) - len(bad)} duplicate dead "
          f"letters; member restarts after exiting on their own: {group.restarts}")
    if dups:
        for member, w in group.workers.items():
            story = [line for line in w.log().splitlines()
                     if any(word in line for word in ("transaction", "revoked", "assigned", "lost", "fatal", "rewound",
                                                  "fetched again", "went back"))]
            print(f"--- {member}: rebalances and transactions\n" + "\n".join(story[-40:]))
    assert dups == 0, f"duplicates on the output topic: {[k for k, n in ids.items() if n > 1][:5]}"
    assert all(n == 1 for n in bad.values())
    committed = sum(e.get("transactions_committed") or 0 for w in group.workers.values()
                    for e in w.events("worker stopped"))
    assert committed > 0


def test_at_least_once_chaos_for_comparison(broker: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    ids, bad, group = chaos(broker, tmp_path, "at-least-once")
    dups = sum(n - 1 for n in ids.values())
    print(f"\nat-least-once: {len(ids)} IDs, {dups} duplicates, {sum(bad.values()) - len(bad)} duplicate dead "
          f"letters; member restarts after exiting on their own: {group.restarts}")


def test_a_zombie_member_is_fenced_by_its_successor_and_nothing_it_wrote_since_is_visible(
        broker: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    bootstrap, _ = broker
    names = ("kw-zombie", "emb-zombie", "dlq-zombie")
    ensure_topics(bootstrap, {names[0]: 2, names[1]: 2, names[2]: 1})
    queries = load_queries(0, 6000)
    # A 10 s session (the worker's is 30 s): the 13 s the zombie is stopped must outlive it.
    extra = ["--processing-guarantee", "exactly-once", "--intra-op-threads", "1",
             "--transaction-timeout-ms", "5000", "--member-id", "pod-0", "--kafka-config", "session.timeout.ms=10000"]
    zombie = WorkerProcess(bootstrap, *names, "g-zombie", tmp_path / "zombie.log", extra).start()
    successor = WorkerProcess(bootstrap, *names, "g-zombie", tmp_path / "successor.log", extra)
    out = TopicReader(bootstrap, names[1], "r-zombie", isolation="read_committed")
    feeding = threading.Event()

    def feed(part: list[tuple[str, str]]) -> None:
        # A stream, so the zombie is inside a transaction when it is stopped, and has records to
        # write (and so learns that it was fenced) when it resumes.
        for i in range(0, len(part), 250):
            produce_queries(bootstrap, names[0], part[i:i + 250])
            time.sleep(0.25)

    code = None
    try:
        zombie.wait_ready()
        first = threading.Thread(target=feed, args=(queries[:3000],))
        first.start()
        while len(out.ids()) < 500:
            out.poll(0.2)
            assert zombie.proc is not None and zombie.proc.poll() is None, zombie.log()[-3000:]
        zombie.signal(signal.SIGSTOP)
        time.sleep(7)  # past transaction.timeout.ms: the broker aborts its open transaction
        successor.start()  # the same identity, as a restarted pod: init_transactions fences the zombie
        successor.wait_ready()
        first.join()
        time.sleep(6)  # the zombie's session expires; the successor owns both partitions
        zombie.signal(signal.SIGCONT)
        feeding.set()
        feed(queries[3000:])
        assert zombie.proc is not None
        code = zombie.proc.wait(60)
        out.wait_for({q for q, _ in queries}, 180, alive=[successor])
        out.settle(3.0)
        assert successor.stop() == 0, successor.log()[-3000:]
    finally:
        for w in (zombie, successor):
            if w.proc and w.proc.poll() is None:
                w.signal(signal.SIGCONT)
                w.kill()
        out.close()
    assert code != 0, zombie.log()[-3000:]
    # Fenced by its successor's init_transactions on its first write, or stopped as a zombie
    # when it sees its partitions lost with a transaction the broker has timed out.
    assert any("fenced" in str(e.get("error", "")).lower() or e.get("kind") == "TransactionFencedError"
               for e in zombie.events("fatal error; the worker stops")), zombie.log()[-3000:]
    ids = Counter(r.key for r in out.records)
    assert set(ids) == {q for q, _ in queries} and max(ids.values()) == 1, \
        f"duplicates: {[k for k, n in ids.items() if n > 1][:5]}"
