"""The torch backend without a GPU: its pure logic, and the backend itself run on a numpy fake of torch.

worker/backends/torch_cuda.py runs in full here on tests/fakes/gpu_modules/torch, a fake `torch`
that computes the forward in numpy and models the part of PyTorch's CUDA API the backend uses
(streams, pinned memory, events, CUDA graph capture and replay, inference mode) with the rules the
real one enforces. So the forward's numbers are checked against ONNX Runtime (fp32, the golden
rows, through the real Bucketer), and the orchestration against those rules. What the fake cannot
show: the real kernels' numbers in fp16/bf16, speed, memory; that needs a GPU (docs/gpu.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import DATA, ROOT
from tests.fakes.gpu import FAKE_TORCH, install_fake_torch
from worker.backends import torch_plan
from worker.backends.torch_plan import (
    GraphShape,
    batch_tiers,
    bucket_graphs,
    graph_shapes,
    precision_candidates,
    refusal,
    shape_for,
    stage_rows,
    tier_for,
    trim_padding,
)
from worker.core.errors import BackendError
from worker.core.model import ModelInfo, default_model_dir
from worker.core.profiles import Bucket, Profile, load_profile
from worker.intake.tokenize import Encoded, KeywordTokenizer

TINY = DATA / "families" / "bert"
GOLDEN = [json.loads(line)["text"] for line in (DATA / "golden" / "dev.jsonl").read_text().splitlines()]


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _ort(info: ModelInfo, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    from engines.onnx_export.export import build_model

    session = ort.InferenceSession(build_model(info).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)})[0]


def _batch(info: ModelInfo, texts: list[str], pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    from worker.batching.padding import pad_batch

    return pad_batch([e.ids for e in KeywordTokenizer.from_model(info).encode(texts)], pad_to)


# ============================================================================ pure logic (no torch)
def test_one_graph_shape_per_bucket_at_its_max_batch_and_bound() -> None:
    gpu = load_profile("gpu")
    assert [(s.bucket, s.batch, s.length) for s in graph_shapes(gpu)] == [
        (0, 2048, 8), (1, 1024, 16), (2, 512, 32), (3, 256, 64), (4, 64, 256)]  # the overflow bucket: 64 x 256
    # A model of 128 positions: the overflow bucket's graph stops at 128 (no position row past it).
    assert graph_shapes(gpu, 128)[-1] == GraphShape(4, 64, 128) and graph_shapes(gpu, 128)[0] == GraphShape(0, 2048, 8)
    cpu = load_profile("cpu")
    assert len(graph_shapes(cpu)) == len(cpu.buckets) and graph_shapes(cpu)[0].length == cpu.buckets[0].max_len
    from benchmarks.gpu import graph_shapes as benchmark_shapes  # the GPU scripts' import path, kept

    assert benchmark_shapes.graph_shapes is graph_shapes and benchmark_shapes.stage_rows is stage_rows


def test_a_batch_runs_in_the_graph_of_the_bucket_covering_its_length() -> None:
    gpu = load_profile("gpu")
    shapes = graph_shapes(gpu)
    assert shape_for(shapes, gpu, 100, 5).length == 8
    assert shape_for(shapes, gpu, 3, 9).length == 16  # pad-to-longest batches land in the covering bucket
    assert shape_for(shapes, gpu, 8, 256).bucket == 4  # the overflow bucket
    with pytest.raises(BackendError, match=r"\[65, 200\] batch fits no captured graph of bucket 4 \(\[64, 256\]\)"):
        shape_for(shapes, gpu, 65, 200)


def test_each_bucket_has_a_graph_per_halving_of_its_batch_and_a_batch_takes_the_smallest_that_holds_it() -> None:
    assert batch_tiers(2048) == [64, 128, 256, 512, 1024, 2048]
    assert batch_tiers(64) == [64] and batch_tiers(8) == [8] and batch_tiers(96) == [96]
    assert batch_tiers(100) == [100] and batch_tiers(200) == [100, 200]  # halves that stay whole
    graphs = bucket_graphs(GraphShape(0, 2048, 8))
    assert [g.batch for g in graphs] == [64, 128, 256, 512, 1024, 2048] and {g.length for g in graphs} == {8}
    assert [graphs[tier_for(graphs, n)].batch for n in (1, 64, 65, 600, 1024, 1025, 2048)] == \
        [64, 64, 128, 1024, 1024, 2048, 2048]
    # Never more than twice the rows of the batch, once it is past the smallest graph.
    assert all(graphs[tier_for(graphs, n)].batch < 2 * n for n in range(65, 2049))


def test_staging_pads_and_gives_unused_rows_one_visible_token() -> None:
    ids_buf = np.full((4, 6), 7, np.int64)
    mask_buf = np.full((4, 6), 7, np.int64)
    ids = np.array([[101, 5, 102], [101, 102, 0]])
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    assert stage_rows(ids_buf, mask_buf, ids, mask) == 2
    assert ids_buf.tolist() == [[101, 5, 102, 0, 0, 0], [101, 102, 0, 0, 0, 0], [0] * 6, [0] * 6]
    assert mask_buf.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
    with pytest.raises(BackendError, match=r"\[5, 3\] batch does not fit the \[4, 6\] buffers"):
        stage_rows(ids_buf, mask_buf, np.zeros((5, 3), np.int64), np.zeros((5, 3), np.int64))


def test_padding_past_the_graphs_length_is_dropped_only_when_it_is_padding() -> None:
    shape = GraphShape(4, 8, 128)
    ids, mask = np.ones((2, 256), np.int64), np.zeros((2, 256), np.int64)
    mask[:, :100] = 1
    trimmed = trim_padding(shape, ids, mask)
    assert trimmed[0].shape == trimmed[1].shape == (2, 128)
    mask[1, 130] = 1  # a real token past the graph: left for check_fits to refuse
    assert trim_padding(shape, ids, mask)[1].shape == (2, 256)


def test_the_families_and_pipelines_it_cannot_run_exactly_are_refused_naming_who_can(tmp_path: Path) -> None:
    from worker.families.dense import pipeline_fixtures, pipeline_folder

    assert refusal(ModelInfo.from_dir(default_model_dir())) is None
    assert refusal(ModelInfo.from_dir(TINY)) is None
    for family in ("distilbert", "roberta", "xlm-roberta", "mpnet"):
        why = refusal(ModelInfo.from_dir(DATA / "families" / family))
        assert why is not None and f"model_type {family!r}" in why and "onnxruntime, openvino or tensorrt" in why
    verdicts = {}
    for fixture in pipeline_fixtures(DATA / "pipelines"):
        info = ModelInfo.from_dir(pipeline_folder(fixture, tmp_path, families=DATA / "families"))
        verdicts[fixture.name] = refusal(info.with_prompt(4))  # inputs led by a 4-token prompt
    assert verdicts["bert-cls-normalize"] is None  # CLS pooling, then Normalize: runs
    assert "pooling mean_sqrt_len_tokens" in verdicts["bert-mean-sqrt-len-dense-identity"]
    assert "Dense" in verdicts["bert-mean-sqrt-len-dense-identity"]
    assert "leaves the prompt's 4 tokens out" in verdicts["bert-mean-prompt-excluded"]
    assert all("\n" not in (v or "") for v in verdicts.values())


def test_precision_candidates_follow_the_setting_and_the_card() -> None:
    assert precision_candidates("auto", (9, 0)) == (["fp16", "bf16", "fp32"], [])
    found, notes = precision_candidates("auto", (7, 5))  # Turing: fp16 tensor cores, no bf16
    assert found == ["fp16", "fp32"] and "bf16 not tried" in notes[0]
    found, notes = precision_candidates("auto", (6, 1))
    assert found == ["fp32"] and len(notes) == 2
    assert precision_candidates("fp32", (9, 0))[0] == ["fp32"]
    assert precision_candidates("fp16", (9, 0))[0] == ["fp16"]
    with pytest.raises(BackendError, match="bf16 needs 8.0"):
        precision_candidates("bf16", (7, 5))


def test_the_weights_are_read_as_the_exporter_reads_them() -> None:
    info = ModelInfo.from_dir(TINY)
    w = torch_plan.read_weights(info)
    h = info.hidden_size
    assert w.word.shape == (info.vocab_size, h) and len(w.layers) == info.num_layers
    assert w.layers[0].qkv_w.shape == (3 * h, h) and w.layers[0].qkv_w.flags.writeable
    assert all(a.dtype == np.float32 for a in (w.word, w.position, w.token_type0, w.layers[0].ffn_in_w))


# ============================================================================ the backend on the fake torch
@pytest.fixture()
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> Any:
    return install_fake_torch(monkeypatch)


def _backend(info: ModelInfo, profile: Profile, **kw: Any) -> Any:
    from worker.backends.torch_cuda import TorchCudaBackend

    return TorchCudaBackend(info, profile, **kw)


def test_fp32_matches_onnx_runtime_on_the_golden_rows_through_the_real_bucketer(fake_torch: Any) -> None:
    """The default model, every golden row through the Bucketer into CUDA graphs: the gpu profile's bounds
    (8/16/32/64/256) with small batches, since every replay computes its graph's whole [batch, length]
    in numpy (the gpu profile's own shapes run on the small model in the tests below)."""
    from worker.benchmark.policies import run_bucketed

    info = ModelInfo.from_dir(default_model_dir())
    gpu = Profile("gpu-small", tuple(Bucket(n, b, b) for n, b in ((8, 32), (16, 16), (32, 8), (64, 4), (256, 2))),
                  512, "bucket", 8)
    backend = _backend(info, gpu, precision="fp32")
    try:
        encoded = KeywordTokenizer.from_model(info).encode(GOLDEN)
        run = run_bucketed([Encoded(ids=e.ids, length=len(e.ids), truncated=False) for e in encoded], gpu, backend,
                           window=len(encoded), keep_embeddings=True, policy="parity")
    finally:
        backend.close()
    assert run.embeddings is not None
    reference = np.load(DATA / "golden" / "dev.npy")  # sentence-transformers' vectors
    assert _cos(run.embeddings, reference).min() >= 0.9999
    from worker.batching.padding import pad_batch

    by_length = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
    ort_rows = np.zeros_like(run.embeddings)
    for start in range(0, len(by_length), 32):
        rows = by_length[start:start + 32]
        ort_rows[rows] = _ort(info, *pad_batch([encoded[i].ids for i in rows]))
    cos = _cos(run.embeddings, ort_rows)
    assert cos.min() >= 0.9999, cos.min()
    assert np.allclose(np.linalg.norm(run.embeddings, axis=1), 1.0, atol=1e-5)
    # One capture per bucket, at start; the batches were replays; no capture rule was broken.
    assert fake_torch._fake.counts["captures"] == len(gpu.buckets)
    assert fake_torch._fake.counts["replays"] >= run.batches and fake_torch._fake.violations == []


def test_a_batch_is_padded_to_its_buckets_graph_and_rows_come_back_in_order(fake_torch: Any) -> None:
    info = ModelInfo.from_dir(TINY)
    gpu = load_profile("gpu", model_max_len=info.max_seq_length)
    backend = _backend(info, gpu, precision="fp32")
    pinned = fake_torch._fake.counts["pinned_allocations"]
    ctx = backend.create_context(1)  # bucket 1: graphs of [64..1024, 16]
    ids, mask = _batch(info, ["red bike", "a longer query", "x"])
    assert 8 < ids.shape[1] <= 16
    out = ctx.run(ids, mask)
    slot = backend._slots[1][0]  # the smallest of bucket 1's graphs holds 3 rows
    assert slot.host_ids_np.shape == (64, 16) and slot.host_mask_np[3:, 0].all() and not slot.host_mask_np[3:, 1:].any()
    assert out.shape == (3, info.dim) and out.dtype == np.float32
    np.testing.assert_allclose(out, _ort(info, ids, mask), atol=2e-5)
    # The same rows padded to the bound by the bucketer give the same vectors.
    np.testing.assert_allclose(ctx.run(*_batch(info, ["red bike", "a longer query", "x"], 16)), out,
                               atol=1e-6)
    # The overflow bucket: a long row, in the graph of [64, 128] (this model's 128 positions), from a
    # batch the bucketer padded to the bucket's bound of 256.
    last = backend.create_context(4)
    long_ids, long_mask = _batch(info, [" ".join(["bicycle repair"] * 40), "y"], 256)
    np.testing.assert_allclose(last.run(long_ids, long_mask), _ort(info, long_ids[:, :128], long_mask[:, :128]),
                               atol=2e-5)
    with pytest.raises(BackendError, match="batch fits no captured graph of bucket 1"):
        ctx.run(np.ones((1025, 4), np.int64), np.ones((1025, 4), np.int64))  # past the largest graph
    with pytest.raises(BackendError, match="already open"):
        backend.create_context(1)
    with pytest.raises(BackendError, match="context 5 requested"):
        backend.create_context(5)
    # Pinned buffers were made once, at start: none per batch.
    assert fake_torch._fake.counts["pinned_allocations"] == pinned and fake_torch._fake.counts["pin_memory_calls"] == 0
    with pytest.raises(BackendError, match=r"context\(s\) \[1, 4\] still open"):
        backend.close()
    ctx.close()
    last.close()
    backend.close()
    graphs = sum(len(bucket_graphs(shape)) for shape in graph_shapes(gpu, info.max_seq_length))
    assert graphs == 6 + 5 + 4 + 3 + 1  # a graph per halving of each bucket's batch, down to 64 rows
    assert fake_torch._fake.counts["graph_resets"] == graphs and fake_torch._fake.violations == []
    with pytest.raises(BackendError, match="closed"):
        backend.create_context(0)


def test_the_buckets_run_concurrently_from_their_own_threads(fake_torch: Any) -> None:
    """As the Bucketer runs them: one dispatcher thread per bucket, each on its own stream and graph."""
    info = ModelInfo.from_dir(TINY)
    gpu = load_profile("gpu", model_max_len=info.max_seq_length)
    backend = _backend(info, gpu, precision="fp32")
    texts = {0: ["a b", "red bike"], 1: ["a longer query"], 2: ["one two three four five six seven"],
             3: [" ".join(["word"] * 20)]}
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def dispatcher(i: int) -> None:
        try:
            ctx = backend.create_context(i)
            for _ in range(5):
                results[i] = ctx.run(*_batch(info, texts[i]))
            ctx.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=dispatcher, args=(i,)) for i in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    backend.close()
    assert errors == []
    for i, batch in texts.items():
        np.testing.assert_allclose(results[i], _ort(info, *_batch(info, batch)), atol=2e-5)
    assert fake_torch._fake.violations == []


