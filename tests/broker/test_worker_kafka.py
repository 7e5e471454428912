"""The worker against the real broker: delivery, parity, scaling, crashes, dead letters, shutdown.

Every worker here is a `keyword-embedder run` process, as deployed; the tests only produce
input, read the output and dead-letter topics back, and send signals.
"""

from __future__ import annotations

import base64
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pytest
from confluent_kafka import Consumer

from tests.kafka_tools import (
    Record, TopicReader, WorkerProcess, committed_offsets, end_offsets, http_get, load_queries, produce, produce_queries,
)
from worker.kafka.client_config import SESSION_TIMEOUT_MS

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def onnx_ready() -> None:
    # Export once before worker processes start, so they all load the cached file.
    from engines.onnx_export.export import ensure_onnx

    ensure_onnx()


@pytest.fixture(scope="module")
def embedder():  # noqa: ANN201
    from worker import Embedder

    return Embedder(backend="onnxruntime")


def topics(make_topic: Callable[..., str], partitions: int) -> tuple[str, str, str]:
    return make_topic("kw", partitions), make_topic("emb", partitions), make_topic("dlq", 1)


def workers(n: int, bootstrap: str, names: tuple[str, str, str], group: str, tmp_path: Path,
            extra: tuple[str, ...] = ()) -> list[WorkerProcess]:
    inp, out, dlq = names
    return [WorkerProcess(bootstrap, inp, out, dlq, group, tmp_path / f"worker-{i}.log", extra) for i in range(n)]


def embed_through_one_worker(bootstrap: str, make_topic: Callable[..., str], partitions: int, group: str,
                             tmp_path: Path, queries: list[tuple[str, str]], timeout_s: float,
                             extra: tuple[str, ...], backend: str = "onnxruntime") -> tuple[list[Record], str]:
    """Produces the queries, runs one worker until every ID is read back, stops it (exit 0) and checks
    commit-after-write (everything done is committed): (the records read, /metrics at the end)."""
    names = topics(make_topic, partitions)
    produce_queries(bootstrap, names[0], queries)
    [w] = workers(1, bootstrap, names, group, tmp_path, extra)
    w.backend = backend
    w.start()
    reader = TopicReader(bootstrap, names[1], group + "-reader")
    try:
        reader.wait_for({q for q, _ in queries}, timeout_s, alive=[w])
        metrics = http_get(w.url + "/metrics")[1].decode()
        assert w.stop() == 0
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
    reader.settle(1.0)
    reader.close()
    assert committed_offsets(bootstrap, group, names[0], partitions) == end_offsets(bootstrap, names[0], partitions)
    return reader.records, metrics


