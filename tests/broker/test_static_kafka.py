"""A static model through the real broker and a worker process: every ID delivered once with the
vectors the offline Embedder gives, repeats answered from the cache, a bad record dead-lettered
as with any model. A few seconds (the worker's start most of it)."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import DATA
from tests.kafka_tools import load_queries, stream_through_worker
from worker.families.static import static_fixture_folder, static_fixtures

pytestmark = pytest.mark.kafka



@pytest.mark.parametrize("name", ["m2v-minilm", "st-minilm"])
def test_a_static_model_delivers_every_id_with_the_embedders_vectors(
        name: str, kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    from worker import Embedder

    fixture = next(p for p in static_fixtures(DATA) if p.name == name)
    folder = static_fixture_folder(fixture, tmp_path, data=DATA)
    inp, out, dlq = make_topic("kw", 3), make_topic("emb", 2), make_topic("dlq", 1)
    queries = load_queries()[:3000]
    texts = dict(queries)
    assert len(set(texts.values())) < len(queries)  # repeats: some are answered from the cache
    # One record without text goes to the dead-letter topic, as with any model.
    w, reader, dead = stream_through_worker(kafka_bootstrap, (inp, out, dlq), group_id, tmp_path / "worker.log",
                                            queries, ("--model-dir", str(folder), "--output-encoding", "base64-f32"), backend="auto")
    assert set(reader.key_counts().values()) == {1} and set(reader.ids()) == set(texts)
    assert dead.records[0].headers["kwe-dlq-reason"] == b"missing_text"
    by_id = {r.key: r for r in reader.records}
    ids = [q for q, _ in queries]
    got = np.stack([np.frombuffer(base64.b64decode(by_id[q].value["embedding"]), dtype="<f4") for q in ids])
    with Embedder(folder) as emb:
        expected = emb.embed([texts[q] for q in ids])
        tokens = [len(e.ids) for e in emb.tokenizer.encode([texts[q] for q in ids])]
        fingerprint = emb.fingerprint("base64-f32")
    assert got.shape == expected.shape == (3000, 48)
    diff = float(np.abs(got - expected).max())
    assert diff <= 1e-6, f"max |worker - Embedder| = {diff}"
    sample = by_id[ids[0]].value
    assert "normalized" not in sample and sample["dim"] == 48  # written only as false, for a model that does not normalise
    assert [by_id[q].value["tokens"] for q in ids] == tokens
    assert by_id[ids[0]].headers["kwe-fingerprint"] == fingerprint.encode() == sample["fingerprint"].encode()
    started = [e for e in w.events() if e.get("event") == "backend loaded"]
    assert started and started[0]["backend"] == "static"
    stopped = [e for e in w.events() if e.get("event") == "worker stopped"]
    assert stopped and stopped[0]["produced"] == 3000 and stopped[0]["dead_lettered"] == 1