def test_eager_mode_runs_each_batch_at_its_own_shape(fake_torch: Any) -> None:
    info = ModelInfo.from_dir(TINY)
    gpu = load_profile("gpu", model_max_len=info.max_seq_length)
    backend = _backend(info, gpu, precision="fp32", graphs=False)
    assert fake_torch._fake.counts["captures"] == 0 and "eager" in backend.providers
    ctx = backend.create_context(3)  # [32, 64]; the batch runs at its own [2, 33]
    ids, mask = _batch(info, ["seventeen tokens or so in this rather longer keyword query here", "x"])
    np.testing.assert_allclose(ctx.run(ids, mask), _ort(info, ids, mask), atol=2e-5)
    ctx.close()
    backend.close()


def test_a_capture_while_another_thread_runs_cuda_work_is_refused(fake_torch: Any) -> None:
    """Why every graph is captured at start, before any dispatcher: CUDA forbids other work during a capture."""
    info = ModelInfo.from_dir(TINY)
    one = Profile("one", (Bucket(16, 4, 4),), 64, "bucket")
    backend = _backend(info, one, precision="fp32")
    ctx = backend.create_context(0)
    ids, mask = _batch(info, ["a replaying dispatcher"])
    box: dict[str, Any] = {}
    with fake_torch.cuda.graph(fake_torch.cuda.CUDAGraph()):  # a capture underway on this thread
        thread = threading.Thread(target=lambda: box.setdefault("error", pytest.raises(BackendError, ctx.run, ids, mask)))
        thread.start()
        thread.join(30)
    assert "not permitted when stream is capturing" in str(box["error"].value)
    assert fake_torch._fake.violations
    ctx.close()
    backend.close()


