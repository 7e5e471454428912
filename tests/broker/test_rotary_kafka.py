"""A Qwen3 model through the real broker and a worker process: every ID delivered once, with the
vectors the offline Embedder gives (its default instruction prompt, last-token pooling, in the
worker's length buckets), and the fixture's own texts at sentence-transformers' vectors."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import DATA
from tests.kafka_tools import TopicReader, WorkerProcess, load_queries, produce_queries
from worker.families.parity import MIN_COS, cosines

pytestmark = pytest.mark.kafka

FIXTURE = DATA / "families-st" / "qwen3-lasttoken-right-hub"


def test_a_qwen3_model_delivers_every_id_with_the_embedders_vectors(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    from worker import Embedder

    with np.load(FIXTURE / "reference.npz") as ref:
        fixture_texts = [str(t) for t in ref["texts"]]
        reference = ref["default_single"]
    queries = load_queries()[:1500] + [(f"fixture-{i}", t) for i, t in enumerate(fixture_texts)]
    inp, out, dlq = make_topic("kw", 2), make_topic("emb", 2), make_topic("dlq", 1)
    produce_queries(kafka_bootstrap, inp, queries)
    w = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "worker.log",
                      ("--model-dir", str(FIXTURE), "--output-encoding", "base64-f32"))
    w.start()
    reader = TopicReader(kafka_bootstrap, out, group_id + "-reader")
    ids = [q for q, _ in queries]
    try:
        reader.wait_for(set(ids), 300, alive=[w])
        assert w.stop() == 0
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
    reader.close()
    assert set(reader.key_counts().values()) == {1} and set(reader.ids()) == set(ids)
    by_id = {r.key: r for r in reader.records}
    got = np.stack([np.frombuffer(base64.b64decode(by_id[q].value["embedding"]), dtype="<f4") for q in ids])
    with Embedder(FIXTURE, backend="onnxruntime", cache_bytes=0) as emb:
        assert emb.prompt.name == "query"  # the fixture's default_prompt_name, as the worker took it
        expected = emb.embed([t for _, t in queries])
        assert by_id[ids[0]].value["tokens"] == len(emb.tokenizer.encode([queries[0][1]])[0].ids)
    assert got.shape == expected.shape == (len(queries), 48)
    diff = np.abs(got - expected).max()
    assert diff <= 1e-5, f"max |worker - Embedder| = {diff}"
    # The fixture's texts (five cut at its 72 tokens, the prompt 48 of them) at sentence-transformers' vectors.
    worst = float(cosines(got[-len(fixture_texts):], reference).min())
    assert worst >= MIN_COS, worst