def test_readyz_waits_for_assignment_and_metrics_count_the_work(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, onnx_ready: None) -> None:
    inp, out, dlq = make_topic("kw", 1), make_topic("emb", 1), make_topic("dlq", 1)
    # Another member of the group holds the only input partition until it leaves (the topics
    # must exist before the worker starts: it checks them at startup).
    holder = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group_id, "enable.auto.commit": False,
                       "partition.assignment.strategy": "cooperative-sticky"})
    holder.subscribe([inp])
    deadline = time.monotonic() + 30
    while not holder.assignment():
        assert time.monotonic() < deadline, "the holder got no partition"
        holder.poll(0.2)
    # No embedding cache: repeated texts would be answered without a batch, and the per-batch hop
    # counts below are checked against the batches.
    w = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "w.log", ("--cache-bytes", "0")).start()
    try:
        deadline = time.monotonic() + 90
        while w.probe("/healthz") != 200:
            assert w.proc is not None and w.proc.poll() is None, w.log()
            assert time.monotonic() < deadline, w.log()
            holder.poll(0.1)
        for _ in range(10):  # the worker joined the group and got nothing: not ready (nor a standby yet)
            holder.poll(0.1)
        status, body = http_get(w.url + "/readyz")
        assert status == 503, body
        assert b"assigned" in body
        holder.close()
        w.wait_ready(60)

        queries = load_queries(0, 300)
        produce_queries(kafka_bootstrap, inp, queries)
        reader = TopicReader(kafka_bootstrap, out, group_id + "-reader")
        reader.wait_for({q for q, _ in queries}, 60, alive=[w])
        reader.close()
        time.sleep(0.5)
        metrics = http_get(w.url + "/metrics")[1].decode()
        values = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line and not line.startswith("#")}
        assert values["kwe_consumed_messages_total"] == 300
        assert values["kwe_produced_messages_total"] == 300
        batch_counts = {k: v for k, v in values.items() if k.startswith("kwe_batch_size_count{")}
        assert batch_counts and sum(batch_counts.values()) >= 1, metrics
        assert all('bucket="' in k for k in batch_counts)
        assert any(k.startswith("kwe_end_to_end_latency_seconds_count") and v == 300 for k, v in values.items())
        # Every keyword passes each per-keyword hop once; the per-batch hops once per batch.
        for hop in ("input_to_poll", "poll_to_submit", "produce_to_ack"):
            assert values[f'kwe_hop_seconds_count{{hop="{hop}"}}'] == 300, hop
        for hop in ("output_queue", "encode", "produce_call"):
            assert values[f'kwe_hop_seconds_count{{hop="{hop}"}}'] == sum(batch_counts.values()), hop
        assert w.stop() == 0
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
        try:
            holder.close()
        except RuntimeError:  # already closed
            pass


def test_one_worker_embeds_20k_queries_exactly_as_the_embedder(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, onnx_ready: None,
        embedder) -> None:  # noqa: ANN001
    queries = load_queries()
    assert len(queries) == 20000
    # Commit-after-write: everything done, everything committed, exactly once here.
    records, _ = embed_through_one_worker(kafka_bootstrap, make_topic, 3, group_id, tmp_path, queries, 600,
                                          ("--output-encoding", "base64-f32"))
    by_id = {r.key: r for r in records}
    assert len(records) == len(by_id) == 20000

    texts = dict(queries)
    ids = [q for q, _ in queries]
    expected = embedder.embed([texts[q] for q in ids])
    got = np.stack([np.frombuffer(base64.b64decode(by_id[q].value["embedding"]), dtype="<f4") for q in ids])
    assert got.shape == expected.shape == (20000, embedder.dim)
    diff = np.abs(got - expected).max()
    assert diff <= 1e-5, f"max |worker - Embedder| = {diff}"
    sample = by_id[ids[0]]
    assert sample.value["id"] == ids[0] and sample.value["model"] == embedder.model_name
    assert sample.value["tokens"] == len(embedder.tokenizer.encode([texts[ids[0]]])[0].ids)
    assert sample.headers["kwe-encoding"] == b"base64-f32"


def test_three_workers_share_six_partitions(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, onnx_ready: None) -> None:
    names = topics(make_topic, 6)
    queries = load_queries(0, 6000)
    ws = workers(3, kafka_bootstrap, names, group_id, tmp_path, ("--intra-op-threads", "1"))
    for w in ws:
        w.start()
    # Publish once every member owns partitions, so the spread tests the group, not start-up order.
    for w in ws:
        w.wait_ready()
    produce_queries(kafka_bootstrap, names[0], queries)
    reader = TopicReader(kafka_bootstrap, names[1], group_id + "-reader")
    try:
        reader.wait_for({q for q, _ in queries}, 600, alive=ws)
        codes = [w.stop() for w in ws]
    finally:
        for w in ws:
            if w.proc and w.proc.poll() is None:
                w.kill()
    reader.settle(1.0)
    reader.close()
    assert codes == [0, 0, 0]
    produced = [w.events("worker stopped")[-1]["produced"] for w in ws]
    assert sum(produced) >= 6000
    assert all(n > 0 for n in produced), f"work not spread across members: {produced}"
    assigned = [sum(len(e["partitions"]) for e in w.events("partitions assigned")) for w in ws]
    assert all(a > 0 for a in assigned), assigned
    assert committed_offsets(kafka_bootstrap, group_id, names[0], 6) == end_offsets(kafka_bootstrap, names[0], 6)


