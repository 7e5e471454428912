"""The TensorRT path without a GPU: its pure logic, and its orchestration against fake tensorrt/pycuda.

No test here imports the real tensorrt or pycuda. The fakes below implement the small part of
TensorRT 10's and pycuda's Python API that the backend and the builder use, and check the
calls the way the real ones would fail: CUDA calls need the context pushed on the calling
thread, input shapes must lie inside the selected optimisation profile, the output is computed
from what was actually copied to "device" memory. What they cannot show is that real
TensorRT accepts the plan or produces the right numbers (docs/gpu.md).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.build_engine import (
    AlignmentError,
    EngineBuildError,
    GpuExtraMissingError,
    PlanSidecar,
    PlanSidecarError,
    build_engine,
    fp16_onnx_path,
    profile_shapes,
    profile_table,
    read_sidecar,
    sha256_file,
    sidecar_path,
    validate_sidecar,
    write_sidecar,
)
from engines.onnx_export.export import EXPORTER_VERSION
from tests.conftest import ROOT
from tests.fakes.gpu import DIM, FakeTrt, install_fakes
from tests.fakes.gpu import tiny_onnx as _tiny_onnx
from tests.thread_tools import run_in_thread
from worker.backend_choice.select import (
    GPU_INSTALL_HINT,
    choose_backend,
    gpu_present,
    load_backend,
    missing_gpu_packages,
    resolve_profile_name,
)
from worker.backends.base import Backend, InferenceContext
from worker.backends.tensorrt_plan import (
    BufferPlan,
    buffer_plan,
    check_batch,
    check_engine_profiles,
    numpy_dtype,
    profile_index_for_bucket,
    shared_memory_size,
    stage_batch,
)
from worker.core.errors import BackendError
from worker.core.profiles import Bucket, Profile, ProfileError, load_profile
from worker.deadline import Deadline
from worker.settings.schema import Settings

PROFILES = ROOT / "worker" / "core" / "profiles.toml"


@pytest.fixture()
def gpu() -> Profile:
    return load_profile("gpu", PROFILES, model_max_len=256)


# ============================================================================ profile shapes
def test_profile_shapes_from_the_real_gpu_profile(gpu: Profile) -> None:
    shapes = profile_shapes(gpu)
    assert [(s.index, s.min, s.opt, s.max) for s in shapes] == [
        (0, (1, 8), (1024, 8), (2048, 8)),
        (1, (1, 16), (512, 16), (1024, 16)),
        (2, (1, 32), (256, 32), (512, 32)),
        (3, (1, 64), (128, 64), (256, 64)),
        (4, (1, 256), (32, 256), (64, 256)),  # the overflow bucket: opt 32, max 64, aligned
    ]
    # Every batch the bucketer can send to bucket i fits profile i.
    for i, s in enumerate(shapes):
        assert gpu.batch_limit(i) <= s.max_batch


def test_unaligned_bounds_are_refused_with_the_fix(gpu: Profile) -> None:
    # A CPU-style profile (fine buckets, tuned for ONNX Runtime) cannot become TensorRT profiles.
    fine = Profile("fine", tuple(Bucket(n, 128, 128) for n in (4, 5, 8, 10, 16, 24, 256)), 16384, "longest")
    with pytest.raises(AlignmentError) as exc:
        profile_shapes(fine)
    msg = str(exc.value)
    assert "'fine'" in msg and "multiple of 8" in msg
    assert "[4, 5, 10]" in msg and "10 -> 16" in msg
    assert "24" not in msg.split("not aligned:")[1].split("(round")[0]  # 8, 16 and 24 are aligned
    assert isinstance(exc.value, ProfileError)  # caught where profile errors are caught
    # The shipped CPU default is refused the same way.
    with pytest.raises(AlignmentError, match="'cpu'"):
        profile_shapes(load_profile("cpu", PROFILES))

    odd = Profile("odd", (Bucket(8, 64, 64), Bucket(20, 32, 32), Bucket(256, 8, 8)), 4096, "bucket")
    with pytest.raises(AlignmentError, match=r"\[20\].*20 -> 24"):
        profile_shapes(odd)
    assert [s.seq_len for s in profile_shapes(odd, align=4)] == [8, 20, 256]
    # The aligned CPU comparison profile is accepted as is.
    assert [s.seq_len for s in profile_shapes(load_profile("cpu-aligned", PROFILES))] == [8, 16, 32, 64, 256]


# ============================================================================ sidecar
def _sidecar(profile: Profile, **over: Any) -> PlanSidecar:
    base = PlanSidecar(tensorrt_version="10.3.0", gpu_name="NVIDIA L40S", compute_capability="8.9",
                       profile_name=profile.name, profile_table=profile_table(profile), onnx_sha256="a" * 64,
                       onnx_path="/models/minilm.onnx", fp16=True, exporter_version="keyword-embedder/0.1.0",
                       created="2026-11-30T00:00:00+00:00", plan_sha256="")
    return replace(base, **over)


def test_sidecar_round_trip_next_to_the_plan(tmp_path: Path, gpu: Profile) -> None:
    plan = tmp_path / "minilm.plan"
    plan.write_bytes(b"plan")
    sc = _sidecar(gpu, plan_sha256=hashlib.sha256(b"plan").hexdigest())
    assert write_sidecar(plan, sc) == tmp_path / "minilm.plan.json" == sidecar_path(plan)
    assert read_sidecar(plan) == sc
    raw = json.loads((tmp_path / "minilm.plan.json").read_text())
    assert raw["profile_table"][4] == {"max_len": 256, "max_batch": 64, "opt_batch": 32}
    assert {"tensorrt_version", "gpu_name", "compute_capability", "onnx_sha256", "fp16", "exporter_version",
            "created", "profile_name"} <= set(raw)


def test_missing_or_broken_sidecar_is_refused(tmp_path: Path, gpu: Profile) -> None:
    plan = tmp_path / "p.plan"
    with pytest.raises(PlanSidecarError, match="not found.*build-engine"):
        read_sidecar(plan)
    plan.write_bytes(b"x")
    with pytest.raises(PlanSidecarError, match="no sidecar"):
        read_sidecar(plan)
    sidecar_path(plan).write_text("{not json")
    with pytest.raises(PlanSidecarError, match="not valid JSON"):
        read_sidecar(plan)
    sidecar_path(plan).write_text(json.dumps({"schema": 1, "gpu_name": "x"}))
    with pytest.raises(PlanSidecarError, match="missing field.*onnx_sha256"):
        read_sidecar(plan)
    sidecar_path(plan).write_text(json.dumps({"schema": 99}))
    with pytest.raises(PlanSidecarError, match="schema 99"):
        read_sidecar(plan)


def test_matching_sidecar_passes(gpu: Profile) -> None:
    sc = _sidecar(gpu)
    validate_sidecar(sc, plan_path="p.plan", profile=gpu, onnx_sha256="a" * 64, tensorrt_version="10.3.0",
                     gpu_name="NVIDIA L40S", compute_capability="8.9")


def test_stale_plan_is_refused(gpu: Profile) -> None:
    with pytest.raises(PlanSidecarError) as exc:
        validate_sidecar(_sidecar(gpu), plan_path="p.plan", profile=gpu, onnx_sha256="b" * 64)
    assert "stale" in str(exc.value) and "aaaaaaaaaaaa" in str(exc.value) and "bbbbbbbbbbbb" in str(exc.value)
    assert "keyword-embedder build-engine --profile gpu --output p.plan" in str(exc.value)


@pytest.mark.parametrize("field,value,words", [
    ("gpu_name", "NVIDIA H100 80GB HBM3", "built on GPU 'NVIDIA L40S'"),
    ("compute_capability", "9.0", "compute capability 8.9"),
    ("tensorrt_version", "10.4.0", "TensorRT 10.3.0, this is TensorRT 10.4.0"),
])
def test_foreign_plan_is_refused(gpu: Profile, field: str, value: str, words: str) -> None:
    with pytest.raises(PlanSidecarError) as exc:
        validate_sidecar(_sidecar(gpu), plan_path="p.plan", profile=gpu, **{field: value})
    assert "foreign" in str(exc.value) and words in str(exc.value)


def test_mismatched_profile_is_refused_and_all_problems_are_listed(gpu: Profile) -> None:
    other = replace(gpu, name="gpu-big", buckets=gpu.buckets[:-1] + (Bucket(256, 16, 16),))
    with pytest.raises(PlanSidecarError) as exc:
        validate_sidecar(_sidecar(gpu), plan_path="p.plan", profile=other, gpu_name="Other GPU",
                         onnx_sha256="c" * 64)
    msg = str(exc.value)
    assert "profile mismatch" in msg and "256x64" in msg and "256x16" in msg
    assert "stale" in msg and "foreign" in msg  # one message, every reason
    # Same buckets under another name are the same plan.
    validate_sidecar(_sidecar(gpu), plan_path="p.plan", profile=replace(gpu, name="renamed"))


def test_sidecar_of_another_plan_is_refused(gpu: Profile) -> None:
    with pytest.raises(PlanSidecarError, match="belongs to another plan"):
        validate_sidecar(_sidecar(gpu, plan_sha256="1" * 64), plan_path="p.plan", plan_sha256="2" * 64)


# ============================================================================ buffers and mapping
def _plan(gpu: Profile, index: int, ids_dtype: Any = np.int64) -> BufferPlan:
    return buffer_plan(gpu, index, input_dtypes={"input_ids": ids_dtype, "attention_mask": ids_dtype},
                       output_name="sentence_embedding", output_dtype=np.float32, dim=DIM)


def test_buffer_sizing_follows_the_bucket_and_the_engine_dtypes(gpu: Profile) -> None:
    p0 = _plan(gpu, 0)
    assert p0.input_shape == (2048, 8) and p0.output_shape == (2048, DIM)
    assert p0.input_nbytes("input_ids") == 2048 * 8 * 8  # int64
    assert p0.output_nbytes == 2048 * DIM * 4
    assert p0.total_nbytes == 2 * 2048 * 8 * 8 + 2048 * DIM * 4
    p4 = _plan(gpu, 4, np.int32)  # a plan whose inputs TensorRT narrowed to int32
    assert p4.input_shape == (64, 256) and p4.input_nbytes("attention_mask") == 64 * 256 * 4
    assert p4.output_nbytes == 64 * DIM * 4
    with pytest.raises(BackendError, match="integer"):
        buffer_plan(gpu, 0, input_dtypes={"input_ids": np.float32, "attention_mask": np.int64},
                    output_name="o", output_dtype=np.float32, dim=DIM)
    with pytest.raises(BackendError, match="missing"):
        buffer_plan(gpu, 0, input_dtypes={"input_ids": np.int64}, output_name="o", output_dtype=np.float32, dim=DIM)


def test_trt_dtype_names_map_to_numpy() -> None:
    assert numpy_dtype(types.SimpleNamespace(name="INT64")) == np.int64
    assert numpy_dtype(types.SimpleNamespace(name="INT32")) == np.int32
    assert numpy_dtype(types.SimpleNamespace(name="HALF")) == np.float16
    assert numpy_dtype("DataType.FLOAT") == np.float32
    with pytest.raises(BackendError, match="FP8 is not supported"):
        numpy_dtype(types.SimpleNamespace(name="FP8"))


def test_bucket_maps_to_the_profile_of_the_same_index(gpu: Profile) -> None:
    assert [profile_index_for_bucket(gpu, i) for i in range(5)] == [0, 1, 2, 3, 4]
    # bucket_for (the bucketer's choice) and the profile's bound agree for every length.
    for length in range(1, 257):
        i = profile_index_for_bucket(gpu, gpu.bucket_for(length))
        assert profile_shapes(gpu)[i].seq_len >= length
    with pytest.raises(BackendError, match="has 5 buckets"):
        profile_index_for_bucket(gpu, 5)
    with pytest.raises(BackendError):
        profile_index_for_bucket(gpu, -1)


def test_engine_profile_shapes_are_checked_against_the_buckets(gpu: Profile) -> None:
    good = [{n: [s.min, s.opt, s.max] for n in ("input_ids", "attention_mask")} for s in profile_shapes(gpu)]
    check_engine_profiles(gpu, good)
    with pytest.raises(BackendError, match="4 optimisation profiles"):
        check_engine_profiles(gpu, good[:4])
    bad = [dict(x) for x in good]
    bad[2] = {**bad[2], "attention_mask": [(1, 32), (64, 32), (32, 32)]}  # max batch 32 < 64
    with pytest.raises(BackendError, match="profile 2 input 'attention_mask'"):
        check_engine_profiles(gpu, bad)


def test_batch_checks_and_staging_pad_to_the_bound(gpu: Profile) -> None:
    plan = _plan(gpu, 1, np.int32)  # bound 16, max batch 128, int32 engine inputs
    host = {n: np.full(plan.input_shape, 7, dtype=dt) for n, dt in plan.input_dtypes}
    ids = np.arange(30, dtype=np.int64).reshape(3, 10) + 100
    mask = np.ones((3, 10), dtype=np.int64)
    mask[2, 6:] = 0
    assert stage_batch(plan, host, ids, mask) == 3
    assert host["input_ids"].dtype == np.int32
    np.testing.assert_array_equal(host["input_ids"][:3, :10], ids)
    np.testing.assert_array_equal(host["input_ids"][:3, 10:], 0)  # padded up to the bound
    np.testing.assert_array_equal(host["attention_mask"][:3, 10:], 0)
    np.testing.assert_array_equal(host["attention_mask"][2, 6:10], 0)
    np.testing.assert_array_equal(host["input_ids"][3:], 7)  # rows past the batch untouched

    with pytest.raises(BackendError, match="exceeds profile 1's bound 16"):
        check_batch(plan, np.zeros((2, 17), np.int64), np.zeros((2, 17), np.int64))
    with pytest.raises(BackendError, match="batch of 1025 exceeds profile 1's max batch 1024"):
        check_batch(plan, np.zeros((1025, 16), np.int64), np.zeros((1025, 16), np.int64))
    with pytest.raises(BackendError, match="same"):
        check_batch(plan, np.zeros((2, 16), np.int64), np.zeros((2, 15), np.int64))
    with pytest.raises(BackendError, match="empty"):
        check_batch(plan, np.zeros((0, 16), np.int64), np.zeros((0, 16), np.int64))


def test_shared_memory_block_is_the_largest_profile() -> None:
    assert shared_memory_size([10, 4096, 300]) == 4096
    with pytest.raises(BackendError):
        shared_memory_size([])


# ============================================================================ fake tensorrt + pycuda (tests/fakes/gpu.py)
@pytest.fixture()
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeTrt:
    return install_fakes(monkeypatch)


@pytest.fixture()
def built_plan(tmp_path: Path, fake_gpu: FakeTrt, gpu: Profile) -> tuple[Path, Path]:
    onnx_path = _tiny_onnx(tmp_path / "model.onnx")
    plan = tmp_path / "engines" / "minilm.plan"
    build_engine(onnx_path, gpu, plan, timing_cache=tmp_path / "timing.cache", log=lambda _m: None)
    return plan, onnx_path


# ============================================================================ build_engine (fake TensorRT)
def test_build_engine_adds_one_profile_per_bucket_and_writes_the_sidecar(
        tmp_path: Path, built_plan: tuple[Path, Path], fake_gpu: FakeTrt, gpu: Profile) -> None:
    plan, onnx_path = built_plan
    config = fake_gpu.built[0]["config"]
    assert [p.shapes["input_ids"] for p in config.profiles] == [(s.min, s.opt, s.max) for s in profile_shapes(gpu)]
    # Strongly typed: no precision flag at all, the fp16 graph's types say what runs in FP16.
    assert config.flags == set() and config.pools["WORKSPACE"] == 4 * (1 << 30)
    network = fake_gpu.built[0]["network"]
    assert network.strongly_typed and network.flags == 1 << 1  # STRONGLY_TYPED is 1 on TensorRT 10
    assert (tmp_path / "timing.cache").read_bytes() == b"+tuned"  # saved after the build
    sc = read_sidecar(plan)
    assert sc.gpu_name == "NVIDIA L40S" and sc.compute_capability == "8.9" and sc.tensorrt_version == "10.3.0"
    # The hash the backend and --check compare is the source graph's; the fp16 one is beside the plan.
    assert sc.onnx_sha256 == sha256_file(onnx_path) and sc.fp16 is True
    assert network.onnx_path == sc.extra["fp16_onnx"] == str(fp16_onnx_path(plan))
    assert sc.extra["fp16_onnx_sha256"] == sha256_file(fp16_onnx_path(plan)) and sc.extra["strongly_typed"]
    assert sc.profile_name == "gpu" and sc.profile_table == profile_table(gpu)
    assert sc.exporter_version == f"keyword-embedder/{EXPORTER_VERSION}"
    assert sc.plan_sha256 == hashlib.sha256(plan.read_bytes()).hexdigest()
    assert not list(plan.parent.glob("*.tmp"))


def test_build_engine_refuses_unaligned_profile_before_touching_the_gpu(tmp_path: Path, fake_gpu: FakeTrt) -> None:
    with pytest.raises(AlignmentError):
        build_engine(_tiny_onnx(tmp_path / "m.onnx"), load_profile("cpu", PROFILES), tmp_path / "p.plan")
    assert fake_gpu.built == [] and not (tmp_path / "p.plan").exists()


@pytest.mark.parametrize("version", ["10.3.0", "11.4.0"])
def test_one_strongly_typed_build_on_tensorrt_10_and_11(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         gpu: Profile, version: str) -> None:
    """TensorRT 11 removed weak typing (BuilderFlag.FP16, OBEY_PRECISION_CONSTRAINTS, ILayer.precision,
    set_output_type); 10 refuses them on a strongly typed network. The same build runs on both."""
    trt = install_fakes(monkeypatch, version=version)
    onnx_path = _tiny_onnx(tmp_path / "m.onnx")
    for fp16 in (True, False):
        sc = build_engine(onnx_path, gpu, tmp_path / f"p{fp16}.plan", fp16=fp16, log=lambda _m: None)
        built = trt.built[-1]
        flag = trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED
        # The bit comes from the enum: 1 << 1 on 10, 1 << 0 on 11 (where 1 << 1 is PREFER_JIT_PYTHON_PLUGINS).
        assert built["network"].flags == 1 << int(flag) == (2 if version.startswith("10") else 1)
        assert built["network"].strongly_typed and built["network"].get_flag(flag)
        assert built["config"].flags == set() and trt.errors == []
        assert sc.fp16 is fp16 and sc.extra["strongly_typed"]
        parsed = {t.name: t.dtype for t in built["network"].tensors.values()}
        if fp16:  # the encoder HALF from the graph's types, the pooling region FLOAT (checked, counted)
            assert parsed["hidden"] == "HALF" and parsed["pooled"] == parsed["sentence_embedding"] == "FLOAT"
            assert sc.extra["fp32_layers"] == 14 and sc.extra["fp16_onnx"].endswith(".plan.fp16.onnx")
        else:
            assert "HALF" not in parsed.values() and "fp16_onnx" not in sc.extra
            assert built["network"].onnx_path == str(onnx_path)


def test_the_fakes_refuse_the_weak_typing_api_as_tensorrt_10_and_11_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the old build called: 10 raises on a strongly typed network (and builds no plan with a
    precision flag), 11 has none of it."""
    trt10 = install_fakes(monkeypatch, version="10.8.0")
    builder = trt10.Builder(trt10.Logger(2))
    strong = builder.create_network(1 << int(trt10.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    layer = strong.get_layer(0)
    with pytest.raises(trt10.StronglyTypedError):
        layer.precision = trt10.float32
    with pytest.raises(trt10.StronglyTypedError):
        layer.set_output_type(0, trt10.float32)
    with pytest.raises(trt10.StronglyTypedError):
        layer.get_output(0).dtype = trt10.float16
    config = builder.create_builder_config()
    config.set_flag(trt10.BuilderFlag.FP16)
    ctx = trt10.cuda.Device(0).retain_primary_context()
    ctx.push()  # a build needs a current CUDA context
    try:
        assert builder.build_serialized_network(strong, config) is None and "FP16" in trt10.errors[0]
    finally:
        trt10.cuda.Context.pop()
    weak = builder.create_network(0)  # weak typing still works on 10, where nothing asks for it
    weak.get_layer(0).precision = trt10.float32

    trt11 = install_fakes(monkeypatch, version="11.1.0")
    for name in ("FP16", "BF16", "INT8", "OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS"):
        assert not hasattr(trt11.BuilderFlag, name)
    assert not hasattr(trt11.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH")
    network = trt11.Builder(trt11.Logger(2)).create_network(0)  # strongly typed whatever the flags
    assert network.strongly_typed
    layer = network.get_layer(0)
    assert not hasattr(layer, "set_output_type") and not hasattr(layer, "precision")
    with pytest.raises(AttributeError):
        layer.get_output(0).dtype = trt11.float16
    assert not hasattr(trt11.OnnxParser, "supports_model")


def test_a_pooling_layer_parsed_as_fp16_stops_the_build(tmp_path: Path, fake_gpu: FakeTrt, gpu: Profile) -> None:
    """check_fp32_region reads the parsed network back: a Cast lost in the fp16 graph shows at build time."""
    fake_gpu.half_tensors = {"pooled"}
    with pytest.raises(EngineBuildError, match="'pooled_94_node'.*FP16"):
        build_engine(_tiny_onnx(tmp_path / "m.onnx"), gpu, tmp_path / "p.plan", log=lambda _m: None)
    assert fake_gpu.built == [] and not (tmp_path / "p.plan").exists()


def test_an_fp16_build_of_a_graph_not_from_the_exporter_says_to_build_fp32(tmp_path: Path, fake_gpu: FakeTrt,
                                                                         gpu: Profile) -> None:
    import onnx
    from onnx import TensorProto, helper

    foreign = tmp_path / "foreign.onnx"
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input_ids"], ["sentence_embedding"])], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.INT64, ["b", "s"])])
    onnx.save(helper.make_model(graph), str(foreign))
    with pytest.raises(EngineBuildError, match=r"fp16: no pooling/normalisation node.*--no-fp16"):
        build_engine(foreign, gpu, tmp_path / "p.plan", log=lambda _m: None)
    assert fake_gpu.built == []


# ============================================================================ backend (fake TensorRT + pycuda)
def test_backend_runs_each_bucket_on_its_own_context_and_thread(
        built_plan: tuple[Path, Path], fake_gpu: FakeTrt, gpu: Profile) -> None:
    from worker.backends.tensorrt import TensorRTBackend

    plan, onnx_path = built_plan
    backend = TensorRTBackend(plan, gpu, onnx_path=onnx_path)
    assert isinstance(backend, Backend) and backend.name == "tensorrt" and backend.dim == DIM
    assert backend.max_contexts == 5
    assert backend.requires_serial_dispatch is False
    cuda = fake_gpu.cuda
    assert cuda.stack() == []  # the constructor popped what it pushed

    def dispatcher(i: int, length: int, batch: int) -> tuple[np.ndarray, int, int]:
        ctx = backend.create_context(i)
        assert isinstance(ctx, InferenceContext)
        rng = np.random.default_rng(i)
        ids = rng.integers(1, 30000, size=(batch, length), dtype=np.int64)
        mask = np.ones_like(ids)
        mask[0, length // 2:] = 0
        out = ctx.run(ids, mask)
        out2 = ctx.run(ids[:1], mask[:1])  # another batch size: shapes set again
        out3 = ctx.run(ids[:1], mask[:1])  # same size: no set_input_shape
        np.testing.assert_array_equal(out2, out3)
        assert out.dtype == np.float32 and out.shape == (batch, DIM)
        np.testing.assert_array_equal(out[:, 0], (ids * mask).sum(1))
        np.testing.assert_array_equal(out[:, 1], mask.sum(1))
        depth = len(cuda.stack())
        ctx.close()
        return out, depth, len(cuda.stack())

    # One thread per bucket, as the bucketer's dispatchers; lengths below the bound get padded.
    results = [run_in_thread(lambda i=i, L=L, B=B: dispatcher(i, L, B))
               for i, L, B in [(0, 5, 256), (1, 16, 3), (2, 20, 64), (3, 64, 1), (4, 200, 8)]]
    for i, (out, depth_open, depth_closed) in enumerate(results):
        assert out[0, 2] == gpu.buckets[i].max_len  # ran at the bucket's bound
        assert out[0, 3] == i  # on profile i
        assert (depth_open, depth_closed) == (1, 0)  # pushed while open, popped on close
    engine = fake_gpu.engines[0]
    assert [c.profile for c in engine.contexts] == [0, 1, 2, 3, 4]
    assert {c.strategy for c in engine.contexts} == {"ON_PROFILE_CHANGE"}
    # 2 inputs x distinct batch sizes in a row (bucket 3's batches are all of 1: set once).
    assert [c.shape_calls for c in engine.contexts] == [4, 4, 4, 2, 4]
    backend.close()
    # The primary context retained once for the build and the backend, never detached (which
    # would leave it current); every device buffer and page-locked host block (.base) freed.
    assert cuda.retained == {0: 1} and cuda.detached == 0 and cuda.left_current == []
    assert cuda.memory == {} and cuda.host_live == set()


def test_context_refuses_batches_that_do_not_fit_and_foreign_threads(
        built_plan: tuple[Path, Path], fake_gpu: FakeTrt, gpu: Profile) -> None:
    from worker.backends.tensorrt import TensorRTBackend

    backend = TensorRTBackend(built_plan[0], gpu)
    ctx = backend.create_context(1)  # bound 16, max batch 1024
    with pytest.raises(BackendError, match="bound 16"):
        ctx.run(np.ones((2, 17), np.int64), np.ones((2, 17), np.int64))
    with pytest.raises(BackendError, match="max batch 1024"):
        ctx.run(np.ones((1025, 16), np.int64), np.ones((1025, 16), np.int64))
    with pytest.raises(BackendError, match="thread other than"):
        run_in_thread(lambda: ctx.run(np.ones((1, 16), np.int64), np.ones((1, 16), np.int64)))
    with pytest.raises(BackendError, match="still open"):
        backend.close()
    with pytest.raises(BackendError, match="has 5 buckets"):
        backend.create_context(5)
    ctx.close()
    with pytest.raises(BackendError, match="closed"):
        ctx.run(np.ones((1, 16), np.int64), np.ones((1, 16), np.int64))
    backend.close()
    assert fake_gpu.cuda.stack() == []


def test_shared_device_memory_gives_every_context_one_block(
        built_plan: tuple[Path, Path], fake_gpu: FakeTrt, gpu: Profile) -> None:
    from worker.backends.tensorrt import TensorRTBackend

    backend = TensorRTBackend(built_plan[0], gpu, share_device_memory=True)
    assert backend.requires_serial_dispatch is True

    def serial_dispatcher() -> None:  # one thread runs every context
        ctxs = [backend.create_context(i) for i in range(5)]
        for i, ctx in enumerate(ctxs):
            L = gpu.buckets[i].max_len
            assert ctx.run(np.ones((2, L), np.int64), np.ones((2, L), np.int64))[0, 3] == i
        assert len(fake_gpu.cuda.stack()) == 1  # pushed once for the thread, not once per context
        for ctx in ctxs:
            ctx.close()
        assert fake_gpu.cuda.stack() == []

    run_in_thread(serial_dispatcher)
    contexts = fake_gpu.engines[0].contexts
    # A second dispatcher thread would run concurrently on the same block: refused.
    first = backend.create_context(0)
    with pytest.raises(BackendError, match="ONE dispatcher thread"):
        run_in_thread(lambda: backend.create_context(1))
    first.close()
    assert {c.strategy for c in contexts} == {"USER_MANAGED"}
    blocks = {c.device_memory for c in contexts}
    assert len(blocks) == 1 and next(iter(blocks))[1] == 5000  # the largest of 1000..5000
    backend.close()
    assert fake_gpu.cuda.memory == {}


def test_backend_refuses_a_foreign_or_stale_plan_before_deserialising(
        built_plan: tuple[Path, Path], fake_gpu: FakeTrt, gpu: Profile, tmp_path: Path) -> None:
    from worker.backends.tensorrt import TensorRTBackend

    plan, onnx_path = built_plan
    fake_gpu.cuda.gpu_name = "NVIDIA H100 80GB HBM3"
    with pytest.raises(PlanSidecarError, match="foreign: built on GPU 'NVIDIA L40S'"):
        TensorRTBackend(plan, gpu)
    fake_gpu.cuda.gpu_name = "NVIDIA L40S"
    onnx_path.write_bytes(onnx_path.read_bytes() + b"\0")  # re-exported model: the plan is stale
    with pytest.raises(PlanSidecarError, match="stale"):
        TensorRTBackend(plan, gpu)
    other = replace(gpu, buckets=gpu.buckets[:-1] + (Bucket(256, 16, 16),))
    with pytest.raises(PlanSidecarError, match="profile mismatch"):
        TensorRTBackend(plan, other, onnx_path=_tiny_onnx(tmp_path / "model.onnx"))
    assert fake_gpu.engines == []  # nothing was deserialised


# ============================================================================ the defects of the desk check
def test_bucketer_runs_a_shared_memory_backend_from_one_dispatcher(
        built_plan: tuple[Path, Path], fake_gpu: FakeTrt, gpu: Profile) -> None:
    """Defect 1: with one shared activation block the bucketer must create and run every context on one thread."""
    from worker.backends.tensorrt import TensorRTBackend
    from worker.batching.bucketer import Bucketer

    backend = TensorRTBackend(built_plan[0], gpu, share_device_memory=True)
    done: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []
    bucketer = Bucketer(gpu, backend, lambda seqs, out, _s: done.update(zip(seqs, out)),
                        on_error=lambda _seqs, exc: errors.append(exc), max_queue_delay_ms=1.0)
    bucketer.start()  # raised "ONE dispatcher thread" before: one thread per context
    lengths = [5, 12, 30, 60, 200, 7, 16]
    for seq, n in enumerate(lengths):
        bucketer.submit(seq, np.arange(1, n + 1, dtype=np.int64))
    assert bucketer.stop(Deadline.after(10), drain=True) == []
    assert not errors and sorted(done) == list(range(len(lengths)))
    for seq, n in enumerate(lengths):
        assert done[seq][3] == gpu.bucket_for(n)  # ran on its bucket's profile
    contexts = fake_gpu.engines[0].contexts
    assert len(contexts) == 5 and len({c.thread for c in contexts}) == 1
    backend.close()
    assert fake_gpu.cuda.memory == {} and fake_gpu.cuda.host_live == set()


def test_a_refused_optimisation_profile_is_a_backend_error(
        built_plan: tuple[Path, Path], fake_gpu: FakeTrt, gpu: Profile) -> None:
    """Defect 2: the binding raises RuntimeError (it never returns False); the user gets a BackendError."""
    from worker.backends.tensorrt import TensorRTBackend

    backend = TensorRTBackend(built_plan[0], gpu)
    fake_gpu.refuse_profiles.add(2)
    with pytest.raises(BackendError, match="refused optimisation profile 2.*Error in set optimization profile"):
        backend.create_context(2)
    assert fake_gpu.cuda.stack() == [] and fake_gpu.cuda.host_live == set()
    backend.close()
    assert fake_gpu.cuda.memory == {}


def test_a_refused_tensor_address_fails_at_context_creation(
        built_plan: tuple[Path, Path], fake_gpu: FakeTrt, gpu: Profile) -> None:
    """Defect 3: set_tensor_address's False names the tensor instead of a bare execute failure later."""
    from worker.backends.tensorrt import TensorRTBackend

    backend = TensorRTBackend(built_plan[0], gpu)
    fake_gpu.refuse_addresses.add("attention_mask")
    with pytest.raises(BackendError, match=r"set_tensor_address\('attention_mask'\) refused"):
        backend.create_context(0)
    assert fake_gpu.cuda.stack() == [] and fake_gpu.cuda.host_live == set()
    backend.close()
    assert fake_gpu.cuda.memory == {}


def test_the_bench_command_runs_on_tensorrt(built_plan: tuple[Path, Path], fake_gpu: FakeTrt, gpu: Profile,
                                            tmp_path: Path) -> None:
    """Defect 4: baselines on the context whose profile covers the batch, every context used on its own thread."""
    from worker import cli

    sample = ROOT / "tests" / "data" / "terabyte05-300.tsv"
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", str(sample), "--backend", "tensorrt", "--engine-path", str(built_plan[0]),
                   "--limit", "300", "--rounds", "2", "--no-latency", "--json", str(out), "--quiet"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["backend"] == {"name": "tensorrt", "plan": "minilm.plan"} and report["profile"] == "gpu"
    assert set(report["policies"]) == {"monolithic", "bucketed", "sorted"} and "compare" not in report
    # Every context ran only on the thread that created it (the fake asserts it), on its own profile,
    # and a monolithic batch of 256 ran in pieces its covering profile admits (else set_input_shape fails).
    engine = fake_gpu.engines[0]
    assert {c.profile for c in engine.contexts} == set(range(5))
    # On a fixed-shape plan every batch is padded to its profile's bound: the baselines waste more.
    waste = {k: v["padding_waste"] for k, v in report["policies"].items()}
    assert waste["bucketed"] <= waste["sorted"] <= waste["monolithic"]
    assert fake_gpu.cuda.memory == {} and fake_gpu.cuda.host_live == set() and fake_gpu.cuda.stack() == []
    # A second profile cannot run on a plan built for one.
    assert cli.main(["bench", str(sample), "--backend", "tensorrt", "--engine-path", str(built_plan[0]),
                     "--compare-profile", "cpu-aligned", "--quiet"]) == 2


def test_dispatchers_create_their_contexts_one_at_a_time(
        built_plan: tuple[Path, Path], fake_gpu: FakeTrt, gpu: Profile) -> None:
    """Defect 5: concurrent create_execution_context on one engine is not documented as safe."""
    from worker.backends.tensorrt import TensorRTBackend

    backend = TensorRTBackend(built_plan[0], gpu)
    go = threading.Barrier(5)

    def dispatcher(i: int) -> None:
        go.wait()  # all five at once, as the bucketer's dispatchers start
        backend.create_context(i).close()

    threads = [threading.Thread(target=dispatcher, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    engine = fake_gpu.engines[0]
    assert len(engine.contexts) == 5 and engine.concurrent_creates == 0
    backend.close()


def test_a_corrupt_timing_cache_is_replaced_not_a_type_error(
        tmp_path: Path, fake_gpu: FakeTrt, gpu: Profile) -> None:
    """Defect 6a: create_timing_cache returns None for a corrupt file; set_timing_cache(None) raises TypeError."""
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"corrupt\x00\x01")
    said: list[str] = []
    build_engine(_tiny_onnx(tmp_path / "m.onnx"), gpu, tmp_path / "p.plan", timing_cache=cache, log=said.append)
    assert any("unreadable" in m for m in said)
    assert cache.read_bytes() == b"+tuned"  # a fresh cache, saved after the build


def test_the_plan_is_built_on_the_device_its_sidecar_names(tmp_path: Path, fake_gpu: FakeTrt, gpu: Profile) -> None:
    """Defect 6b: on a multi-GPU host TensorRT builds on the current context's device: make it `device`'s."""
    fake_gpu.cuda.other_devices[1] = ("NVIDIA H100 80GB HBM3", (9, 0))
    sc = build_engine(_tiny_onnx(tmp_path / "m.onnx"), gpu, tmp_path / "p.plan", device=1, log=lambda _m: None)
    assert fake_gpu.built[0]["device"] == 1
    assert (sc.gpu_name, sc.compute_capability) == ("NVIDIA H100 80GB HBM3", "9.0")
    assert fake_gpu.cuda.stack() == []  # popped after the build


def test_fp16_checks_the_pooling_and_normalisation_compute_in_fp32(built_plan: tuple[Path, Path],
                                                                  fake_gpu: FakeTrt) -> None:
    """Defect 7, strongly typed: the floors 1e-9 and 1e-12 are 0 in half precision; the fp16 graph keeps
    those layers FP32 by Casts, and the build checks the parsed layers (no precision is set)."""
    from engines.build_engine import fp32_region
    from engines.onnx_export.export import build_model
    from engines.onnx_export.head import FP32_NODE_PREFIXES

    built = fake_gpu.built[0]
    network = built["network"]
    region = {network.get_layer(i).name for i in fp32_region(network)}
    named = {"masked_states_90_node", "pool_sum_91_node", "pool_count_92_node", "pool_count_c_93_node",
             "pooled_94_node", "norm_95_node", "norm_c_96_node", "sentence_embedding_node"}
    # Fix 5: also the layers the parser names otherwise: ReduceL2's square and root, the
    # constants of the floors (named after their initializers) and the shuffles broadcasting them.
    unnamed = {"count_min", "(Unnamed Layer* 93) [Shuffle]", "(Unnamed Layer* 95) [ElementWise]",
               "(Unnamed Layer* 96) [Unary]", "norm_min", "(Unnamed Layer* 97) [Shuffle]"}
    assert region == named | unnamed  # the encoder's layers, its Cast and the integer mask layers are not in it
    assert read_sidecar(built_plan[0]).extra["fp32_layers"] == 14
    # The names come from the real exporter: exactly its float pooling/normalisation nodes match.
    names = [n.name for n in build_model().graph.node]
    matched = [n for n in names if n.startswith(FP32_NODE_PREFIXES)]
    assert [re.sub(r"(_\d+)?_node$", "", n) for n in matched] == [
        "masked_states", "pool_sum", "pool_count", "pool_count_c", "pooled", "norm", "norm_c", "sentence_embedding"]


def test_an_fp32_build_parses_the_file_itself(tmp_path: Path, fake_gpu: FakeTrt, gpu: Profile) -> None:
    onnx_path = _tiny_onnx(tmp_path / "m.onnx")
    sc = build_engine(onnx_path, gpu, tmp_path / "p.plan", fp16=False, log=lambda _m: None)
    built = fake_gpu.built[0]
    assert built["config"].flags == set() and built["network"].onnx_path == str(onnx_path)
    assert sc.extra["fp32_layers"] == 0 and not fp16_onnx_path(tmp_path / "p.plan").exists()


def test_the_fake_detach_leaves_the_context_current_as_pycuda_does(fake_gpu: FakeTrt) -> None:
    """What fix 6 avoids: pycuda's detach() of a popped primary context pushes it, releases it, never pops."""
    cuda = fake_gpu.cuda
    ctx = cuda.Device(0).retain_primary_context()
    ctx.push()
    cuda.Context.pop()
    ctx.detach()
    assert cuda.left_current == [(threading.get_ident(), 0)] and cuda.retained == {0: 0}
    with pytest.raises(RuntimeError, match="cannot detach from invalid context"):
        ctx.detach()


def test_the_primary_context_is_retained_once_per_process(tmp_path: Path, fake_gpu: FakeTrt, gpu: Profile) -> None:
    """Fix 6: one retain for every build and backend of the process, no detach, nothing left current."""
    from worker.backends.tensorrt import TensorRTBackend

    onnx_path = _tiny_onnx(tmp_path / "m.onnx")
    plans = [tmp_path / "a.plan", tmp_path / "b.plan"]
    for plan in plans:
        build_engine(onnx_path, gpu, plan, log=lambda _m: None)
    for plan in plans * 2:  # backends one after the other, as trt_check's gpu and mono plans
        backend = TensorRTBackend(plan, gpu, onnx_path=onnx_path)
        run_in_thread(lambda b=backend: b.create_context(0).close())
        backend.close()
    failed_load = TensorRTBackend  # a load that fails after the retain leaves nothing behind either
    fake_gpu.fail_deserialize = True
    with pytest.raises(BackendError, match="could not deserialise"):
        failed_load(plans[0], gpu, onnx_path=onnx_path)
    cuda = fake_gpu.cuda
    assert cuda.retained == {0: 1} and cuda.detached == 0 and cuda.left_current == [] and cuda.stack() == []


def test_two_threads_starting_together_cannot_both_own_the_shared_memory(
        built_plan: tuple[Path, Path], fake_gpu: FakeTrt, gpu: Profile) -> None:
    """Fix 4b: the owner is claimed before the context is built, so a second thread is refused even mid-creation."""
    from worker.backends.tensorrt import TensorRTBackend

    backend = TensorRTBackend(built_plan[0], gpu, share_device_memory=True)
    go = threading.Barrier(2)
    outcome: dict[int, str] = {}

    def dispatcher(i: int) -> None:
        go.wait()  # the fake's create_execution_context takes 5 ms: both would pass an unclaimed check
        try:
            ctx = backend.create_context(i)
        except BackendError as exc:
            outcome[i] = str(exc)
            return
        outcome[i] = "created"
        time.sleep(0.05)
        ctx.close()

    threads = [threading.Thread(target=dispatcher, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcome.values())[0] == "created" and "ONE dispatcher thread" in sorted(outcome.values())[1]
    # Once the owner's last context closed, another thread may take over (one at a time).
    run_in_thread(lambda: backend.create_context(1).close())
    backend.close()
    assert fake_gpu.cuda.memory == {}


def test_direct_replay_runs_a_serial_backend_from_one_thread(
        built_plan: tuple[Path, Path], fake_gpu: FakeTrt, gpu: Profile) -> None:
    """Fix 4a: the overhead guard's replay keeps to one thread when contexts must not run at once."""
    from worker.backends.tensorrt import TensorRTBackend
    from worker.benchmark.policies import replay_direct, run_bucketed
    from worker.intake.tokenize import Encoded

    backend = TensorRTBackend(built_plan[0], gpu, share_device_memory=True)
    lengths = [5, 12, 30, 60, 200, 7, 16, 3, 40]
    encoded = [Encoded(ids=np.arange(1, n + 1, dtype=np.int64), length=n, truncated=False) for n in lengths]
    run = run_bucketed(encoded, gpu, backend)
    direct = replay_direct(encoded, run.formed, backend, threads=4)  # raised "ONE dispatcher thread" before
    assert direct.n == len(lengths) and direct.batches == len(run.formed)
    replay = fake_gpu.engines[0].contexts[-len({b.bucket for b in run.formed}):]
    assert len({c.thread for c in replay}) == 1 and {c.profile for c in replay} == {b.bucket for b in run.formed}
    backend.close()
    assert fake_gpu.cuda.memory == {} and fake_gpu.cuda.host_live == set() and fake_gpu.cuda.stack() == []


# ============================================================================ backend selection
def _spec(present: set[str]) -> Any:
    return lambda name: object() if name in present else None


def test_missing_gpu_packages_never_imports_them() -> None:
    assert missing_gpu_packages(_spec(set())) == ["tensorrt", "pycuda"]
    assert missing_gpu_packages(_spec({"tensorrt"})) == ["pycuda"]
    assert missing_gpu_packages(_spec({"tensorrt", "pycuda"})) == []

    def blocked(name: str) -> Any:
        raise ImportError(f"blocked {name}")

    assert missing_gpu_packages(blocked) == ["tensorrt", "pycuda"]


def test_gpu_present_reads_device_nodes_and_cuda_visible_devices(tmp_path: Path) -> None:
    (tmp_path / "nvidia0").touch()
    pattern = str(tmp_path / "nvidia[0-9]*")
    assert gpu_present({}, pattern) is True
    assert gpu_present({"CUDA_VISIBLE_DEVICES": ""}, pattern) is False
    assert gpu_present({"CUDA_VISIBLE_DEVICES": "-1"}, pattern) is False
    assert gpu_present({"CUDA_VISIBLE_DEVICES": "0"}, pattern) is True
    assert gpu_present({}, str(tmp_path / "none[0-9]*")) is False


def test_auto_picks_tensorrt_only_with_extra_gpu_and_plan(tmp_path: Path) -> None:
    plan = tmp_path / "p.plan"
    plan.write_bytes(b"x")
    everything = {"find_spec": _spec({"tensorrt", "pycuda"}), "has_gpu": lambda: True}
    s = Settings(engine_path=str(plan))
    assert choose_backend(s, **everything).backend == "tensorrt"
    c = choose_backend(s, find_spec=_spec({"tensorrt"}), has_gpu=lambda: True)
    assert c.backend == "onnxruntime" and "pycuda" in c.reason
    assert choose_backend(s, find_spec=everything["find_spec"], has_gpu=lambda: False).backend == "onnxruntime"
    assert choose_backend(Settings(), **everything).backend == "onnxruntime"  # no engine_path
    c = choose_backend(Settings(engine_path=str(tmp_path / "missing.plan")), **everything)
    assert c.backend == "onnxruntime" and "does not exist" in c.reason
    assert choose_backend(Settings(backend="onnxruntime", engine_path=str(plan)), **everything).backend == "onnxruntime"


def test_explicit_tensorrt_names_what_is_missing(tmp_path: Path) -> None:
    plan = tmp_path / "p.plan"
    plan.write_bytes(b"x")
    s = Settings(backend="tensorrt", engine_path=str(plan))
    with pytest.raises(BackendError) as exc:
        choose_backend(s, find_spec=_spec({"tensorrt"}), has_gpu=lambda: True)
    assert "missing: pycuda" in str(exc.value) and GPU_INSTALL_HINT in str(exc.value)
    assert "tensorrt," not in str(exc.value)
    with pytest.raises(BackendError, match="no NVIDIA GPU"):
        choose_backend(s, find_spec=_spec({"tensorrt", "pycuda"}), has_gpu=lambda: False)
    with pytest.raises(BackendError, match="--engine-path"):
        choose_backend(Settings(backend="tensorrt"), find_spec=_spec({"tensorrt", "pycuda"}), has_gpu=lambda: True)
    with pytest.raises(BackendError, match="does not exist"):
        choose_backend(Settings(backend="tensorrt", engine_path=str(tmp_path / "nope")),
                       find_spec=_spec({"tensorrt", "pycuda"}), has_gpu=lambda: True)


def test_profile_auto_follows_the_backend() -> None:
    assert resolve_profile_name(Settings(), "tensorrt") == "gpu"
    assert resolve_profile_name(Settings(), "onnxruntime") == "cpu"
    assert resolve_profile_name(Settings(profile="cpu-aligned"), "tensorrt") == "cpu-aligned"


class _FakeOrt:
    """Stands in for OnnxRuntimeBackend: records how the factory built it."""

    made: list[tuple[Any, dict[str, Any]]] = []
    name, dim = "onnxruntime", DIM

    def __init__(self, onnx_path: Any, **kw: Any) -> None:
        self.path = onnx_path
        self.closed = False
        _FakeOrt.made.append((onnx_path, kw))

    def close(self) -> None:
        self.closed = True


def _fake_ort(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, dict[str, Any]]]:
    fake = types.ModuleType("worker.backends.onnxruntime")
    fake.OnnxRuntimeBackend = _FakeOrt  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "worker.backends.onnxruntime", fake)
    monkeypatch.setattr(_FakeOrt, "made", [])
    return _FakeOrt.made


def test_load_backend_onnxruntime_with_profile_and_onnx_path(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _fake_ort(monkeypatch)
    loaded = load_backend(Settings(onnx_path="/m/x.onnx", intra_op_threads=3, ort_allow_spinning=False),
                          find_spec=_spec(set()), has_gpu=lambda: False)
    assert isinstance(loaded.backend, _FakeOrt) and made == [("/m/x.onnx", {"intra_op_threads": 3, "allow_spinning": False})]
    assert loaded.profile.name == "cpu" and loaded.profile.max_len == 256
    # Every "auto" is resolved where the settings are read: nothing after this sees the word.
    assert (loaded.settings.backend, loaded.settings.profile, loaded.settings.pad_to) == ("onnxruntime", "cpu",
                                                                                          "longest")
    assert loaded.model.dim == DIM

    export = types.ModuleType("engines.onnx_export.export")
    export.ensure_onnx = lambda model, **kw: f"/cache/{model.name}.onnx"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "engines.onnx_export.export", export)
    load_backend(Settings(), find_spec=_spec(set()), has_gpu=lambda: False)
    # default: the cached export of the model already read (not the folder read again)
    assert made[-1][0] == "/cache/all-MiniLM-L6-v2.onnx"
    # An explicit pad_to wins over the profile's.
    assert load_backend(Settings(onnx_path="/m/x.onnx", pad_to="bucket"), find_spec=_spec(set()),
                        has_gpu=lambda: False).settings.pad_to == "bucket"


def test_the_factory_refuses_a_backend_of_another_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.backend_choice.select import model_info, open_backend

    _fake_ort(monkeypatch)
    monkeypatch.setattr(_FakeOrt, "dim", 768)
    with pytest.raises(BackendError, match=r"768-d vectors but the model in .* gives 384 \(Pooling mean -> Normalize\)"):
        open_backend("onnxruntime", model_info(Settings()), onnx_path="/m/bert-base.onnx")
    with pytest.raises(BackendError, match="needs a plan"):
        open_backend("tensorrt", model_info(Settings()))


def test_load_backend_tensorrt_passes_plan_profile_and_onnx(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import worker.backends.tensorrt as trt_backend

    plan = tmp_path / "p.plan"
    plan.write_bytes(b"x")
    made: list[tuple[Any, ...]] = []

    class Fake:
        name, dim = "tensorrt", DIM

        def __init__(self, engine_path: Any, profile: Profile, **kw: Any) -> None:
            made.append((engine_path, profile.name, kw))

    monkeypatch.setattr(trt_backend, "TensorRTBackend", Fake)
    loaded = load_backend(Settings(engine_path=str(plan), onnx_path="/m/x.onnx"),
                          find_spec=_spec({"tensorrt", "pycuda"}), has_gpu=lambda: True)
    assert isinstance(loaded.backend, Fake) and loaded.profile.name == "gpu"
    assert loaded.profile.bounds == (8, 16, 32, 64, 256)
    assert made == [(str(plan), "gpu", {"onnx_path": "/m/x.onnx", "share_device_memory": False})]
    assert (loaded.settings.backend, loaded.settings.profile, loaded.settings.pad_to) == ("tensorrt", "gpu", "bucket")


def test_load_backend_stretches_a_profile_short_of_the_model_max_or_refuses_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing may be truncated below the model's own limit: the overflow bucket reaches it,
    # within the profile's token budget (64 x 8 = 512 padded tokens: two items of 256).
    short = tmp_path / "p.toml"
    short.write_text('[profiles.cpu]\nbuckets = [{ max_len = 64, max_batch = 8 }]\n')
    _fake_ort(monkeypatch)
    loaded = load_backend(Settings(profiles_file=str(short), onnx_path="/m/x.onnx"), find_spec=_spec(set()),
                          has_gpu=lambda: False)
    assert loaded.profile.bounds == (256,) and loaded.profile.batch_limit(0) == 2
    assert "overflow bucket stretched from 64 to 256 tokens" in loaded.profile.description
    short.write_text('[profiles.cpu]\ntoken_budget = 128\nbuckets = [{ max_len = 64, max_batch = 2 }]\n')
    with pytest.raises(ProfileError, match="ends at 64 tokens, the model takes 256, and the bucket cannot be "
                                           "stretched \\(its token_budget 128 cannot hold one\\)"):
        load_backend(Settings(profiles_file=str(short)), find_spec=_spec(set()), has_gpu=lambda: False)


# ============================================================================ CLI without tensorrt
def test_build_engine_cli_without_tensorrt_exits_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import main

    # None in sys.modules makes `import tensorrt` fail, even on a machine that has it.
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    onnx_path = _tiny_onnx(tmp_path / "m.onnx")
    rc = main(["build-engine", "--onnx", str(onnx_path), "--output", str(tmp_path / "p.plan")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("keyword-embedder build-engine: ") and "tensorrt" in err and GPU_INSTALL_HINT in err
    assert "Traceback" not in err and not (tmp_path / "p.plan").exists()
    with pytest.raises(GpuExtraMissingError):
        from engines.build_engine import import_gpu_extra

        import_gpu_extra()


def test_build_engine_cli_check_says_whether_a_kept_plan_fits(
        built_plan: tuple[Path, Path], fake_gpu: FakeTrt, capsys: pytest.CaptureFixture[str]) -> None:
    """`build-engine --check`: 0 when the plan fits, 1 (with the reason) when it must be rebuilt."""
    from worker.cli import main

    plan, onnx_path = built_plan
    check = ["build-engine", "--profile", "gpu", "--onnx", str(onnx_path), "--output", str(plan), "--check"]
    built = len(fake_gpu.built)
    assert main(check) == 0
    assert "fits this GPU" in capsys.readouterr().err
    # Another GPU model (the plan was built on an L40S).
    fake_gpu.cuda.gpu_name = "NVIDIA H200"
    assert main(check) == 1
    err = capsys.readouterr().err
    assert "foreign: built on GPU 'NVIDIA L40S', this GPU is 'NVIDIA H200'" in err and "Traceback" not in err
    fake_gpu.cuda.gpu_name = "NVIDIA L40S"
    # Another ONNX file.
    onnx_path.write_bytes(onnx_path.read_bytes() + b"\0")
    assert main(check) == 1
    assert "stale: built from an ONNX file" in capsys.readouterr().err
    # No plan at all.
    missing = [*check[:-2], str(plan.parent / "none.plan"), "--check"]
    assert main(missing) == 1
    assert "not found" in capsys.readouterr().err
    assert len(fake_gpu.built) == built, "--check never builds"


def test_build_engine_cli_rejects_an_unaligned_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import main

    rc = main(["build-engine", "--profile", "cpu", "--output", str(tmp_path / "p.plan")])
    assert rc == 2 and "multiple of 8" in capsys.readouterr().err


# ============================================================================ benchmarks/gpu/ (the whole check: tests/unit/benchmarks/gpu/test_gpu_scripts.py)
def test_cosines_of_rows() -> None:
    from benchmarks.gpu.trt_check import cosines

    a = np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    b = np.array([[2.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    np.testing.assert_allclose(cosines(a, b), [1.0, np.sqrt(0.5), 0.0])
