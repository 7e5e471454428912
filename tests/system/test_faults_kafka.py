"""Faults against the real broker: each one ends in a dead letter, a bounded retry or a clear
fatal exit that commits nothing past the failure, and the rest of the stream still arrives.

Backend faults run the pipeline in-process (the only way to hand it a failing backend); the
Kafka side is the real broker either way.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from confluent_kafka.admin import AdminClient

from benchmarks.latency_probes import rss_bytes
from tests.conftest import KAFKA_SH
from tests.in_process import in_process, loaded, topics  # noqa: F401 - loaded is a fixture
from tests.kafka_tools import (
    TopicReader, WorkerProcess, committed_offsets, end_offsets, http_get, load_queries, produce, produce_queries,
    produce_with_raw_headers,
)
from worker.kafka.admin import ensure_topics
from worker.operations.probes import MetricsServer

pytestmark = pytest.mark.kafka


def read_all(bootstrap: str, topic: str, group: str, seconds: float) -> TopicReader:
    reader = TopicReader(bootstrap, topic, group)
    reader.poll(seconds)
    reader.close()
    return reader


# ------------------------------------------------------------------------------------ backend
def test_a_backend_failing_once_dead_letters_no_good_keyword(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, loaded: tuple[Any, Any, Any]) -> None:
    names = topics(make_topic, 2)
    queries = load_queries(0, 1500)
    produce_queries(kafka_bootstrap, names[0], queries)
    worker, faulty = in_process(loaded, kafka_bootstrap, names, group_id, lambda call, _ids: call in (3, 10, 11))
    worker.start()
    reader = TopicReader(kafka_bootstrap, names[1], group_id + "-r")
    try:
        reader.wait_for({q for q, _ in queries}, 180)
    finally:
        code = worker.stop()
        reader.close()
    assert code == 0 and faulty.failures == 3  # call 10 failed and its retry (11) too: then split
    dlq = read_all(kafka_bootstrap, names[2], group_id + "-d", 3.0)
    assert dlq.records == []
    assert committed_offsets(kafka_bootstrap, group_id, names[0], 2) == end_offsets(kafka_bootstrap, names[0], 2)


@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
def test_a_hung_backend_bounds_the_stop_by_the_deadline_and_a_second_signal_by_2_s(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, loaded: tuple[Any, Any, Any],
        guarantee: str) -> None:
    """Finding 5: a backend call that never returns. One stop request ends within
    shutdown_timeout_s + 2 s (exit 0 at-least-once has nothing finished past the hang... the
    worker exits whatever the backend does); a second one ends it within 2 s of itself."""
    names = topics(make_topic, 2)
    produce_queries(kafka_bootstrap, names[0], load_queries(0, 300))
    hang = threading.Event()
    worker, faulty = in_process(loaded, kafka_bootstrap, names, group_id,
                                lambda call, _ids: call > 2 and not hang.wait(120),
                                processing_guarantee=guarantee, shutdown_timeout_s=8.0)
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while faulty._calls < 3:  # the dispatcher is inside the hung (third) call
            assert time.monotonic() < deadline, "the backend was never called"
            time.sleep(0.05)
        t0 = time.monotonic()
        worker.pipeline.request_stop()
        time.sleep(1.0)
        worker.pipeline.request_stop()  # the second signal
        t1 = time.monotonic()
        code = worker.join(10.0)
        assert time.monotonic() - t1 < 2.0 + 0.5, f"exited {time.monotonic() - t1:.1f} s after the second signal"
        assert code == 130
        # One signal only: bounded by the deadline.
        names2 = topics(make_topic, 2)
        produce_queries(kafka_bootstrap, names2[0], load_queries(300, 300))
        hang2 = threading.Event()
        worker2, faulty2 = in_process(loaded, kafka_bootstrap, names2, group_id + "-2",
                                      lambda call, _ids: call > 2 and not hang2.wait(120),
                                      processing_guarantee=guarantee, shutdown_timeout_s=4.0)
        worker2.start()
        try:
            deadline = time.monotonic() + 60
            while faulty2._calls < 3:
                assert time.monotonic() < deadline, "the backend was never called"
                time.sleep(0.05)
            t0 = time.monotonic()
            worker2.pipeline.request_stop()
            worker2.join(15.0)
            assert time.monotonic() - t0 < 4.0 + 2.0, f"exited {time.monotonic() - t0:.1f} s after the signal"
        finally:
            hang2.set()
    finally:
        hang.set()


def test_a_poison_keyword_is_dead_lettered_alone(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, loaded: tuple[Any, Any, Any]) -> None:
    names = topics(make_topic, 1)
    tokenizer = loaded[0]
    queries = load_queries(0, 600)
    poison_ids = tokenizer.encode(["zebra poison xylophone"])[0].ids
    records = [(q.encode(), orjson.dumps({"id": q, "text": t})) for q, t in queries]
    records.insert(300, (b"poison", orjson.dumps({"id": "poison", "text": "zebra poison xylophone"})))
    produce(kafka_bootstrap, names[0], records)

    def is_poison(_call: int, ids: np.ndarray) -> bool:
        n = len(poison_ids)
        return bool((ids[:, :n] == poison_ids).all(axis=1).any()) if ids.shape[1] >= n else False

    worker, _ = in_process(loaded, kafka_bootstrap, names, group_id, is_poison)
    worker.start()
    reader = TopicReader(kafka_bootstrap, names[1], group_id + "-r")
    try:
        reader.wait_for({q for q, _ in queries}, 180)
        dlq = TopicReader(kafka_bootstrap, names[2], group_id + "-d")
        deadline = time.monotonic() + 30
        while not dlq.records and time.monotonic() < deadline:
            dlq.poll(0.5)
        dlq.close()
    finally:
        code = worker.stop()
        reader.close()
    assert code == 0
    assert [(r.key, r.value["reason"]) for r in dlq.records] == [("poison", "inference_error")]
    assert "poison" not in reader.ids()


def test_a_backend_that_always_fails_stops_the_worker_and_commits_nothing(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, loaded: tuple[Any, Any, Any]) -> None:
    names = topics(make_topic, 2)
    produce_queries(kafka_bootstrap, names[0], load_queries(0, 500))
    worker, _ = in_process(loaded, kafka_bootstrap, names, group_id, lambda _call, _ids: True)
    start = time.monotonic()
    code = worker.start().join(60)
    assert code == 1 and time.monotonic() - start < 60
    assert "known-good input" in str(worker.pipeline.latch.error)
    assert all(off < 0 for off in committed_offsets(kafka_bootstrap, group_id, names[0], 2).values())
    assert read_all(kafka_bootstrap, names[1], group_id + "-r", 2.0).records == []
    assert read_all(kafka_bootstrap, names[2], group_id + "-d", 2.0).records == []


# ------------------------------------------------------------------------------------ liveness
def test_a_stalled_commit_point_and_a_dead_thread_turn_healthz_to_503(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, loaded: tuple[Any, Any, Any]) -> None:
    names = topics(make_topic, 1)
    produce_queries(kafka_bootstrap, names[0], load_queries(0, 50))
    hang = threading.Event()
    worker, _ = in_process(loaded, kafka_bootstrap, names, group_id,
                           lambda _call, _ids: hang.wait(120) and False, stall_timeout_s=2.0)
    p = worker.pipeline
    with MetricsServer(p.metrics, "127.0.0.1", 0, p.ready, p.liveness) as server:
        url = f"http://127.0.0.1:{server.port}/healthz"
        assert http_get(url)[0] == 200
        worker.start()
        deadline = time.monotonic() + 30
        while http_get(url)[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        status, body = http_get(url)
        assert status == 503 and b"stalled" in body
        hang.set()  # the backend comes back: the commit point moves, the probe recovers
        deadline = time.monotonic() + 30
        while http_get(url)[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert http_get(url)[0] == 200
        # A worker thread dies (a bug): the probe says so, and the worker stops with exit 1.
        p._output._emit = None  # type: ignore[assignment]  # the next batch makes the thread raise
        produce_queries(kafka_bootstrap, names[0], load_queries(50, 10))
        deadline = time.monotonic() + 30
        while http_get(url)[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        status, body = http_get(url)
        assert status == 503 and b"kwe-output" in body
        assert worker.join(60) == 1


# ------------------------------------------------------------------------------------ topics
def test_the_output_topic_deleted_mid_run_is_fatal_and_nothing_past_it_is_committed(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    names = topics(make_topic, 3)
    queries = load_queries(0, 12000)
    produce_queries(kafka_bootstrap, names[0], queries)
    w = WorkerProcess(kafka_bootstrap, *names, group_id, tmp_path / "w.log",
                      ("--max-in-flight", "600")).start()
    before = TopicReader(kafka_bootstrap, names[1], group_id + "-r1")
    try:
        deadline = time.monotonic() + 180
        while len(before.ids()) < 1000:
            before.poll(0.2)
            assert time.monotonic() < deadline, w.log()[-3000:]
        before.close()
        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
        admin.delete_topics([names[1]], operation_timeout=30)[names[1]].result(30)
        start = time.monotonic()
        code = w.proc.wait(120)  # type: ignore[union-attr]
        took = time.monotonic() - start
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
    print(f"\noutput topic deleted: exit {code} after {took:.1f} s")
    assert code == 1, w.log()[-3000:]
    assert f"'{names[1]}'" in w.log()
    # Nothing was committed past the failure: every input record at or above the committed
    # offsets (the ones whose outputs were never acknowledged) is embedded by a new worker once
    # the topic is back. (Outputs acknowledged before the deletion went with the topic.)
    committed = committed_offsets(kafka_bootstrap, group_id, names[0], 3)
    assert committed != end_offsets(kafka_bootstrap, names[0], 3), "everything was committed despite the failure"
    source = TopicReader(kafka_bootstrap, names[0], group_id + "-src")
    while source.poll(1.0):
        pass
    source.close()
    redo = {r.key for r in source.records if r.offset >= max(committed[r.partition], 0)}
    ensure_topics(kafka_bootstrap, {names[1]: 3})
    w2 = WorkerProcess(kafka_bootstrap, *names, group_id, tmp_path / "w2.log").start()
    after = TopicReader(kafka_bootstrap, names[1], group_id + "-r2")
    try:
        after.wait_for(redo, 300, alive=[w2])
        assert w2.stop() == 0
    finally:
        if w2.proc and w2.proc.poll() is None:
            w2.kill()
        after.close()


# ------------------------------------------------------------------------------------ broker outage
@pytest.mark.slow
def test_paused_partitions_resume_after_an_outage_longer_than_the_session_timeout(
        own_broker: tuple[str, dict[str, str]], tmp_path: Path, group_id: str) -> None:
    bootstrap, env = own_broker
    inp, out, dlq = f"kw-{group_id}", f"emb-{group_id}", f"dlq-{group_id}"
    ensure_topics(bootstrap, {inp: 3, out: 3, dlq: 1})
    queries = load_queries(0, 5000)
    produce_queries(bootstrap, inp, queries)
    # A small in-flight bound keeps the worker at its bound, so the outage hits it there: it holds,
    # and once nothing is acknowledged for HOLD_S (worker/pipeline.py), it pauses.
    # A 10 s session (the worker's is 30 s) so that the 15 s outage outlives it and the partitions are
    # lost and assigned again, which is what this is about.
    w = WorkerProcess(bootstrap, inp, out, dlq, group_id, tmp_path / "w.log",
                      ("--max-in-flight", "100", "--kafka-config", "session.timeout.ms=10000")).start()
    reader = TopicReader(bootstrap, out, group_id + "-r")
    try:
        deadline = time.monotonic() + 180
        while len(reader.ids()) < 500:
            reader.poll(0.2)
            assert time.monotonic() < deadline, w.log()[-3000:]
        assert w.events("intake holds") or w.events("partitions paused"), \
            "the worker never reached its bound"
        subprocess.run(["bash", str(KAFKA_SH), "restart", "--hard", "--down-for", "15"], env=env,
                       capture_output=True, text=True, check=True)  # session.timeout.ms 10 s, above
        reader.wait_for({q for q, _ in queries}, 300, alive=[w])
        assert w.stop() == 0, w.log()[-3000:]
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
        reader.close()
    assert w.events("partitions lost"), "the outage did not outlive the session; the test does not exercise it"
    assert w.events("partitions paused"), "the outage never paused the worker; the test does not exercise it"


# ------------------------------------------------------------------------------------ scaling
@pytest.mark.slow
def test_a_scale_up_and_down_storm_loses_nothing_and_every_member_exits_cleanly(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    names = topics(make_topic, 6)
    queries = load_queries(0, 15000)
    shutdown_s = 20.0
    extra = ("--shutdown-timeout-s", str(shutdown_s), "--intra-op-threads", "1")
    n = [0]

    def member() -> WorkerProcess:
        n[0] += 1
        return WorkerProcess(kafka_bootstrap, *names, group_id, tmp_path / f"w{n[0]}.log", extra).start()

    def feed() -> None:  # a stream, not a backlog: 1,000 keywords every half second
        for i in range(0, len(queries), 1000):
            produce_queries(kafka_bootstrap, names[0], queries[i:i + 1000])
            time.sleep(0.5)

    feeder = threading.Thread(target=feed)
    live = [member()]
    live[0].wait_ready()
    feeder.start()
    stopped: list[tuple[WorkerProcess, int, float]] = []

    def stop_one() -> None:
        w = live.pop(0)
        start = time.monotonic()
        code = w.stop(timeout=shutdown_s + 15)
        stopped.append((w, code, time.monotonic() - start))

    reader = TopicReader(kafka_bootstrap, names[1], group_id + "-r")
    try:
        for target in (3, 2, 4, 1):  # as an autoscaler would: 1 -> 3 -> 2 -> 4 -> 1
            while len(live) < target:
                live.append(member())
            stoppers = [threading.Thread(target=stop_one) for _ in range(len(live) - target)]
            for t in stoppers:
                t.start()
            for t in stoppers:
                t.join()
            reader.poll(6.0)
        feeder.join()
        reader.wait_for({q for q, _ in queries}, 300, alive=live)
        reader.settle(3.0)
        for w in live:
            start = time.monotonic()
            stopped.append((w, w.stop(timeout=shutdown_s + 15), time.monotonic() - start))
    finally:
        for w in live:
            if w.proc and w.proc.poll() is None:
                w.kill()
        reader.close()
    counts = Counter(r.key for r in reader.records)
    duplicates = sum(c - 1 for c in counts.values())
    slowest = max(t for _, _, t in stopped)
    print(f"\nscale storm: {len(counts)} IDs, {duplicates} duplicates ({100 * duplicates / len(queries):.2f}%), "
          f"{len(stopped)} members stopped, slowest exit {slowest:.1f} s")
    assert set(counts) == {q for q, _ in queries}
    assert [code for _, code, _ in stopped] == [0] * len(stopped), [w.log()[-2000:] for w, c, _ in stopped if c]
    assert slowest < shutdown_s + 5
    assert slowest <= shutdown_s + 2  # the stated margin (worker/pipeline.py, EXIT_GRACE_S)
    assert duplicates < 0.01 * len(queries)


@pytest.mark.slow
def test_members_stopped_at_once_while_a_rebalance_is_parked_each_exit_within_the_deadline_plus_2_s(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    """The storm's overrun, made every time: one member goes silent (SIGSTOP, as a starved or frozen
    one does), so the rebalance that a first leaver starts waits for its session (30 s) and the
    coordinator answers the others' commits and leaves only then; two of them are stopped at once. Before: the final commit got no
    answer, consume() then blocked in librdkafka until that commit was given up, and a member exited
    28.6 s after SIGTERM with --shutdown-timeout-s 20. Each must exit within shutdown_timeout_s + 2 s."""
    names = topics(make_topic, 6)
    queries = load_queries(0, 15000)
    shutdown_s = 20.0
    extra = ("--shutdown-timeout-s", str(shutdown_s), "--intra-op-threads", "1")
    workers = [WorkerProcess(kafka_bootstrap, *names, group_id, tmp_path / f"w{k}.log", extra).start()
               for k in range(4)]
    done = threading.Event()

    def feed() -> None:  # a stream: 500 keywords every half second
        for i in range(0, len(queries), 500):
            if done.is_set():
                return
            produce_queries(kafka_bootstrap, names[0], queries[i:i + 500])
            time.sleep(0.5)

    feeder = threading.Thread(target=feed)
    exits: dict[int, tuple[int, float]] = {}

    def stop(k: int) -> None:
        start = time.monotonic()
        exits[k] = (workers[k].stop(timeout=shutdown_s + 30), time.monotonic() - start)

    silent = workers[3]
    try:
        for w in workers:
            w.wait_ready(180)
        feeder.start()
        time.sleep(8.0)
        assert silent.proc is not None
        silent.proc.send_signal(signal.SIGSTOP)
        time.sleep(1.0)
        # The first leaver starts the rebalance, parked until the silent member's session ends; the
        # others rejoin meanwhile (their JoinGroups parked too), and are stopped at once then.
        stoppers = [threading.Thread(target=stop, args=(k,)) for k in range(3)]
        stoppers[0].start()
        time.sleep(3.0)
        for t in stoppers[1:]:
            t.start()
        for t in stoppers:
            t.join()
    finally:
        done.set()
        if feeder.is_alive():
            feeder.join()
        if silent.proc is not None and silent.proc.poll() is None:
            silent.proc.send_signal(signal.SIGCONT)
        for w in workers:
            if w.proc and w.proc.poll() is None:
                w.kill()
    print("\nstopped at once, a rebalance parked: exits " +
          ", ".join(f"{t:.1f} s (exit {code})" for code, t in exits.values()))
    assert [code for code, _ in exits.values()] == [0, 0, 0], [workers[k].log()[-2000:] for k in exits]
    slowest = max(t for _, t in exits.values())
    assert slowest <= shutdown_s + 2, [workers[k].log()[-3000:] for k, (_, t) in exits.items() if t > shutdown_s + 2]


# ------------------------------------------------------------------------------------ memory
class PeakRss:
    """The highest resident set (VmRSS) of a process, sampled every 0.1 s on a thread of its own until
    `stop`. Not VmHWM: the worker's model load sets that mark above its ready RSS, so growth under
    load that stays below the load's peak would not show."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = rss_bytes(pid)
        self.peak = self.start
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.1):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def stop(self) -> float:
        """Growth above the first sample, MiB."""
        self._done.set()
        self._thread.join()
        return (self.peak - self.start) / 2**20