def test_the_fake_models_what_the_backend_relies_on(fake_torch: Any) -> None:
    """The event sync before reading pinned output, inference mode for in-place updates, warm-up before capture."""
    torch = fake_torch
    dev = torch.device("cuda", 0)
    with torch.inference_mode():
        host = torch.empty((2, 3), dtype=torch.float32, pin_memory=True)
        src = torch.from_numpy(np.ones((2, 3), np.float32)).to(dev)
        stream = torch.cuda.Stream(device=dev)
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            host.copy_(src, non_blocking=True)
            event.record(stream)
        assert np.isnan(host.numpy()).all()  # read before the event: not there yet
        event.synchronize()
        assert (host.numpy() == 1).all()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        host.copy_(src.cpu())
    weight = torch.from_numpy(np.ones((3, 3), np.float32)).to(dev)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="warm up on a side stream"):
        with torch.cuda.graph(graph):
            torch.nn.functional.linear(src, weight)
    with pytest.raises(RuntimeError, match="non-default stream"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=torch.cuda.current_stream()):
            pass


def test_out_of_gpu_memory_at_start_is_one_backend_error(fake_torch: Any) -> None:
    fake_torch._fake.oom = True
    with pytest.raises(BackendError, match="cannot set up .* out of memory"):
        _backend(ModelInfo.from_dir(TINY), load_profile("gpu", model_max_len=128), precision="fp16")