def test_kill_9_loses_nothing_and_duplicates_stay_within_the_in_flight_bound(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, onnx_ready: None) -> None:
    max_in_flight = 400
    names = topics(make_topic, 6)
    queries = load_queries(6000, 9000)
    ws = workers(3, kafka_bootstrap, names, group_id, tmp_path,
                 ("--intra-op-threads", "1", "--max-in-flight", str(max_in_flight)))
    for w in ws:
        w.start()
    for w in ws:
        w.wait_ready()
    produce_queries(kafka_bootstrap, names[0], queries)
    reader = TopicReader(kafka_bootstrap, names[1], group_id + "-reader")
    victim, survivors = ws[0], ws[1:]
    try:
        deadline = time.monotonic() + 300
        while len(reader.ids()) < 2500:
            reader.poll(0.2)
            assert time.monotonic() < deadline, "no progress before the kill"
        victim.kill()
        # Its partitions stay with it until its session expires (worker/kafka/consumer.py: issue 46
        # made the session outlive a coordinator's failover), then the survivors take them.
        killed = time.monotonic()
        assigned = sum(len(w.events("partitions assigned")) for w in survivors)
        while sum(len(w.events("partitions assigned")) for w in survivors) == assigned:
            reader.poll(0.2)
            assert time.monotonic() - killed < SESSION_TIMEOUT_MS / 1000 + 30, "the victim's partitions never moved"
        moved_s = time.monotonic() - killed
        reader.wait_for({q for q, _ in queries}, 600, alive=survivors)
        reader.settle(3.0)
        codes = [w.stop() for w in survivors]
    finally:
        for w in ws:
            if w.proc and w.proc.poll() is None:
                w.kill()
    reader.close()
    assert codes == [0, 0]
    counts = Counter(r.key for r in reader.records)
    duplicates = sum(n - 1 for n in counts.values())
    print(f"\nkill -9 of 1 of 3 workers: {len(counts)} IDs, {duplicates} duplicates "
          f"(bound: the victim's max_in_flight = {max_in_flight}); its partitions moved {moved_s:.1f} s after the "
          f"kill (session {SESSION_TIMEOUT_MS / 1000:g} s)")
    assert set(counts) == {q for q, _ in queries}
    assert duplicates <= max_in_flight
    assert SESSION_TIMEOUT_MS / 1000 - 2 < moved_s < SESSION_TIMEOUT_MS / 1000 + 15, moved_s
    # The bound held by backpressure: the victim held (or paused) at its in-flight limit before dying.
    assert victim.events("intake holds") or victim.events("partitions paused"), \
        "backpressure never engaged; the test does not exercise the bound"


BAD_KINDS: list[tuple[str, Callable[[int], tuple[bytes | None, bytes | None]]]] = [
    ("malformed_json", lambda i: (f"bad-{i}".encode(), b'{"id": "x", "text": ')),
    ("not_an_object", lambda i: (f"bad-{i}".encode(), b'["shoes"]')),
    ("missing_id", lambda i: (f"bad-{i}".encode(), b'{"text": "shoes"}')),
    ("id_not_string", lambda i: (f"bad-{i}".encode(), orjson.dumps({"id": i, "text": "shoes"}))),
    ("missing_text", lambda i: (f"bad-{i}".encode(), orjson.dumps({"id": f"bad-{i}"}))),
    ("text_not_string", lambda i: (f"bad-{i}".encode(), orjson.dumps({"id": f"bad-{i}", "text": 5}))),
    ("empty_text", lambda i: (f"bad-{i}".encode(), orjson.dumps({"id": f"bad-{i}", "text": " \t "}))),
    ("empty_id", lambda i: (f"bad-{i}".encode(), orjson.dumps({"id": "", "text": "shoes"}))),
    ("not_utf8", lambda i: (f"bad-{i}".encode(), b'{"id": "bad", "text": "caf\xe9"}')),
    ("oversized", lambda i: (f"bad-{i}".encode(), orjson.dumps({"id": f"bad-{i}", "text": "word " * 800}))),
    ("null_value", lambda i: (f"bad-{i}".encode(), None)),
]


