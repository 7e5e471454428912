"""`keyword-embedder backfill` against the real broker, as a process, the way a team runs it.

- A topic that keeps receiving records during the backfill: the output holds exactly the records
  present at its start (by partition and offset, read back from the input), none after; exit 0; with
  exactly-once (and an input written in transactions, so the ends fall after commit markers) each
  of them once.
- SIGTERM a third of the way (exit 130, what is left said), SIGKILL two thirds of the way, more
  records arrive, then the same command again: each run resumes where the group committed (nothing
  finished is redone), keeps the range captured first, and the last completes it with nothing lost.
- `--max-rate R` holds the output rate within 10% of R.
- The groups' offsets without the admin client (worker/backfill/group_offsets.py): a consumer that
  never joins reads and commits them, metadata included; a commit to a group with a member is
  refused until the member leaves, and the wait for it is bounded.

A few thousand keywords, and the rate check at 200/s for 6 s: about 60 s on a 2-core box, most of it
the six process starts (the model and its backend load each time).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer, Producer

from tests.kafka_tools import ROOT, TopicReader, committed_offsets, load_queries, produce_queries
from worker.backfill.cluster_calls import GroupBusyError, Retry
from worker.backfill.group_offsets import GroupOffsets

pytestmark = pytest.mark.kafka

PARTITIONS = 3


class Backfill:
    """One `keyword-embedder backfill` process; its JSON log and its stdout (the summary) in files."""

    def __init__(self, bootstrap: str, topics: tuple[str, str, str], tmp: Path, extra: Sequence[str] = ()) -> None:
        self.bootstrap, self.topics, self.tmp, self.extra = bootstrap, topics, tmp, list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def start(self) -> Backfill:
        inp, out, dlq = self.topics
        self.runs += 1
        cmd = [sys.executable, "-m", "worker.cli", "backfill", "--bootstrap-servers", self.bootstrap,
               "--input-topic", inp, "--output-topic", out, "--dead-letter-topic", dlq, "--backend", "onnxruntime",
               "--log-format", "json", "--no-progress", *self.extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KWE_")}
        with (self.tmp / f"log{self.runs}").open("wb") as log, (self.tmp / f"out{self.runs}").open("wb") as out_:
            self.proc = subprocess.Popen(cmd, stdout=out_, stderr=log, cwd=ROOT, env=env)
        return self

    def wait(self, timeout: float = 180.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"backfill did not end within {timeout} s:\n{self.log()[-3000:]}") from None

    def log(self) -> str:
        return (self.tmp / f"log{self.runs}").read_text(errors="replace")

    def summary(self) -> str:
        return (self.tmp / f"out{self.runs}").read_text(errors="replace")

    def event(self, name: str) -> dict[str, Any]:
        for line in self.log().splitlines():
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict) and obj.get("event") == name:
                return obj
        raise AssertionError(f"no {name!r} in the log:\n{self.log()[-3000:]}")


@contextmanager
def trickle(bootstrap: str, topic: str, per_s: float, *, transactional: bool = False) -> Iterator[list[str]]:
    """Keeps producing keywords (IDs late-N) until the block ends: a topic the live group still feeds.
    `transactional`: an upstream exactly-once producer, five records a transaction, so the partitions'
    ends (last stable offsets) fall just after commit markers."""
    sent: list[str] = []
    stop = threading.Event()
    texts = [text for _, text in load_queries(5000, 500)]

    def feed() -> None:
        config = {"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True}
        if transactional:
            config["transactional.id"] = f"trickle-{uuid.uuid4().hex[:8]}"
        p = Producer(config)
        if transactional:
            p.init_transactions(30)
        while not stop.is_set():
            if transactional and len(sent) % 5 == 0:
                p.begin_transaction()
            qid = f"late-{len(sent)}"
            p.produce(topic, key=qid.encode(), value=orjson.dumps({"id": qid, "text": texts[len(sent) % len(texts)]}))
            sent.append(qid)
            if transactional and len(sent) % 5 == 0:
                p.commit_transaction(30)
            p.poll(0)
            stop.wait(1.0 / per_s)
        if transactional and len(sent) % 5:
            p.commit_transaction(30)
        assert p.flush(30) == 0

    thread = threading.Thread(target=feed, name="trickle", daemon=True)
    thread.start()
    try:
        yield sent
    finally:
        stop.set()
        thread.join(30)


def _topics(make_topic: Callable[..., str]) -> tuple[str, str, str]:
    return make_topic("bf-in", PARTITIONS), make_topic("bf-out", PARTITIONS), make_topic("bf-dlq", 1)


def _positions(bootstrap: str, topic: str) -> dict[str, tuple[int, int]]:
    """Every input record's (partition, offset), by its ID."""
    reader = TopicReader(bootstrap, topic, f"probe-{uuid.uuid4().hex[:8]}")
    reader.settle(2.0)
    reader.close()
    return {r.key: (r.partition, r.offset) for r in reader.records if r.key is not None}


