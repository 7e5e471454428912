"""The bench command end to end on a small real sample (ONNX Runtime): schema and invariants, not speed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from worker.core.profiles import load_profile
from worker import cli
from worker.benchmark.inputs import read_queries
from worker.benchmark.policies import BucketerOptions, run_bucketed, run_monolithic, run_sorted
from worker.benchmark.report import quartiles
from tests.conftest import DATA

SAMPLE = DATA / "terabyte05-300.tsv"


@pytest.fixture(scope="module")
def ort_parts():  # noqa: ANN201
    from engines.onnx_export.export import ensure_onnx
    from worker.core.model import default_model_dir
    from worker.backends.onnxruntime import OnnxRuntimeBackend
    from worker.intake.tokenize import KeywordTokenizer

    tokenizer = KeywordTokenizer.from_model_dir(default_model_dir())
    backend = OnnxRuntimeBackend(ensure_onnx(optimize=False))
    encoded = tokenizer.encode([t for _, t in read_queries(SAMPLE)])
    yield tokenizer, backend, encoded
    backend.close()


def test_bench_cli_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    rc = cli.main(["bench", str(SAMPLE), "--limit", "300", "--rounds", "1", "--batch-size", "32",
                   "--no-merge-buckets", "--latency-seconds", "1", "--json", str(out), "--markdown", str(md), "--quiet"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["dataset"] == str(SAMPLE) and report["n"] == 300 and report["rounds"] == 1
    assert set(report["policies"]) == {"monolithic", "bucketed", "sorted"}
    for p in [*report["policies"].values(), report["compare"]["bucketed"]]:
        assert p["keywords_per_s"] > 0
        assert 0.0 <= p["padding_waste"] <= 1.0
    for q in [*report["ratios"].values(), *report["compare"]["ratios"].values()]:
        assert set(q) == {"median", "q1", "q3"} and q["q1"] <= q["median"] <= q["q3"]
    assert set(report["ratios"]) >= {"bucketed/monolithic", "bucketed/sorted"}
    waste = {k: v["padding_waste"] for k, v in report["policies"].items()}
    aligned = report["compare"]["bucketed"]["padding_waste"]
    assert report["compare"]["profile"] == "cpu-aligned"
    # Pad-to-bound waste does not depend on timing, so on this sample the order is fixed:
    # the oracle (exact sort) <= bounds 8/16/32/64 <= chronological.
    assert waste["sorted"] <= aligned <= waste["monolithic"]
    # Fine buckets padded to the longest item never waste more than the aligned bounds (without
    # merging: a measured cost model that finds padding cheap may merge buckets and pad more).
    assert waste["bucketed"] <= aligned
    overhead = report["overhead"]
    assert overhead["q1"] <= overhead["median"] <= overhead["q3"] and len(overhead["rounds"]) == 1
    levels = report["latency"]["levels"]
    assert [lv["load"] for lv in levels] == [0.25, 0.5, 0.8]
    for lv in levels:
        assert 0 < lv["p50_ms"] <= lv["p95_ms"] <= lv["p99_ms"] <= lv["max_ms"]
        assert lv["n"] > 0 and lv["mean_batch"] >= 1.0
    assert "| bucketed/monolithic |" in md.read_text()


def test_bench_cli_without_latency_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", str(SAMPLE), "--limit", "100", "--rounds", "2", "--batch-size", "16",
                   "--no-latency", "--compare-profile", "", "--json", str(out), "--quiet"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["n"] == 100 and report["latency"] == {} and "compare" not in report
    assert report["input"] == {"skipped_lines": 0, "first_skipped_line": None, "first_skipped_reason": ""}
    assert len(report["policies"]["bucketed"]["rounds_keywords_per_s"]) == 2
    bad = tmp_path / "bad.tsv"
    bad.write_text("no tab here\n")
    assert cli.main(["bench", str(bad), "--quiet"]) == 2  # nothing left to benchmark
    err = capsys.readouterr().err
    assert "no queries (" in err and "bad.tsv: skipped 1 bad line (first: line 1, expected id<TAB>text)" in err
    assert cli.main(["bench", str(bad), "--quiet", "--strict"]) == 2
    assert "bad.tsv:1: expected id<TAB>text" in capsys.readouterr().err
    assert cli.main(["bench", str(SAMPLE), "--profile", "nope", "--quiet"]) == 2


def test_run_bucketed_returns_each_embedding_in_its_row(ort_parts) -> None:  # noqa: ANN001
    tokenizer, backend, encoded = ort_parts
    profile = load_profile("cpu", model_max_len=tokenizer.max_len)
    # A small window forces many partial batches and out-of-order completion.
    run = run_bucketed(encoded, profile, backend, window=37, options=BucketerOptions(dispatchers=2),
                       keep_embeddings=True)
    assert run.n == len(encoded) and sorted(i for b in run.formed for i in b.seqs) == list(range(len(encoded)))
    assert run.real_tokens == sum(len(e.ids) for e in encoded)
    ctx = backend.create_context(0)
    for i in (0, 7, 123, 299):
        ids = encoded[i].ids[None, :]
        ref = ctx.run(ids, np.ones_like(ids))
        np.testing.assert_allclose(run.embeddings[i], ref[0], atol=1e-5)
    ctx.close()


def test_run_bucketed_with_a_cache_answers_repeats_without_the_bucketer(ort_parts) -> None:  # noqa: ANN001
    from worker.embedding_cache import EmbeddingCache, key

    tokenizer, backend, encoded = ort_parts
    profile = load_profile("cpu", model_max_len=tokenizer.max_len)
    items = list(encoded[:100])
    distinct = len({key(e.ids) for e in items})
    plain = run_bucketed(items, profile, backend, window=16, keep_embeddings=True)
    cache = EmbeddingCache(1 << 24, backend.dim)
    first = run_bucketed(items, profile, backend, window=16, keep_embeddings=True, cache=cache)
    assert cache.stats().entries == distinct and cache.stats().lookups == len(items)
    np.testing.assert_allclose(first.embeddings, plain.embeddings, atol=1e-5)
    again = run_bucketed(items, profile, backend, window=16, keep_embeddings=True, cache=cache)
    s = cache.stats()
    # Everything was cached by the first pass: the second is all hits and never reaches the bucketer.
    assert again.n == len(items) and again.batches == 0 and s.hits >= len(items)
    assert s.lookups == 2 * len(items) and s.entries == distinct
    # A hit is the vector computed the first time, bit for bit.
    for i, e in enumerate(items):
        assert again.embeddings[i].tobytes() == cache.get(key(e.ids)).tobytes()
    assert again.embeddings.tobytes() == first.embeddings.tobytes()


def test_run_bucketed_coalesces_repeats_in_flight(ort_parts) -> None:  # noqa: ANN001
    from worker.embedding_cache import EmbeddingCache

    tokenizer, backend, encoded = ort_parts
    profile = load_profile("cpu", model_max_len=tokenizer.max_len)
    stream = [encoded[0]] * 40 + list(encoded[1:11])  # one keyword repeated while it is in flight
    cache = EmbeddingCache(1 << 24, backend.dim)
    run = run_bucketed(stream, profile, backend, window=64, keep_embeddings=True, cache=cache)
    s = cache.stats()
    ran = sum(st.size for st in run.stats)
    assert ran == s.misses == len({e.ids.tobytes() for e in stream})  # each key ran once
    assert s.hits + s.joined == len(stream) - ran and s.joined > 0 and cache.in_flight() == 0
    assert all(run.embeddings[i].tobytes() == run.embeddings[0].tobytes() for i in range(40))


def test_run_bucketed_with_a_cache_fails_cleanly_when_the_leader_fails() -> None:
    from worker.embedding_cache import EmbeddingCache
    from worker.benchmark.errors import BenchError
    from worker.intake.tokenize import Encoded

    class Ctx:
        def run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
            raise RuntimeError("backend down")

        def close(self) -> None:
            pass

    class Failing:
        name, dim, preferred_pad, max_contexts = "failing", 4, "longest", None
        requires_serial_dispatch = False

        def create_context(self, index: int) -> Ctx:
            return Ctx()

        def close(self) -> None:
            pass

    item = Encoded(ids=np.array([101, 2000, 102]), length=3, truncated=False)
    cache = EmbeddingCache(1 << 20, 4)
    # A window of 2 with 20 joins: a waiter whose slot were not handed back would hang the feeder.
    with pytest.raises(BenchError, match="failed batches"):
        run_bucketed([item] * 20, load_profile("cpu"), Failing(), window=2, cache=cache)
    assert cache.in_flight() == 0 and len(cache) == 0


def test_monolithic_and_sorted_count_tokens(ort_parts) -> None:  # noqa: ANN001
    _, backend, encoded = ort_parts
    enc = encoded[:40]
    cpu = load_profile("cpu")
    mono = run_monolithic(enc, backend, cpu, batch_size=16)
    srt = run_sorted(enc, backend, cpu, batch_size=16)
    real = sum(len(e.ids) for e in enc)
    assert mono.real_tokens == srt.real_tokens == real
    assert mono.batches == srt.batches == 3
    assert mono.padded_tokens == sum(16 * max(len(e.ids) for e in enc[lo:lo + 16]) for lo in (0, 16)) + \
        8 * max(len(e.ids) for e in enc[32:])
    assert srt.padded_tokens <= mono.padded_tokens


def test_quartiles() -> None:
    assert quartiles([2.0]) == {"median": 2.0, "q1": 2.0, "q3": 2.0}
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == {"median": 3.0, "q1": 2.0, "q3": 4.0}


def test_bench_skips_a_latin1_line_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = SAMPLE.read_bytes().splitlines(keepends=True)[:60]
    lines.insert(10, "q-x\tcaf\u00e9\n".encode("latin-1"))
    src = tmp_path / "latin1.tsv"
    src.write_bytes(b"".join(lines))
    out = tmp_path / "bench.json"
    assert cli.main(["bench", str(src), "--rounds", "1", "--batch-size", "16", "--no-latency",
                     "--compare-profile", "", "--json", str(out), "--quiet"]) == 0
    assert "latin1.tsv: skipped 1 bad line (first: line 11, not UTF-8" in capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["n"] == 60 and report["input"]["skipped_lines"] == 1 and report["input"]["first_skipped_line"] == 11
    assert cli.main(["bench", str(src), "--no-latency", "--quiet", "--strict"]) == 2
    assert "latin1.tsv:11: not UTF-8" in capsys.readouterr().err
