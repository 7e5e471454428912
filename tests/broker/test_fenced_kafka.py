"""Exactly-once against the real broker: a transaction that outlives transaction_timeout_ms is
aborted by the broker, which bumps the producer epoch (Kafka's TransactionMetadata
prepareFenceProducerEpoch), so the member's next write or EndTxn is answered
INVALID_PRODUCER_EPOCH / PRODUCER_FENCED and librdkafka raises fatal _FENCED. Transactional ids are
one per member: no zombie, the member goes on with a new producer (worker/ledger/exactly_once/transactions.py,
fenced take-over) instead of exiting 1, which crash-looped every member of a group through a
coordinator outage longer than the timeout (the CI failure of tests/system/test_cluster_kafka.py).

Here the transaction is held open by the model instead of a frozen coordinator (a keyword whose
batch waits in the backend), which makes the broker's timeout certain, and the test short.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.kafka_tools import TopicReader, load_queries, produce_queries
from tests.in_process import in_process, loaded, topics  # noqa: F401 - the fixture

pytestmark = [pytest.mark.kafka]

TIMEOUT_MS = 5000
# The broker aborts a timed-out transaction at its next check (transaction.abort.timed.out.
# transaction.cleanup.interval.ms, 10 s by default): past TIMEOUT_MS plus that, it surely has.
HELD_S = TIMEOUT_MS / 1000 + 10 + 8
# Token length from which a batch is the long keyword's (the others are a few tokens).
LONG = 40


def take_overs(p: Any, reason: str) -> float:
    return float(p.metrics.registry.get_sample_value("kwe_producer_take_overs_total", {"reason": reason}) or 0.0)


def test_a_transaction_the_broker_timed_out_is_taken_over_and_every_id_arrives_once(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, loaded: tuple[Any, Any, Any]  # noqa: F811
) -> None:
    """Failed before the fix: the delivery thread raised the fatal _FENCED and the worker exited 1."""
    names = topics(make_topic, 2)
    gate = threading.Event()  # cleared: the long keyword's batch waits in the backend

    def hold(_call: int, ids: np.ndarray) -> bool:
        return ids.shape[1] >= LONG and not gate.wait(120)

    worker, _ = in_process(loaded, kafka_bootstrap, names, group_id, hold, processing_guarantee="exactly-once",
                           transaction_timeout_ms=TIMEOUT_MS, member_id="fenced")
    p = worker.pipeline
    reader = TopicReader(kafka_bootstrap, names[1], f"r-{group_id}", isolation="read_committed")
    queries = load_queries(0, 60)
    held = ("held-1", " ".join(["keyword"] * 60))
    worker.start()
    try:
        # One transaction takes them all: the others' outputs are written into it (so the
        # coordinator knows it and times it out), the long keyword's waits.
        produce_queries(kafka_bootstrap, names[0], queries[:30] + [held] + queries[30:])
        time.sleep(HELD_S)
        assert worker.code is None, "the worker stopped while the transaction was held open"
        gate.set()
        reader.wait_for({q for q, _ in queries} | {held[0]}, 120)
        reader.settle(3.0)
        assert take_overs(p, "fenced") >= 1, "no fenced take-over: the broker did not time the transaction out"
        assert take_overs(p, "hung") == 0
        assert not p.latch.is_set(), p.latch.error
    finally:
        gate.set()
        code = worker.stop(60)
        reader.close()
    assert code == 0
    ids = reader.key_counts()
    assert set(ids) == {q for q, _ in queries} | {held[0]}
    repeated = {k: n for k, n in ids.items() if n > 1}
    assert not repeated, f"{len(repeated)} IDs more than once, e.g. {list(repeated.items())[:5]}"