def _output(bootstrap: str, topic: str, expected: set[str]) -> TopicReader:
    reader = TopicReader(bootstrap, topic, f"reader-{uuid.uuid4().hex[:8]}")
    reader.wait_for(expected, 60)
    reader.settle(2.0)
    reader.close()
    return reader


@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
def test_a_growing_topic_gets_exactly_the_records_present_at_the_start(
        kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path, guarantee: str) -> None:
    topics = _topics(make_topic)
    inp, out, _ = topics
    produce_queries(kafka_bootstrap, inp, load_queries(0, 1500))
    extra = ["--processing-guarantee", guarantee, "--transaction-interval-ms", "500"]
    # Exactly-once end to end: the input written transactionally too (markers at the ends).
    with trickle(kafka_bootstrap, inp, per_s=100, transactional=guarantee == "exactly-once") as late:
        run = Backfill(kafka_bootstrap, topics, tmp_path, extra).start()
        assert run.wait() == 0, run.log()[-3000:]
        time.sleep(0.5)  # the trickle goes on past the end
    assert "complete" in run.summary()
    ends = committed_offsets(kafka_bootstrap, f"{out}-backfill-range", inp, PARTITIONS)
    where = _positions(kafka_bootstrap, inp)
    present = {qid for qid, (p, off) in where.items() if off < ends[p]}
    after = {qid for qid, (p, off) in where.items() if off >= ends[p]}
    assert len(present) >= 1500 and after and late, "the topic must have grown during the run"
    reader = _output(kafka_bootstrap, out, present)
    counts = reader.key_counts()
    assert set(counts) == present, f"written past the range: {sorted(set(counts) - present)[:5]}"
    if guarantee == "exactly-once":
        assert max(counts.values()) == 1, [k for k, n in counts.items() if n > 1][:5]
    # The group's offsets stand at the ends: done, whatever the markers between.
    assert committed_offsets(kafka_bootstrap, f"{out}-backfill", inp, PARTITIONS) == ends
    # Every record carries the one fingerprint of the model that wrote it.
    assert {r.headers.get("kwe-fingerprint") for r in reader.records} == {r.value["fingerprint"].encode()
                                                                          for r in reader.records[:1]}


def _stop_after(run: Backfill, out: str, bootstrap: str, outputs: int, sig: int) -> None:
    """Sends `sig` once the output topic holds `outputs` distinct keywords, and waits for the exit."""
    watcher = TopicReader(bootstrap, out, f"watch-{uuid.uuid4().hex[:8]}")
    deadline = time.monotonic() + 120
    while len(watcher.ids()) < outputs:
        watcher.poll(0.2)
        assert run.proc is not None and run.proc.poll() is None, run.log()[-3000:]
        assert time.monotonic() < deadline, "no progress"
    watcher.close()
    assert run.proc is not None
    run.proc.send_signal(sig)


