"""The fp16 graph a strongly typed TensorRT build parses (engines/fp16_onnx.py), checked in ONNX Runtime on CPU.

What TensorRT does with it needs a GPU; what can be shown here is that the graph is valid, that
its pooling and normalisation compute in float32, and that it keeps cos >= 0.9999 to the
float32 graph on the golden rows (the check NVIDIA's migration notes ask for before any
TensorRT build) for the default model and every family and pipeline fixture.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.fp16_onnx import PARITY_MIN_COS, Fp16Error, check_types, fp32_region, parity, to_fp16, write_fp16_onnx
from engines.onnx_export.export import build_model, ensure_onnx
from engines.onnx_export.graph import OUTPUT_NAME
from engines.onnx_export.head import FP32_NODE_PREFIXES
from worker.batching.padding import length_batches, pad_batch
from worker.core.model import ModelInfo, default_model_dir
from worker.families.dense import pipeline_fixtures, pipeline_folder
from worker.intake.tokenize import KeywordTokenizer
from tests.conftest import DATA

GOLDEN = [json.loads(line)["text"] for line in (DATA / "golden" / "dev.jsonl").read_text().splitlines()]


def _golden_batches(info: ModelInfo, size: int = 32) -> list[tuple[np.ndarray, np.ndarray]]:
    """The golden texts in batches of similar length (the long rows nearly alone: fp16 on ORT's CPU
    kernels is slow, and padding would only add time)."""
    enc = KeywordTokenizer.from_model(info).encode(GOLDEN)
    groups = length_batches([len(e.ids) for e in enc], size)
    return [pad_batch([enc[i].ids for i in rows]) for rows in groups]


@pytest.fixture(scope="module")
def minilm() -> tuple[ModelInfo, onnx.ModelProto, onnx.ModelProto]:
    info = ModelInfo.from_dir(default_model_dir())
    model = onnx.load(str(ensure_onnx(info)))
    return info, model, to_fp16(model)


def test_the_default_model_in_fp16_keeps_the_golden_rows(minilm: tuple[ModelInfo, onnx.ModelProto, onnx.ModelProto]) -> None:
    info, model, half = minilm
    cos = parity(model, half, _golden_batches(info))
    assert len(cos) == len(GOLDEN) and cos.min() >= PARITY_MIN_COS, cos.min()


def test_the_fp16_graph_types(minilm: tuple[ModelInfo, onnx.ModelProto, onnx.ModelProto]) -> None:
    info, model, half = minilm
    # Inputs int64 and the output float32, as the backend stages and reads them.
    assert [i.type.tensor_type.elem_type for i in half.graph.input] == [TensorProto.INT64] * 2
    assert [o.type.tensor_type.elem_type for o in half.graph.output] == [TensorProto.FLOAT]
    counts = check_types(half)  # raises if a pooling/normalisation node computes in float16
    assert counts["fp16_nodes"] > 5 * counts["fp32_nodes"] > 0  # the LayerNorms and their Casts, the pooling
    # The weights are float16 (the file halves) except the LayerNorms' and the pooling's.
    kinds = {init.name: init.data_type for init in half.graph.initializer}
    assert kinds[next(n for n in kinds if n.endswith("attention.self.query.weight") or "query.weight" in n)] \
        == TensorProto.FLOAT16
    assert all(t == TensorProto.FLOAT for n, t in kinds.items() if "LayerNorm" in n)
    assert half.ByteSize() < 0.6 * model.ByteSize()
    # Every LayerNorm computes in float32, between a Cast in and a Cast out (no fp32 -> fp16 -> fp32
    # round trip into the pooling: the last LayerNorm feeds it its float32 value directly).
    layer_norms = [n for n in half.graph.node if n.op_type == "LayerNormalization"]
    assert len(layer_norms) == 1 + 2 * info.num_layers
    assert all(n.output[0].endswith("_fp32") for n in layer_norms)
    masked = next(n for n in half.graph.node if n.name.startswith("masked_states"))
    assert masked.input[0] == layer_norms[-1].output[0]
    # The attention mask's Cast now makes float16 (0, 1 and the -10000 fill are exact there).
    mask_cast = next(n for n in half.graph.node if n.name.startswith("mask_f"))
    assert mask_cast.attribute[0].i == TensorProto.FLOAT16
    meta = {p.key: p.value for p in half.metadata_props}
    assert meta["precision"] == "fp16-strong" and meta["layernorm_fp32"] == "true" and meta["dim"] == "384"


def test_the_region_is_the_pooling_and_everything_after_it(minilm: tuple[ModelInfo, onnx.ModelProto, onnx.ModelProto]) -> None:
    _, model, _ = minilm
    region = fp32_region(model)
    assert all(name.startswith(FP32_NODE_PREFIXES) for name in region)
    assert any(name.startswith(OUTPUT_NAME) for name in region) and len(region) == 8


@pytest.mark.parametrize("family", ["bert", "distilbert", "mpnet", "roberta", "xlm-roberta"])
def test_every_family_fixture_in_fp16_keeps_its_rows(family: str) -> None:
    info = ModelInfo.from_dir(DATA / "families" / family)
    model = build_model(info)
    assert parity(model, to_fp16(model), _golden_batches(info)).min() >= PARITY_MIN_COS


@pytest.mark.parametrize("fixture", pipeline_fixtures(DATA / "pipelines"), ids=lambda p: p.name)
def test_every_pipeline_fixture_in_fp16_keeps_its_rows(fixture: Path, tmp_path: Path) -> None:
    """cls, max, lasttoken, weightedmean, Dense layers, no Normalize, an excluded prompt: all in the fp32 region."""
    info = ModelInfo.from_dir(pipeline_folder(fixture, tmp_path, families=DATA / "families"))
    tokenizer = KeywordTokenizer.from_model(info)
    info = info.with_prompt(tokenizer.prompt_tokens)
    model = build_model(info)
    half = to_fp16(model)
    check_types(half)
    enc = tokenizer.encode(GOLDEN)
    batches = [pad_batch([e.ids for e in enc[i:i + 32]]) for i in range(0, len(enc), 32)]
    assert parity(model, half, batches).min() >= PARITY_MIN_COS


def test_layernorm_may_run_in_fp16_too() -> None:
    info = ModelInfo.from_dir(DATA / "families" / "bert")
    model = build_model(info)
    half = to_fp16(model, layernorm_fp32=False)
    assert not any(n.output[0].endswith("_fp32") for n in half.graph.node if n.op_type == "LayerNormalization")
    assert parity(model, half, _golden_batches(info)).min() >= PARITY_MIN_COS


def test_the_weights_stored_as_fp16_for_the_device_convert_too(tmp_path: Path,
                                                                minilm: tuple[ModelInfo, onnx.ModelProto, onnx.ModelProto]) -> None:
    """benchmarks/gpu/prepare_device.py's file (weights stored fp16, Cast to float at load; its Cast
    nodes have no names), which the GPU run's TensorRT build gets."""
    from benchmarks.gpu.prepare_device import f16_store

    info, model, _ = minilm
    f16_store(ensure_onnx(info), tmp_path / "store.onnx")
    out = write_fp16_onnx(tmp_path / "store.onnx", tmp_path / "p.plan.fp16.onnx")
    assert parity(model, onnx.load(str(out)), _golden_batches(info)[:2]).min() >= PARITY_MIN_COS


def test_a_graph_not_from_the_exporter_or_beyond_fp16_is_refused(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input_ids"], [OUTPUT_NAME])], "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.INT64, ["b", "s"])])
    with pytest.raises(Fp16Error, match="not written by this project's exporter.*--no-fp16"):
        to_fp16(helper.make_model(graph))

    model = build_model(DATA / "families" / "bert")
    weight = next(i for i in model.graph.initializer if i.name.startswith("word_embeddings"))
    values = numpy_helper.to_array(weight).copy()
    values[0, 0] = 1e6
    weight.CopyFrom(numpy_helper.from_array(values, weight.name))
    with pytest.raises(Fp16Error, match="holds 1e\\+06, beyond float16's 65504"):
        to_fp16(model)
    (tmp_path / "bad.onnx").write_bytes(b"not onnx")
    with pytest.raises(Fp16Error, match="not a readable ONNX model"):
        write_fp16_onnx(tmp_path / "bad.onnx", tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()