# ============================================================================ the parity gate (fp16 / bf16 / fp32)
def _tiny_reference(info: ModelInfo) -> Any:
    def reference(token_ids: Any) -> np.ndarray:
        from worker.backend_choice.auto import embed_batches, gate_batches

        return embed_batches(lambda i, m: _ort(info, i, m), gate_batches(token_ids), len(token_ids), info.dim)

    return reference


def test_fp16_passes_the_gate_on_the_fake(fake_torch: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from worker.backend_choice.torch_choice import choose_torch

    info = ModelInfo.from_dir(TINY)
    gpu = load_profile("gpu", model_max_len=info.max_seq_length)
    choice, backend = choose_torch(info, gpu, reference=_tiny_reference(info))
    try:
        assert choice.precision == "fp16" and backend.precision == "fp16"
        assert [t.label for t in choice.trials] == ["torch/fp16"] and choice.trials[0].min_cos >= 0.9999
        assert "parity gate passed" in choice.reason and "NVIDIA H200 (sm 9.0)" in choice.reason
        for i in range(len(gpu.buckets)):  # every context the gate opened was closed again
            backend.create_context(i).close()
    finally:
        backend.close()


@pytest.mark.parametrize("capability,tried", [((9, 0), ["torch/fp16", "torch/bf16", "torch/fp32"]),
                                              ((7, 5), ["torch/fp16", "torch/fp32"])])
def test_a_precision_that_misses_the_gate_is_refused_and_the_log_says_why(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], capability: tuple[int, int],
        tried: list[str]) -> None:
    """fp16 made worse than it is (the fake's linear adds an error in fp16): refused. On the tiny random
    model bf16's 8 mantissa bits miss the 0.9999 gate too (cos ~0.99988), which is why auto tries fp16 first."""
    from worker.backend_choice.torch_choice import choose_torch

    install_fake_torch(monkeypatch, capability=capability, perturb={"float16": 0.05})
    info = ModelInfo.from_dir(TINY)
    choice, backend = choose_torch(info, load_profile("gpu", model_max_len=128), reference=_tiny_reference(info))
    backend.close()
    assert choice.precision == "fp32" and [t.label for t in choice.trials] == tried
    fp16 = choice.trials[0]
    assert not fp16.passed and fp16.min_cos < 0.999 and choice.trials[-1].passed
    assert "torch/fp16 refused (min cos" in choice.reason
    if capability < (8, 0):
        assert "compute capability 7.5 < 8.0: bf16 not tried" in choice.reason
    out = capsys.readouterr().out
    assert "torch candidate refused by the parity gate" in out and "candidate=torch/fp16" in out and "min_cos=" in out


