"""Exactly-once shutdown against the real broker (findings 2 and 3 of the core review).

- A SIGTERM with a short deadline and a backlog in flight: the open transaction is aborted, the
  records the abort purges are not reported as failed writes, the worker exits 0 within the
  deadline (+ 2 s), and a restarted member finishes the stream with every ID exactly once.
- A SIGTERM while a peer joins (the rebalance is served during the final drain): exit 0.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.kafka_tools import TopicReader, WorkerProcess, http_get, load_queries, produce_queries

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

EOS = ["--processing-guarantee", "exactly-once", "--intra-op-threads", "1"]


@pytest.fixture(scope="module")
def onnx_ready() -> None:
    from engines.onnx_export.export import ensure_onnx

    ensure_onnx()


def _in_flight(w: WorkerProcess) -> float:
    try:
        body = http_get(w.url + "/metrics")[1].decode()
    except OSError:
        return 0.0
    for line in body.splitlines():
        if line.startswith("kwe_in_flight_keywords "):
            return float(line.split()[1])
    return 0.0


def _wait_in_flight(w: WorkerProcess, n: int, timeout: float = 120.0) -> None:
    """Until at least n records are consumed and not committed (an open transaction's)."""
    deadline = time.monotonic() + timeout
    while _in_flight(w) < n:
        assert time.monotonic() < deadline, w.log()[-2000:]
        time.sleep(0.01)


def _stop_timed(w: WorkerProcess, timeout: float) -> tuple[int, float]:
    t0 = time.monotonic()
    code = w.stop(timeout)
    return code, time.monotonic() - t0


def test_sigterm_undrained_aborts_and_exits_0_without_delivery_errors(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, onnx_ready: None) -> None:
    src, out, dlq = make_topic("kw", 2), make_topic("emb", 2), make_topic("dlq", 1)
    queries = load_queries(0, 8000)
    produce_queries(kafka_bootstrap, src, queries)
    # A long transaction interval: the SIGTERM finds a transaction open with thousands in flight.
    # A long linger keeps produced records queued, so the abort purges some (their reports must not
    # count as failed writes).
    flags = [*EOS, "--shutdown-timeout-s", "3", "--transaction-interval-ms", "60000",
             "--kafka-config", "linger.ms=1500"]
    w = WorkerProcess(kafka_bootstrap, src, out, dlq, group_id, tmp_path / "w.log", [*flags, "--member-id", "a"]).start()
    reader = TopicReader(kafka_bootstrap, out, f"r-{group_id}", isolation="read_committed")
    try:
        w.wait_ready()
        _wait_in_flight(w, 200)
        code, took = _stop_timed(w, 30)
        log = w.log()
        assert code == 0, log[-3000:]
        assert took < 3 + 2 + 1, f"stopped after {took:.1f} s"  # + 1 s for the signal and the interpreter exit
        assert "could not write" not in log and "Purged" not in log, log[-3000:]
        stopped = w.events("worker stopped")[-1]
        assert stopped["transactions_aborted"] >= 1, stopped  # the undrained transaction was aborted
        # The restarted member redoes the aborted records: every ID exactly once.
        w2 = WorkerProcess(kafka_bootstrap, src, out, dlq, group_id, tmp_path / "w2.log",
                           [*EOS, "--member-id", "a"]).start()
        try:
            reader.wait_for({q for q, _ in queries}, 240, alive=[w2])
            reader.settle(2.0)
            assert w2.stop() == 0, w2.log()[-3000:]
        finally:
            if w2.proc and w2.proc.poll() is None:
                w2.kill()
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
        reader.close()
    ids = Counter(r.key for r in reader.records)
    assert set(ids) == {q for q, _ in queries} and max(ids.values()) == 1


def test_sigterm_while_a_peer_joins_exits_0(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, onnx_ready: None) -> None:
    src, out, dlq = make_topic("kw", 4), make_topic("emb", 4), make_topic("dlq", 1)
    queries = load_queries(0, 6000)
    produce_queries(kafka_bootstrap, src, queries)
    flags = [*EOS, "--shutdown-timeout-s", "10", "--transaction-interval-ms", "1000"]
    a = WorkerProcess(kafka_bootstrap, src, out, dlq, group_id, tmp_path / "a.log", [*flags, "--member-id", "a"]).start()
    b = WorkerProcess(kafka_bootstrap, src, out, dlq, group_id, tmp_path / "b.log", [*flags, "--member-id", "b"])
    reader = TopicReader(kafka_bootstrap, out, f"r-{group_id}", isolation="read_committed")
    try:
        a.wait_ready()
        time.sleep(2.0)
        b.start()
        # SIGTERM `a` as `b` joins: the rebalance reaches `a` while it drains and commits.
        deadline = time.monotonic() + 60
        while not b.events("worker started"):
            assert time.monotonic() < deadline, b.log()[-2000:]
            time.sleep(0.05)
        time.sleep(0.5)
        code, took = _stop_timed(a, 30)
        assert code == 0, a.log()[-3000:]
        assert took < 10 + 2 + 1, f"stopped after {took:.1f} s"
        reader.wait_for({q for q, _ in queries}, 240, alive=[b])
        reader.settle(2.0)
        assert b.stop() == 0, b.log()[-3000:]
    finally:
        for w in (a, b):
            if w.proc and w.proc.poll() is None:
                w.kill()
        reader.close()
    ids = Counter(r.key for r in reader.records)
    assert set(ids) == {q for q, _ in queries} and max(ids.values()) == 1
