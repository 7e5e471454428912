"""The embedding cache in the worker, against the real broker: repeats are answered from it,
produced and committed like any other keyword, bit for bit the vector computed the first time."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pytest

from tests.kafka_tools import TopicReader, WorkerProcess, committed_offsets, end_offsets, http_get, load_queries, produce
from worker.formats.messages import decode_embedding

pytestmark = pytest.mark.kafka


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("cache_bytes", [0, 64 * 1024 * 1024])
def test_repeats_are_answered_from_the_cache_produced_and_committed(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, cache_bytes: int) -> None:
    inp, out, dlq = make_topic("kw", 2), make_topic("emb", 2), make_topic("dlq", 1)
    queries = load_queries(0, 400)
    # The same 400 texts three times over, under new IDs each time, and once with other case and
    # spacing (the tokenizer lower-cases: same token IDs, same key).
    records = [(f"{r}-{q}", t if r < 3 else f"  {t.upper()} ") for r in range(4) for q, t in queries]
    produce(kafka_bootstrap, inp, ((k.encode(), orjson.dumps({"id": k, "text": t, "_": r}))
                                   for r, (k, t) in enumerate(records)))
    w = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "w.log",
                      ("--cache-bytes", str(cache_bytes), "--output-encoding", "base64-f32")).start()
    reader = TopicReader(kafka_bootstrap, out, group_id + "-r")
    try:
        reader.wait_for({k for k, _ in records}, 300, alive=[w])
        metrics = http_get(w.url + "/metrics")[1].decode()
        deadline = time.monotonic() + 30
        while committed_offsets(kafka_bootstrap, group_id, inp, 2) != end_offsets(kafka_bootstrap, inp, 2):
            assert time.monotonic() < deadline, "the input was not committed to its end"
            time.sleep(0.2)
        assert w.stop() == 0
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
        reader.close()
    vecs = {r.key: decode_embedding(r.value["embedding"], "base64-f32") for r in reader.records}
    for q, _ in queries:
        first = vecs[f"0-{q}"]
        for r in (1, 2, 3):
            if cache_bytes:
                assert np.array_equal(vecs[f"{r}-{q}"], first), (q, r)  # bit-identical
            else:
                assert np.allclose(vecs[f"{r}-{q}"], first, atol=1e-5)
    hits = _metric(metrics, "kwe_cache_hits_total")
    print(f"\ncache_bytes={cache_bytes}: {hits:.0f} hits of {len(records)} keywords")
    if cache_bytes:
        # The first round computes; most repeats are hits (some arrive while their first copy is
        # still in flight and are computed again: the worker does not coalesce).
        assert hits >= len(queries)
    else:
        assert hits == 0