def test_an_explicit_precision_that_misses_the_gate_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.backend_choice.torch_choice import choose_torch

    install_fake_torch(monkeypatch, perturb={"float16": 0.05})
    info = ModelInfo.from_dir(TINY)
    with pytest.raises(BackendError, match=r"no precision passes the parity gate .*torch/fp16: min cos"):
        choose_torch(info, load_profile("gpu", model_max_len=128), requested="fp16", reference=_tiny_reference(info))


def test_the_gate_reference_is_the_onnx_export_in_onnx_runtime(fake_torch: Any, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """No seam: the default reference exports the model and runs it in ONNX Runtime (KWE_CACHE_DIR here)."""
    from worker.backend_choice.torch_choice import choose_torch

    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path))
    info = ModelInfo.from_dir(TINY)
    choice, backend = choose_torch(info, load_profile("gpu", model_max_len=128), requested="fp16")
    backend.close()
    assert choice.precision == "fp16" and choice.trials[0].min_cos >= 0.9999
    assert list((tmp_path / "onnx").glob("*.onnx"))


# ============================================================================ choosing the backend
def _spec(*present: str) -> Any:
    return lambda name: object() if name in present else None


def test_auto_prefers_tensorrt_then_torch_then_the_cpu_choice(tmp_path: Path) -> None:
    from worker.backend_choice.select import choose_backend
    from worker.settings.schema import Settings

    plan = tmp_path / "p.plan"
    plan.write_bytes(b"plan")
    everything = _spec("tensorrt", "pycuda", "torch")
    gpu = lambda: True  # noqa: E731
    assert choose_backend(Settings(engine_path=str(plan)), find_spec=everything, has_gpu=gpu).backend == "tensorrt"
    torch = choose_backend(Settings(), find_spec=everything, has_gpu=gpu)
    assert torch.backend == "torch" and "no engine_path set" in torch.reason and "torch and a GPU" in torch.reason
    torch = choose_backend(Settings(engine_path=str(plan)), find_spec=_spec("torch"), has_gpu=gpu)
    assert torch.backend == "torch" and "missing tensorrt, pycuda" in torch.reason
    cpu = choose_backend(Settings(), find_spec=_spec("tensorrt", "pycuda"), has_gpu=gpu)
    assert cpu.backend == "onnxruntime" and cpu.measure_cpu and "torch extra not installed" in cpu.reason
    cpu = choose_backend(Settings(engine_path=str(plan)), find_spec=everything, has_gpu=lambda: False)
    assert cpu.backend == "onnxruntime" and cpu.reason == "no NVIDIA GPU visible"


