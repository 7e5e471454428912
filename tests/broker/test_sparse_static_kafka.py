"""The inference-free sparse model's query route through the real broker and a worker process:
every ID delivered once with the weights the offline Embedder gives (a table lookup: bit for bit),
repeats answered from the cache, a bad record dead-lettered as with any model. A few seconds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import DATA
from tests.kafka_tools import load_queries, stream_through_worker
from worker.core.sparse import SparseRows
from worker.formats.sparse_codec import decode_sparse

pytestmark = pytest.mark.kafka

ROUTER = DATA / "sparse" / "router-bert"


def test_the_query_route_delivers_every_id_with_the_embedders_weights(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    from worker import Embedder

    inp, out, dlq = make_topic("kw", 3), make_topic("emb", 2), make_topic("dlq", 1)
    queries = load_queries()[:3000]
    texts = dict(queries)
    assert len(set(texts.values())) < len(queries)  # repeats: some are answered from the cache
    # One record without text goes to the dead-letter topic, as with any model.
    w, reader, dead = stream_through_worker(kafka_bootstrap, (inp, out, dlq), group_id, tmp_path / "worker.log",
                                            queries, ("--model-dir", str(ROUTER), "--sparse-terms"), backend="auto")
    assert set(reader.key_counts().values()) == {1} and set(reader.ids()) == set(texts)
    assert dead.records[0].headers["kwe-dlq-reason"] == b"missing_text"
    by_id = {r.key: r for r in reader.records}
    ids = [q for q, _ in queries]
    sample = by_id[ids[0]]
    assert sample.headers["kwe-encoding"] == b"sparse" and sample.value["dim"] == 320
    got = SparseRows.stack([decode_sparse(by_id[q].value) for q in ids], 320)
    with Embedder(ROUTER) as emb:
        expected = emb.embed_sparse([texts[q] for q in ids])
        vocabulary = emb.tokenizer.vocabulary(320)
        tokens = [e.length for e in emb.tokenizer.encode([texts[q] for q in ids])]
        fingerprint = emb.fingerprint("sparse")
    assert np.array_equal(got.offsets, expected.offsets) and np.array_equal(got.indices, expected.indices)
    assert np.array_equal(got.values, expected.values)  # a lookup: no arithmetic to differ
    assert np.mean(np.diff(got.offsets)) > 1  # a real sparse vector, not an empty one
    assert [by_id[q].value["tokens"] for q in ids] == tokens
    assert all(by_id[q].value["terms"] == [vocabulary[i] for i in got[n].indices] for n, q in enumerate(ids))
    assert sample.headers["kwe-fingerprint"] == fingerprint.encode()
    started = [e for e in w.events() if e.get("event") == "backend loaded"]
    assert started and started[0]["backend"] == "static"
    stopped = [e for e in w.events() if e.get("event") == "worker stopped"]
    assert stopped and stopped[0]["produced"] == 3000 and stopped[0]["dead_lettered"] == 1