@pytest.mark.slow
def test_large_records_stay_within_the_byte_budget(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    names = topics(make_topic, 2)
    w = WorkerProcess(kafka_bootstrap, *names, group_id, tmp_path / "w.log",
                      ("--max-in-flight-bytes", str(8 * 1024 * 1024))).start()
    w.wait_ready()
    assert w.proc is not None
    rss = PeakRss(w.proc.pid)
    filler = "lorem ipsum " * (500_000 // 12)
    # Each is above max_message_bytes: dead-lettered, its bytes held until the dead letter is
    # acknowledged, so the byte budget is what bounds memory.
    records = ((f"big{i}".encode(), orjson.dumps({"id": f"big{i}", "text": f"{i} {filler}"})) for i in range(2000))
    produce(kafka_bootstrap, names[0], records)
    reader = TopicReader(kafka_bootstrap, names[2], group_id + "-r")
    try:
        reader.wait_for({f"big{i}" for i in range(2000)}, 600, alive=[w])
        grown_mib = rss.stop()
        assert w.stop() == 0
    finally:
        rss.stop()
        if w.proc and w.proc.poll() is None:
            w.kill()
        reader.close()
    assert {r.value["reason"] for r in reader.records} == {"oversized"}
    print(f"\n2,000 x 500 KB records: peak RSS {rss.peak / 2**20:.0f} MiB, {grown_mib:.0f} MiB above the ready worker "
          f"(1,000 MB went through)")
    # 8 MiB of in-flight records, the prefetch queue (2 MiB), fetch buffers and the dead letters
    # being built: 8-12 MiB here (sampled VmRSS; with a 1 GiB budget too, as the dead letters are
    # acknowledged as fast as they come). The bound catches any of the gigabyte that went through
    # being kept: 64 MiB is 6% of it.
    assert grown_mib < 64


# ------------------------------------------------------------------------------------ hostile input
def test_a_group_of_three_survives_hostile_records_and_keeps_consuming(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    names = topics(make_topic, 6)
    queries = load_queries(0, 3000)
    ws = [WorkerProcess(kafka_bootstrap, *names, group_id, tmp_path / f"w{i}.log",
                        ("--intra-op-threads", "1")).start() for i in range(3)]
    for w in ws:
        w.wait_ready()
    hostile = [
        (b"huge-text", orjson.dumps({"id": "huge-text", "text": "x" * 900_000}), []),  # under the broker's 1 MB
        (b"k" * 700_000, orjson.dumps({"id": "huge-key", "text": "normal words"}), []),
        (b"bad-header", orjson.dumps({"id": "bad-header", "text": "fine text"}), [(b"\xff\xfe", b"v")]),
        (b"zero-width", orjson.dumps({"id": "zero-width", "text": "\u200b\u200d\ufeff"}), []),
    ]
    produce_queries(kafka_bootstrap, names[0], queries[:1500])
    produce_with_raw_headers(kafka_bootstrap, names[0], hostile)
    produce_queries(kafka_bootstrap, names[0], queries[1500:])
    out = TopicReader(kafka_bootstrap, names[1], group_id + "-r")
    dlq = TopicReader(kafka_bootstrap, names[2], group_id + "-d")
    try:
        out.wait_for({q for q, _ in queries} | {"bad-header"}, 300, alive=ws)
        deadline = time.monotonic() + 60
        while len(dlq.records) < 3 and time.monotonic() < deadline:
            dlq.poll(0.5)
        # Still alive and consuming afterwards.
        more = load_queries(3000, 300)
        produce_queries(kafka_bootstrap, names[0], more)
        out.wait_for({q for q, _ in more}, 120, alive=ws)
        codes = [w.stop() for w in ws]
    finally:
        for w in ws:
            if w.proc and w.proc.poll() is None:
                w.kill()
        out.close()
        dlq.close()
    assert codes == [0, 0, 0]
    reasons = sorted((r.value["source"]["offset"] >= 0, r.value["reason"]) for r in dlq.records)
    assert [r for _, r in reasons] == ["empty_text", "oversized", "oversized"]
    assert all(len(orjson.dumps(r.value)) <= 262144 for r in dlq.records)
    bad = [r for r in out.records if r.key == "bad-header"]
    assert bad, "the record with a non-UTF-8 header name was not embedded"