def test_auto_without_a_gpu_never_imports_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.backend_choice.select import load_backend
    from worker.settings.schema import Settings

    monkeypatch.setitem(sys.modules, "torch", None)  # an import would raise
    monkeypatch.setattr("worker.backend_choice.select.choose_cpu",
                        lambda *a, **k: (_FakeCpuChoice(), _FakeCpu()))
    loaded = load_backend(Settings(), find_spec=_spec("torch"), has_gpu=lambda: False)
    assert loaded.settings.backend == "onnxruntime" and "no NVIDIA GPU visible" in loaded.reason


class _FakeCpu:
    name, dim, max_contexts, requires_serial_dispatch = "onnxruntime", 384, None, False

    def close(self) -> None:
        pass


class _FakeCpuChoice:
    from worker.backend_choice.auto import REFERENCE as candidate

    reason, cached, seconds = "only candidate", True, 0.0


def test_auto_with_torch_on_a_gpu_runs_torch_and_says_why(fake_torch: Any, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.backend_choice.select import load_backend, precision_label
    from worker.settings.schema import Settings

    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path))
    loaded = load_backend(Settings(model_dir=str(TINY)), find_spec=_spec("torch"), has_gpu=lambda: True)
    try:
        s = loaded.settings
        assert (s.backend, s.profile, s.pad_to, s.torch_precision) == ("torch", "gpu", "bucket", "fp16")
        assert precision_label(s) == "fp16" and loaded.backend.name == "torch"
        assert "no TensorRT" in loaded.reason and "torch fp16 on NVIDIA H200 (sm 9.0)" in loaded.reason
    finally:
        loaded.backend.close()


def test_auto_with_a_torch_that_finds_no_cuda_goes_on_to_the_cpu_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.backend_choice.select import load_backend
    from worker.settings.schema import Settings

    install_fake_torch(monkeypatch, cuda_version=None)  # a CPU-only build of torch
    monkeypatch.setattr("worker.backend_choice.select.choose_cpu", lambda *a, **k: (_FakeCpuChoice(), _FakeCpu()))
    loaded = load_backend(Settings(model_dir=str(TINY)), find_spec=_spec("torch"), has_gpu=lambda: True)
    assert loaded.settings.backend == "onnxruntime"
    assert "torch not used: backend 'torch': torch 2.11.0+fake is a CPU-only build" in loaded.reason


def test_auto_with_a_model_torch_cannot_run_goes_on_without_importing_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.backend_choice.select import load_backend
    from worker.settings.schema import Settings

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr("worker.backend_choice.select.choose_cpu", lambda *a, **k: (_FakeCpuChoice(), _FakeCpu()))
    loaded = load_backend(Settings(model_dir=str(DATA / "families" / "mpnet")), find_spec=_spec("torch"),
                          has_gpu=lambda: True)
    assert loaded.settings.backend == "onnxruntime" and "model_type 'mpnet'" in loaded.reason