def test_stopped_then_killed_half_way_a_restart_with_the_same_arguments_completes_the_range(
        kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path) -> None:
    topics = _topics(make_topic)
    inp, out, _ = topics
    produce_queries(kafka_bootstrap, inp, load_queries(0, 2400))
    run = Backfill(kafka_bootstrap, topics, tmp_path, ["--max-rate", "400"]).start()
    # SIGTERM: it drains, commits everything it finished, says what is left and exits 130.
    _stop_after(run, out, kafka_bootstrap, 600, signal.SIGTERM)
    assert run.wait(60) == 130, run.log()[-3000:]
    done = committed_offsets(kafka_bootstrap, f"{out}-backfill", inp, PARTITIONS)
    ends = committed_offsets(kafka_bootstrap, f"{out}-backfill-range", inp, PARTITIONS)
    assert "stopped by a stop signal" in run.summary()
    assert f"left         {sum(ends.values()) - sum(done.values()):,} offsets" in run.summary(), run.summary()

    # The same command again, SIGKILLed half way: no drain, no commit.
    run.start()
    _stop_after(run, out, kafka_bootstrap, 1400, signal.SIGKILL)
    run.wait(30)
    assert run.event("backfill range")["done_before"] == sum(done.values())  # resumed, nothing redone
    done_at_kill = committed_offsets(kafka_bootstrap, f"{out}-backfill", inp, PARTITIONS)
    assert sum(done.values()) < sum(done_at_kill.values()) < sum(ends.values()) == 2400
    produce_queries(kafka_bootstrap, inp, [(f"after-kill-{i}", "weather tomorrow") for i in range(150)])

    assert run.start().wait() == 0, run.log()[-3000:]
    resumed = run.event("backfill range")
    assert resumed["kept"] is True and resumed["done_before"] == sum(done_at_kill.values())
    assert committed_offsets(kafka_bootstrap, f"{out}-backfill-range", inp, PARTITIONS) == ends  # the first range
    where = _positions(kafka_bootstrap, inp)
    present = {qid for qid, (p, off) in where.items() if off < ends[p]}
    assert len(present) == 2400 and not any(q.startswith("after-kill") for q in present)
    counts = _output(kafka_bootstrap, out, present).key_counts()
    assert set(counts) == present  # 0 lost, nothing past the range
    duplicates = sum(counts.values()) - len(counts)
    assert duplicates <= 4096, duplicates  # at least once: at most what was in flight (max_in_flight)
    print(f"backfill stop/kill/restart: {duplicates} duplicates of {len(counts)}")


def test_max_rate_holds_the_rate_within_ten_percent(kafka_bootstrap: str, make_topic: Callable[..., str],
                                                      tmp_path: Path) -> None:
    topics = _topics(make_topic)
    inp, out, _ = topics
    rate, n = 200.0, 1200
    produce_queries(kafka_bootstrap, inp, load_queries(0, n))
    run = Backfill(kafka_bootstrap, topics, tmp_path, ["--max-rate", str(rate)]).start()
    assert run.wait() == 0, run.log()[-3000:]
    reader = _output(kafka_bootstrap, out, {q for q, _ in load_queries(0, n)})
    stamps = sorted(r.timestamp_ms for r in reader.records)
    measured = (len(stamps) - 1) / ((stamps[-1] - stamps[0]) / 1000)
    print(f"backfill --max-rate {rate:.0f}: {measured:.1f} records/s over {len(stamps)} records")
    assert abs(measured - rate) / rate <= 0.10, measured


def test_group_offsets_are_read_and_committed_by_a_consumer_that_never_joins(
        kafka_bootstrap: str, make_topic: Callable[..., str]) -> None:
    topic = make_topic("bf-groups", 2)
    group = f"bf-groups-{uuid.uuid4().hex[:8]}"
    groups = GroupOffsets({"bootstrap.servers": kafka_bootstrap}, Retry(bound_s=20.0))
    try:
        assert groups.committed(group, topic, [0, 1]) == {0: (None, None), 1: (None, None)}
        groups.commit(group, topic, {0: 5, 1: 0}, {0: '{"v":1}'}, wait_empty_s=0.0)
        assert groups.committed(group, topic, [0, 1]) == {0: (5, '{"v":1}'), 1: (0, None)}
        # A member in the group: an OffsetCommit without one is refused (UNKNOWN_MEMBER_ID) while it stays.
        member = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group, "enable.auto.commit": False})
        member.subscribe([topic])
        deadline = time.monotonic() + 30
        while not member.assignment():
            member.poll(0.2)
            assert time.monotonic() < deadline, "the member got no assignment"
        started = time.monotonic()
        with pytest.raises(GroupBusyError, match="Unknown member"):
            groups.commit(group, topic, {0: 7}, wait_empty_s=2.0)
        assert 2.0 <= time.monotonic() - started < 10.0
        assert groups.committed(group, topic, [0])[0] == (5, '{"v":1}')
        member.close()  # it leaves: the group is empty again
        groups.commit(group, topic, {0: 9}, wait_empty_s=10.0)
        assert groups.committed(group, topic, [0])[0] == (9, None)
    finally:
        groups.close()
