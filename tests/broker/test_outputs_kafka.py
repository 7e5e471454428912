"""Prompt, truncate_dim and the binary encoding through the real broker and a worker process."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from worker.core.vectors import pack_binary
from tests.kafka_tools import TopicReader, WorkerProcess, load_queries, produce_queries

pytestmark = pytest.mark.kafka


def test_a_prompted_truncated_binary_stream_matches_the_embedder(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    from engines.onnx_export.export import ensure_onnx
    from worker import Embedder

    ensure_onnx()
    inp, out, dlq = make_topic("kw", 2), make_topic("emb", 2), make_topic("dlq", 1)
    queries = load_queries()[:2000]
    produce_queries(kafka_bootstrap, inp, queries)
    w = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "worker.log",
                      ("--output-encoding", "binary", "--truncate-dim", "128", "--prompt", "query: "))
    w.start()
    reader = TopicReader(kafka_bootstrap, out, group_id + "-reader")
    try:
        reader.wait_for({q for q, _ in queries}, 300, alive=[w])
        assert w.stop() == 0
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
    reader.close()
    by_id = {r.key: r for r in reader.records}
    assert set(by_id) == {q for q, _ in queries}
    sample = next(iter(by_id.values()))
    assert sample.headers["kwe-encoding"] == b"binary" and sample.headers["kwe-dim"] == b"128"
    assert sample.headers["kwe-prompt"] == b"query: " and "kwe-prompt-name" not in sample.headers
    assert sample.value["prompt_name"] is None and sample.value["dim"] == 128
    with Embedder(prompt="query: ", truncate_dim=128, backend="onnxruntime") as emb:
        expected = pack_binary(emb.embed([t for _, t in queries]))
    got = np.stack([np.frombuffer(base64.b64decode(by_id[q].value["embedding"]), np.uint8) for q, _ in queries])
    assert got.shape == expected.shape == (2000, 16)
    # Worker and Embedder agree within 1e-5 (batching differs): a sign flips only for a component
    # that close to zero.
    flipped = int(np.unpackbits(got ^ expected).sum())
    assert flipped <= 5, f"{flipped} of {got.size * 8} bits differ"