@pytest.mark.parametrize("knobs,message", [
    ({"cuda_version": None}, "torch 2.11.0+fake is a CPU-only build (torch.version.cuda is None)"),
    ({"cuda": False, "warning": "CUDA initialization: The NVIDIA driver on your system is too old (found version "
                                "11040).\nPlease update your GPU driver"},
     "finds no usable CUDA device: CUDA initialization: The NVIDIA driver on your system is too old"),
])
def test_explicit_torch_without_usable_cuda_is_one_line(monkeypatch: pytest.MonkeyPatch, knobs: dict[str, Any],
                                                        message: str) -> None:
    from worker.backend_choice.select import load_backend
    from worker.settings.schema import Settings

    install_fake_torch(monkeypatch, **knobs)
    with pytest.raises(BackendError) as err:
        load_backend(Settings(backend="torch", model_dir=str(TINY)), find_spec=_spec("torch"), has_gpu=lambda: True)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_explicit_torch_with_a_family_it_cannot_run_names_who_can(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.backend_choice.select import load_backend
    from worker.settings.schema import Settings

    monkeypatch.setitem(sys.modules, "torch", None)  # refused before torch is imported
    with pytest.raises(BackendError, match=r"model_type 'distilbert'.*run it on onnxruntime, openvino or tensorrt"):
        load_backend(Settings(backend="torch", model_dir=str(DATA / "families" / "distilbert")),
                     find_spec=_spec("torch"), has_gpu=lambda: True)
    with pytest.raises(BackendError, match="'precision': 'int8' is for the onnxruntime backend"):
        load_backend(Settings(backend="torch", precision="int8", model_dir=str(TINY)), find_spec=_spec("torch"),
                     has_gpu=lambda: True)


def _run_cli(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # Port 1: nothing listens; the backend check comes before the broker is asked anything.
    return subprocess.run([sys.executable, "-m", "worker.cli", "run", "--backend", "torch", "--bootstrap-servers",
                           "127.0.0.1:1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_run_with_backend_torch_on_a_machine_without_a_gpu_exits_2_with_one_line() -> None:
    if list(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("this machine has an NVIDIA device")
    # torch installed (the fake, importable), no GPU: the device nodes say so, torch is not imported.
    proc = _run_cli({"PYTHONPATH": f"{FAKE_TORCH.parent.parent}:{ROOT}"})
    assert proc.returncode == 2, proc.stderr
    why = ("backend 'torch': no NVIDIA GPU is visible (no /dev/nvidia* device, or CUDA_VISIBLE_DEVICES hides them); "
           "use --backend onnxruntime on CPU")
    assert _message(proc.stderr) == f"keyword-embedder run: {why}"
    # No torch at all: the extra's install line.
    proc = _run_cli({"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert _message(proc.stderr) == ("keyword-embedder run: backend 'torch' needs the torch extra: pip install "
                                     "'keyword-embedder[torch]' (missing: torch)")


def _message(stderr: str) -> str:
    """The one line a start-up failure prints; before it only the structured log record of the same error."""
    lines = stderr.strip().splitlines()
    assert all(json.loads(line)["event"] == "cannot start the worker" for line in lines[:-1]), lines
    return lines[-1]


def test_kwe_backend_info_says_which_backend_and_why(fake_torch: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.app as app
    import worker.backend_choice.select as select
    from worker.operations.metrics import Metrics
    from worker.settings.schema import Settings

    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path))
    (tmp_path / "nvidia0").touch()  # a GPU's device node, as the driver makes it
    monkeypatch.setattr(select.gpu_present, "__defaults__", (None, str(tmp_path / "nvidia[0-9]*")))
    monkeypatch.setattr(app, "wire_pipeline", lambda settings, **kw: types.SimpleNamespace())  # no pipeline: the info only
    metrics = Metrics()
    assembled = app.build_pipeline(Settings(model_dir=str(TINY)), metrics=metrics)
    try:
        line = next(x for x in metrics.render().decode().splitlines() if x.startswith("kwe_backend_info{"))
    finally:
        assembled.backend.close()
    assert 'backend="torch"' in line and 'precision="fp16"' in line and 'device="NVIDIA H200 (sm 9.0)"' in line
    assert 'reason="no TensorRT' in line and "parity gate passed" in line
