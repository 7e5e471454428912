"""From Settings to a pipeline: the model folder read once, "auto" resolved, the backend closed at exit."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from kwe_core.errors import BackendError
from kwe_core.model import ModelInfo
from worker.config import Settings


class FakeOrtContext:
    def run(self, input_ids: Any, attention_mask: Any) -> Any:
        import numpy as np

        return np.zeros((input_ids.shape[0], 384), dtype=np.float32)

    def close(self) -> None:
        pass


class FakeOrt:
    name, dim = "onnxruntime", 384
    max_contexts: int | None = None
    requires_serial_dispatch = False

    def __init__(self, onnx_path: Any, **kw: Any) -> None:
        self.closes = 0
        self.refuse: str | None = None

    def create_context(self, index: int) -> FakeOrtContext:
        return FakeOrtContext()

    def close(self) -> None:
        self.closes += 1
        if self.refuse:
            raise BackendError(self.refuse)


class RecordingPipeline:
    def __init__(self, settings: Settings, **kw: Any) -> None:
        self.settings, self.kw = settings, kw


@pytest.fixture()
def assembled(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[Any]]:
    import worker.app as app

    fake = types.ModuleType("worker.backends.onnxruntime")
    fake.OnnxRuntimeBackend = FakeOrt  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "worker.backends.onnxruntime", fake)
    monkeypatch.setattr(app, "Pipeline", RecordingPipeline)
    reads: list[Any] = []
    real = ModelInfo.from_dir.__func__  # type: ignore[attr-defined]

    def counting(cls: type[ModelInfo], path: Any) -> ModelInfo:
        reads.append(path)
        return real(cls, path)

    monkeypatch.setattr(ModelInfo, "from_dir", classmethod(counting))
    # No GPU here, so "auto" picks ONNX Runtime whatever this machine has installed.
    result = app.build_pipeline(Settings(backend="onnxruntime", onnx_path="/m/x.onnx"))
    return result, reads


def test_the_model_folder_is_read_once_per_start(assembled: tuple[Any, list[Any]]) -> None:
    result, reads = assembled
    assert len(reads) == 1
    assert result.pipeline.kw["tokenizer"].max_len == 256 and result.pipeline.kw["model_name"] == "all-MiniLM-L6-v2"


def test_the_pipeline_gets_settings_with_no_auto_left(assembled: tuple[Any, list[Any]]) -> None:
    result, _ = assembled
    s = result.pipeline.settings
    assert (s.backend, s.profile, s.pad_to) == ("onnxruntime", "cpu", "longest")
    assert result.pipeline.kw["profile"].name == "cpu" and result.pipeline.kw["backend"] is result.backend


def test_the_backend_is_closed_after_the_run_and_a_refusal_is_only_logged(
        assembled: tuple[Any, list[Any]]) -> None:
    result, _ = assembled
    result.close()
    assert result.backend.closes == 1
    result.backend.refuse = "1 TensorRT context(s) still open"
    result.close()  # logged, not raised: the process is exiting
    assert result.backend.closes == 2
