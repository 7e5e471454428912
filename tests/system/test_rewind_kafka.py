"""Exactly-once rewinds against the real broker (finding 1 of the core review).

An exactly-once member that cannot wait on a revoke (revoke_timeout_s=0) works through a backlog
on 4 partitions while a second member joins and leaves three times: each rebalance aborts the
open transaction and rewinds the partitions that stay, while records are prefetched. A
read_committed reader sees every ID exactly once: nothing consumed before a rewind is skipped
(tests/unit/worker/ledger/exactly_once/test_rewind.py has the deterministic case) and nothing of an aborted transaction shows.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.kafka_tools import TopicReader, WorkerProcess, load_queries, produce_queries

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

QUERIES = 9_000


@pytest.fixture(scope="module")
def onnx_ready() -> None:
    from engines.onnx_export.export import ensure_onnx

    ensure_onnx()


def test_rewinds_under_join_and_leave_lose_nothing_and_repeat_nothing(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, onnx_ready: None) -> None:
    src, out, dlq = make_topic("kw", 4), make_topic("emb", 4), make_topic("dlq", 1)
    queries = load_queries(0, QUERIES)
    flags = ["--processing-guarantee", "exactly-once", "--revoke-timeout-s", "0", "--intra-op-threads", "1",
             "--transaction-interval-ms", "1000"]
    third = QUERIES // 3
    produce_queries(kafka_bootstrap, src, queries[:third])
    stays = WorkerProcess(kafka_bootstrap, src, out, dlq, group_id, tmp_path / "stays.log",
                          [*flags, "--member-id", "stays"]).start()
    reader = TopicReader(kafka_bootstrap, out, f"r-{group_id}", isolation="read_committed")
    try:
        stays.wait_ready()
        for cycle in range(3):
            produce_queries(kafka_bootstrap, src, queries[(cycle + 1) * third:(cycle + 2) * third] if cycle < 2 else [])
            peer = WorkerProcess(kafka_bootstrap, src, out, dlq, group_id, tmp_path / f"peer{cycle}.log",
                                 [*flags, "--member-id", f"peer{cycle}"]).start()
            peer.wait_ready()
            reader.poll(1.0)
            assert peer.stop() == 0, peer.log()[-3000:]
            reader.poll(1.0)
        reader.wait_for({q for q, _ in queries}, 240, alive=[stays])
        reader.settle(3.0)
        assert stays.stop() == 0, stays.log()[-3000:]
    finally:
        for w in [stays]:
            if w.proc and w.proc.poll() is None:
                w.kill()
        reader.close()
    ids = Counter(r.key for r in reader.records)
    assert set(ids) == {q for q, _ in queries}
    repeated = {k: n for k, n in ids.items() if n > 1}
    assert not repeated, f"{len(repeated)} IDs seen more than once, e.g. {list(repeated.items())[:5]}"
    aborted = sum(1 for e in stays.events("transaction aborted; partitions rewound"))
    stopped = stays.events("worker stopped")
    assert stopped and stopped[-1]["transactions_committed"] > 0
    print(f"rewinds of the member that stayed: {aborted}; transactions aborted: {stopped[-1]['transactions_aborted']}")