def test_ten_percent_bad_messages_go_to_the_dead_letter_topic(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, onnx_ready: None) -> None:
    names = topics(make_topic, 2)
    good = load_queries(15000, 1980)
    records: list[tuple[bytes | None, bytes | None]] = []
    expected_bad: dict[str, str] = {}
    for i, (qid, text) in enumerate(good):
        records.append((qid.encode(), orjson.dumps({"id": qid, "text": text})))
        if i % 9 == 0:  # 220 bad among 2200: 10%, every kind 20 times, interleaved with good ones
            reason, make = BAD_KINDS[(i // 9) % len(BAD_KINDS)]
            key, value = make(i)
            records.append((key, value))
            expected_bad[key.decode()] = reason
    assert len(expected_bad) == 220 and len(set(expected_bad.values())) == len(BAD_KINDS)
    produce(kafka_bootstrap, names[0], records)
    [w] = workers(1, kafka_bootstrap, names, group_id, tmp_path, ("--max-message-bytes", "2048"))
    w.start()
    out = TopicReader(kafka_bootstrap, names[1], group_id + "-out")
    dlq = TopicReader(kafka_bootstrap, names[2], group_id + "-dlq")
    try:
        out.wait_for({q for q, _ in good}, 300, alive=[w])
        dlq.wait_for(set(expected_bad), 60, alive=[w])
        assert w.stop() == 0
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
    out.settle(1.0)
    dlq.settle(1.0)
    out.close()
    dlq.close()
    assert out.ids() == {q for q, _ in good}
    got = {r.key: r for r in dlq.records}
    assert len(dlq.records) == len(got) == 220
    for key, reason in expected_bad.items():
        rec = got[key]
        assert rec.value["reason"] == reason and rec.headers["kwe-dlq-reason"] == reason.encode()
        assert rec.value["source"]["topic"] == names[0]
        original = dict(records)[key.encode()]
        assert (base64.b64decode(rec.value["value_b64"]) if rec.value["value_b64"] else None) == original
    # Nothing stalled: the whole input, bad messages included, is committed.
    assert committed_offsets(kafka_bootstrap, group_id, names[0], 2) == end_offsets(kafka_bootstrap, names[0], 2)


def test_sigterm_and_restart_lose_nothing_and_duplicate_nothing(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, onnx_ready: None) -> None:
    names = topics(make_topic, 3)
    queries = load_queries(17000, 3000)
    produce_queries(kafka_bootstrap, names[0], queries)
    reader = TopicReader(kafka_bootstrap, names[1], group_id + "-reader")
    # A small in-flight bound keeps most of the input unconsumed when the stop comes.
    [first] = workers(1, kafka_bootstrap, names, group_id, tmp_path, ("--max-in-flight", "500"))
    first.start()
    try:
        deadline = time.monotonic() + 300
        while len(reader.ids()) < 600:
            reader.poll(0.1)
            assert time.monotonic() < deadline
        first.signal(signal.SIGTERM)
        assert first.proc is not None and first.proc.wait(60) == 0
    finally:
        if first.proc and first.proc.poll() is None:
            first.kill()
    stopped = first.events("worker stopped")[-1]
    assert 0 < stopped["produced"] < 3000, "the stop must interrupt the stream for this test to mean anything"
    second = WorkerProcess(kafka_bootstrap, *names, group_id, tmp_path / "second.log").start()
    try:
        reader.wait_for({q for q, _ in queries}, 300, alive=[second])
        reader.settle(2.0)
        assert second.stop() == 0
    finally:
        if second.proc and second.proc.poll() is None:
            second.kill()
    reader.close()
    counts = Counter(r.key for r in reader.records)
    assert set(counts) == {q for q, _ in queries}
    assert max(counts.values()) == 1, f"duplicates: {sum(n - 1 for n in counts.values())}"


def test_a_member_joining_mid_stream_takes_partitions_without_loss(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, onnx_ready: None) -> None:
    names = topics(make_topic, 6)
    queries = load_queries(9000, 6000)
    # Half before the join, half once the second member holds partitions: on a fast backend the
    # first member could otherwise finish everything before the join completes, and the second
    # would have nothing to do.
    before, after = queries[:3000], queries[3000:]
    produce_queries(kafka_bootstrap, names[0], before)
    first, second = workers(2, kafka_bootstrap, names, group_id, tmp_path,
                            ("--intra-op-threads", "1", "--max-in-flight", "1000"))
    first.start()
    reader = TopicReader(kafka_bootstrap, names[1], group_id + "-reader")
    try:
        deadline = time.monotonic() + 300
        while len(reader.ids()) < 1000:
            reader.poll(0.1)
            assert time.monotonic() < deadline, first.log()[-3000:]
        second.start()  # the cooperative rebalance revokes some of the first member's partitions
        while not any(e["partitions"] for e in second.events("partitions assigned")):
            reader.poll(0.1)
            assert time.monotonic() < deadline, second.log()[-3000:]
            assert second.proc is not None and second.proc.poll() is None, second.log()[-3000:]
        produce_queries(kafka_bootstrap, names[0], after)
        reader.wait_for({q for q, _ in queries}, 600, alive=[first, second])
        reader.settle(2.0)
        codes = [first.stop(), second.stop()]
    finally:
        for w in (first, second):
            if w.proc and w.proc.poll() is None:
                w.kill()
    reader.close()
    assert codes == [0, 0]
    revokes = first.events("partitions revoked")
    assert len(revokes) >= 2, "the join did not revoke anything from the first member before it stopped"
    rebalance = revokes[0]  # the last one is the first member's own shutdown
    revoked = rebalance["partitions"]
    assert second.events("worker stopped")[-1]["produced"] > 0
    counts = Counter(r.key for r in reader.records)
    duplicates = sum(n - 1 for n in counts.values())
    print(f"\nmember joined mid-stream: {len(revoked)} partitions moved, {duplicates} duplicates")
    assert set(counts) == {q for q, _ in queries}
    # The revoke finished the moved partitions' work and committed it before they moved, so the
    # new owner starts exactly where the old one stopped; only work dropped at the revoke
    # timeout (a very slow machine) may be redone.
    if rebalance["dropped_unfinished"] == 0:
        assert duplicates == 0
    else:
        assert duplicates <= 1000


def test_a_worker_on_openvino_delivers_every_id_with_the_embedders_vectors(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, onnx_ready: None) -> None:
    """--backend openvino (bf16) end to end: every ID delivered and committed, each vector within the parity
    gate of the Embedder's on the same backend and precision, and /metrics names the backend."""
    pytest.importorskip("openvino")
    from worker import Embedder

    queries = load_queries(0, 2000)
    records, metrics = embed_through_one_worker(kafka_bootstrap, make_topic, 2, group_id, tmp_path, queries, 300,
                                                ("--output-encoding", "base64-f32", "--cache-bytes", "0"),
                                                backend="openvino")
    by_id = {r.key: r for r in records}
    assert set(by_id) == {q for q, _ in queries}
    info = next(line for line in metrics.splitlines() if line.startswith("kwe_backend_info{"))
    assert 'backend="openvino"' in info and 'precision="bf16"' in info and 'cpu="' in info
    with Embedder(backend="openvino", openvino_precision="bf16", cache_bytes=0) as emb:
        expected = emb.embed([t for _, t in queries])
    got = np.stack([np.frombuffer(base64.b64decode(by_id[q].value["embedding"]), dtype="<f4") for q, _ in queries])
    cos = (got * expected).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    assert cos.min() >= 0.9999, float(cos.min())
