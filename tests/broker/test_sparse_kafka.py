"""A sparse (SPLADE) model through the real broker and a worker process: every ID delivered once
with the non-zero weights the offline Embedder gives, repeats answered from the cache, a bad
record dead-lettered as with a dense model. About 8 s (the worker's start most of it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pytest

from tests.conftest import DATA
from tests.kafka_tools import load_queries, stream_through_worker
from worker.core.sparse import SparseRows, compare
from worker.families.sparse import sparse_fixture_folder
from worker.formats.sparse_codec import decode_sparse

pytestmark = pytest.mark.kafka



def test_a_sparse_model_delivers_every_id_with_the_embedders_weights(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    from worker import Embedder

    # The tiny BERT with its MLM head (tests/data/sparse/bert-mlm): the path is the real model's,
    # in a fraction of its time (tests/unit/worker/core/test_sparse.py holds the real one to sentence-transformers).
    folder = sparse_fixture_folder(DATA / "sparse" / "bert-mlm", tmp_path, families=DATA / "families")
    inp, out, dlq = make_topic("kw", 2), make_topic("emb", 2), make_topic("dlq", 1)
    queries = load_queries()[:2000]
    texts = dict(queries)
    assert len(set(texts.values())) < len(queries)  # repeats: some are answered from the cache
    # One record without text goes to the dead-letter topic, as with any model.
    w, reader, dead = stream_through_worker(kafka_bootstrap, (inp, out, dlq), group_id, tmp_path / "worker.log",
                                            queries, ("--model-dir", str(folder), "--sparse-terms"))
    assert set(reader.key_counts().values()) == {1} and set(reader.ids()) == set(texts)
    by_id = {r.key: r for r in reader.records}
    sample = by_id[queries[0][0]]
    assert sample.headers["kwe-encoding"] == b"sparse" and sample.headers["kwe-dim"] == b"320"
    assert sample.value["encoding"] == "sparse" and sample.value["dim"] == 320 and "normalized" not in sample.value
    assert dead.records[0].headers["kwe-dlq-reason"] == b"missing_text"
    with Embedder(folder, backend="onnxruntime") as emb:
        expected = emb.embed_sparse([text for _, text in queries])
        vocabulary = emb.tokenizer.vocabulary(320)
        tokens = [e.length for e in emb.tokenizer.encode([text for _, text in queries])]
    got = SparseRows.stack([decode_sparse(by_id[q].value) for q, _ in queries], 320)
    # Worker and Embedder batch differently: within the parity rule, the same non-zero indices.
    match = compare(got, expected)
    assert match.ok and match.support_differs == 0, match.line()
    assert [by_id[q].value["tokens"] for q, _ in queries] == tokens
    assert all(by_id[q].value["terms"] == [vocabulary[i] for i in got[n].indices]
               for n, (q, _) in enumerate(queries))
    # A repeated keyword gets, bit for bit, the first occurrence's weights (the cache's row).
    first: dict[str, bytes] = {}
    for q, text in queries:
        value = orjson.dumps(by_id[q].value["embedding"])
        assert first.setdefault(text, value) == value
    hits = [e for e in w.events() if e.get("event") == "worker stopped"]
    assert hits and hits[0]["produced"] == 2000 and hits[0]["dead_lettered"] == 1
    assert np.mean(np.diff(got.offsets)) > 5  # a real sparse vector, not an empty one
