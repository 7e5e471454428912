"""The int8 path: which MatMuls the shipped recipe quantizes, its quality on the golden rows,
its cache beside the fp32 export, and how the settings reach it."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from engines.quantize_int8 import SHIPPED, QuantizeError, excluded_nodes, matmul_names, quantized_op_counts
from worker.backend_choice.select import load_backend
from worker.backends.base import BackendError
from worker.settings.loader import load_settings
from worker.settings.schema import Settings, SettingsError
from tests.conftest import DATA

GOLDEN = DATA / "golden"


@pytest.fixture(scope="module")
def fp32_model() -> onnx.ModelProto:
    from engines.onnx_export.export import ensure_onnx

    return onnx.load(str(ensure_onnx()))


def test_measured_rule_keeps_only_query_key_and_attention_output_int8(fp32_model: onnx.ModelProto) -> None:
    names = matmul_names(fp32_model)
    excluded = set(excluded_nodes(fp32_model, "measured"))
    quantized = [n for n in names if n not in excluded]
    assert len(names) == 48 and len(quantized) == 18  # 6 layers x (Q, K, attention output)
    assert all(any(k in n for k in (".self.query.", ".self.key.", ".attention.output.dense.")) for n in quantized)
    assert not any(".self.value." in n or "intermediate" in n for n in quantized)


def test_sensitive_rule_leaves_attention_products_outputs_and_last_layer(fp32_model: onnx.ModelProto) -> None:
    excluded = excluded_nodes(fp32_model, "sensitive")
    assert all(f"encoder.layer.5.{part}" in " ".join(excluded)
               for part in ("attention.self.query", "intermediate.dense", "output.dense"))
    assert sum(".attention.output.dense." in n for n in excluded) == 6
    assert sum(("qk_" in n or "ctx_" in n) for n in excluded) == 12
    assert excluded_nodes(fp32_model, "none") == []


def test_exclusion_needs_the_exporters_names() -> None:
    renamed = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["a", "b"], ["c"], name="mm0")], "g",
        [onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [1, 1]),
         onnx.helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [1, 1])],
        [onnx.helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [1, 1])]))
    with pytest.raises(QuantizeError, match="encoder.layer.N"):
        excluded_nodes(renamed, "measured")


def test_int8_embedder_meets_the_golden_gate_and_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.quantize_int8 import ensure_int8_onnx, int8_cached_path
    from worker import Embedder

    rows = [json.loads(line) for line in (GOLDEN / "dev.jsonl").read_text(encoding="utf-8").splitlines()]
    ref = np.load(GOLDEN / "dev.npy")
    with Embedder(precision="int8", cache_bytes=0) as emb:
        assert emb.onnx_path == int8_cached_path()
        ops = quantized_op_counts(emb.onnx_path)
        assert ops.get("MatMulInteger") == 18  # really the int8 graph
        vec = emb.embed([r["text"] for r in rows])
    cos = (vec * ref).sum(1) / (np.linalg.norm(vec, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.99, [(rows[i]["id"], float(cos[i])) for i in np.argsort(cos)[:3]]
    assert cos.min() < 0.99999  # not the fp32 graph under another name
    # Cached: a second call returns the file without quantizing again.
    path = ensure_int8_onnx()
    mtime = path.stat().st_mtime_ns
    import engines.quantize_int8 as q

    monkeypatch.setattr(q, "quantize", lambda *a, **k: pytest.fail("quantized again"))
    assert ensure_int8_onnx() == path and path.stat().st_mtime_ns == mtime
    # A fresh cache dir builds it beside that dir's fp32 export.
    monkeypatch.undo()
    other = ensure_int8_onnx(cache_dir=tmp_path)
    assert other.parent == tmp_path and other.name.startswith(int8_cached_path().name.split("-int8-")[0])


def test_embedder_precision_arguments() -> None:
    from worker import Embedder

    with pytest.raises(ValueError, match="precision must be one of fp32, int8"):
        Embedder(precision="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not combine"):
        Embedder(precision="int8", onnx_path="/x.onnx")


def test_precision_setting() -> None:
    assert Settings().precision == "fp32"
    assert load_settings(env={"KWE_PRECISION": "int8"}).precision == "int8"
    with pytest.raises(SettingsError, match="'precision': 'int4' is not one of fp32, int8"):
        load_settings(env={"KWE_PRECISION": "int4"})


def test_load_backend_int8_uses_the_cached_int8_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []
    fake = types.ModuleType("worker.backends.onnxruntime")

    class OnnxRuntimeBackend:
        dim = 384

        def __init__(self, onnx_path: Any, **kw: Any) -> None:
            made.append(onnx_path)

        def close(self) -> None:
            pass

    fake.OnnxRuntimeBackend = OnnxRuntimeBackend  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "worker.backends.onnxruntime", fake)
    quant = types.ModuleType("engines.quantize_int8")
    quant.ensure_int8_onnx = lambda model_dir=None, **kw: f"/cache/{model_dir}-int8.onnx"  # type: ignore[attr-defined]
    quant.QuantizeError = RuntimeError  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "engines.quantize_int8", quant)
    none = lambda name: None  # noqa: E731
    load_backend(Settings(precision="int8"), find_spec=none, has_gpu=lambda: False)
    assert str(made[-1]).startswith("/cache/") and str(made[-1]).endswith("-int8.onnx")
    load_backend(Settings(precision="int8", onnx_path="/m/x.onnx"), find_spec=none, has_gpu=lambda: False)
    assert made[-1] == "/m/x.onnx"  # an explicit graph wins


def test_tensorrt_refuses_int8(tmp_path: Path) -> None:
    plan = tmp_path / "p.plan"
    plan.write_bytes(b"x")
    present = lambda name: object()  # noqa: E731
    with pytest.raises(BackendError, match="'precision': 'int8' is for the onnxruntime backend"):
        load_backend(Settings(precision="int8", engine_path=str(plan)), find_spec=present, has_gpu=lambda: True)
