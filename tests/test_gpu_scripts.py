"""The torch-free logic of the GPU scripts in benchmarks/gpu/ (the scripts themselves need a GPU).

trt_check.py runs end to end on the fake tensorrt/pycuda in tests/test_tensorrt_logic.py. The
CUDA-graphs mode of the PyTorch backend needs torch and a GPU; its shape and staging logic is
tested here, and the torch test skips (with its reason) where torch or CUDA is missing.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.gpu.graph_shapes import graph_shapes, shape_for, stage_rows
from kwe_core.profiles import load_profile


def test_one_graph_shape_per_bucket_at_its_max_batch_and_bound() -> None:
    gpu = load_profile("gpu")
    assert [(s.bucket, s.batch, s.length) for s in graph_shapes(gpu)] == [
        (0, 256, 8), (1, 128, 16), (2, 64, 32), (3, 32, 64), (4, 8, 256)]
    cpu = load_profile("cpu")
    assert len(graph_shapes(cpu)) == len(cpu.buckets) and graph_shapes(cpu)[0].length == cpu.buckets[0].max_len


def test_a_batch_runs_in_the_graph_of_the_bucket_covering_its_length() -> None:
    gpu = load_profile("gpu")
    shapes = graph_shapes(gpu)
    assert shape_for(shapes, gpu, 100, 5).length == 8
    assert shape_for(shapes, gpu, 3, 9).length == 16  # pad-to-longest batches land in the covering bucket
    assert shape_for(shapes, gpu, 8, 256).bucket == 4
    with pytest.raises(ValueError, match=r"\[9, 200\] batch fits no captured graph"):
        shape_for(shapes, gpu, 9, 200)


def test_staging_pads_and_gives_unused_rows_one_visible_token() -> None:
    ids_buf = np.full((4, 6), 7, np.int64)
    mask_buf = np.full((4, 6), 7, np.int64)
    ids = np.array([[101, 5, 102], [101, 102, 0]])
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    assert stage_rows(ids_buf, mask_buf, ids, mask) == 2
    assert ids_buf.tolist() == [[101, 5, 102, 0, 0, 0], [101, 102, 0, 0, 0, 0], [0] * 6, [0] * 6]
    assert mask_buf.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]


def test_the_graphs_script_pairs_every_configuration() -> None:
    from benchmarks.gpu.torch_graphs import config_names, ratio_pairs, render

    names = config_names()
    assert names == ["mono-eager", "gpu-eager", "cpu-eager", "mono-graphs", "gpu-graphs", "cpu-graphs"]
    pairs = ratio_pairs()
    assert ("gpu-graphs", "mono-graphs") in pairs and ("cpu-eager", "mono-eager") in pairs
    assert ("mono-graphs", "mono-eager") in pairs and all(a in names and b in names for a, b in pairs)
    q = {"median": 2.0, "q1": 1.5, "q3": 2.5}
    md = render({"n": 10, "rounds": 1, "device": "x",
                 "bench": {"keywords_per_s": {n: q for n in names}, "ratios": {f"{a}/{b}": q for a, b in pairs}}})
    assert "| gpu-graphs/mono-graphs | 2.00 (1.50-2.50) |" in md


def test_graphs_mode_matches_eager_on_a_gpu() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed here (a benchmark-only GPU dependency)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the graphs mode captures CUDA graphs")
    from pathlib import Path

    from benchmarks.gpu.torch_backend import TorchBertBackend
    from engines.export_onnx import ensure_onnx

    gpu = load_profile("gpu")
    eager = TorchBertBackend(Path(ensure_onnx()))
    graphs = eager.graphs(gpu)
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, size=(5, 12))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    a = eager.create_context(0).run(ids, mask)
    ctx = graphs.create_context(0)
    np.testing.assert_allclose(ctx.run(ids, mask), a, atol=2e-3)
    ctx.close()
