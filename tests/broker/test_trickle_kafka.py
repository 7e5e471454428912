"""A trickle of mixed-length keywords through the real broker is answered in batches larger than one.

Issue 19: under a trickle, exact-length buckets split the few keywords that arrive together into
one backend call each. With the measured cost model (merge_buckets, the default) a partial batch
takes its neighbouring buckets along when one call is cheaper than several.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer

from tests.kafka_tools import TopicReader, WorkerProcess, http_get, load_queries


def _metrics(w: WorkerProcess) -> dict[str, float]:
    body = http_get(w.url + "/metrics")[1].decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
            if line and not line.startswith("#")}


def _sum(values: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(prefix))


def _bursts(n_bursts: int, size: int) -> list[list[tuple[str, str]]]:
    """Bursts of keywords of different word counts (so of different token lengths, different buckets)."""
    by_words: dict[int, list[tuple[str, str]]] = {}
    for qid, text in load_queries(0, 5000):
        by_words.setdefault(min(len(text.split()), 8), []).append((qid, text))
    lengths = sorted(k for k, v in by_words.items() if len(v) >= n_bursts)
    assert len(lengths) >= size, f"need {size} word counts, have {lengths}"
    return [[by_words[n][i] for n in lengths[:size]] for i in range(n_bursts)]


@pytest.mark.parametrize("merge", [True, False], ids=["merge", "no-merge"])
def test_a_trickle_of_mixed_lengths_is_answered_in_batches_larger_than_one(
        merge: bool, kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    inp, out, dlq = make_topic("kw", 1), make_topic("emb", 1), make_topic("dlq", 1)
    extra = ("--cache-bytes", "0", "--merge-buckets", "true" if merge else "false")
    w = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "w.log", extra).start()
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5, "enable.idempotence": True})
    try:
        w.wait_ready(120)
        bursts = _bursts(25, 6)
        for burst in bursts:  # ~30 keywords/s: a trickle, the engine idle between bursts
            for qid, text in burst:
                producer.produce(inp, key=qid.encode(), value=orjson.dumps({"id": qid, "text": text}))
            assert producer.flush(10) == 0
            time.sleep(0.2)
        want = {qid for burst in bursts for qid, _ in burst}
        reader = TopicReader(kafka_bootstrap, out, group_id + "-reader")
        reader.wait_for(want, 60, alive=[w])
        reader.close()
        values = _metrics(w)
        batches, items = _sum(values, "kwe_batch_size_count"), _sum(values, "kwe_batch_size_sum")
        merged = _sum(values, "kwe_merged_batches_total")
        print(f"merge={merge}: {items:.0f} keywords in {batches:.0f} batches (mean {items / batches:.2f}), "
              f"{merged:.0f} merged batches")
        assert items == len(want)
        if merge:
            assert merged > 0 and items / batches >= 1.5, values
            assert values['kwe_cost_model_seconds{source="calibrated",term="fixed"}'] > 0
        else:
            assert merged == 0 and "kwe_cost_model_slowdown" not in values
        assert w.stop() == 0
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
