"""From Settings to a pipeline: the model folder read once, "auto" resolved, the backend closed at exit;
the stages built in worker/app.py alone (one assembly place, issue 36), the Pipeline only runs them."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from worker.core.errors import BackendError
from worker.core.model import ModelInfo
from worker.core.profiles import Bucket, Profile
from tests.conftest import ROOT
from tests.fakes.consumer import FakeGroupConsumer
from tests.unit.worker.test_pipeline_start import _NoContexts, _Producer, _Tokenizer
from worker.app import wire_pipeline
from worker.formats.messages import OutputCodec
from worker.pipeline import Shutdown
from worker.settings.schema import Settings

ASSEMBLY = "worker/app.py"
# What the worker's pipeline is made of: each built in one place.
STAGES = {"InFlightTable", "FlowControl", "Acknowledger", "Committer",
          "build_delivery", "DeadLetters", "OutputStage", "IsolatingBackend", "Intake", "Liveness", "Shutdown",
          "Stages", "Pipeline"}


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
    monkeypatch.setattr(app, "wire_pipeline", RecordingPipeline)
    reads: list[Any] = []
    real = ModelInfo.from_dir.__func__  # type: ignore[attr-defined]

    def counting(cls: type[ModelInfo], path: Any, **options: Any) -> ModelInfo:
        reads.append(path)
        return real(cls, path, **options)

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


def _called_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else "")
    return names


def test_the_stages_are_built_in_worker_app_alone() -> None:
    # Before: worker/pipeline.py built all of them in Pipeline.__init__ (a second assembly place).
    # The two Kafka clients are opened together (worker/kafka/clients.py), as build_delivery makes
    # the guarantee's parts: from app.py, and nowhere else.
    built = {str(path.relative_to(ROOT)): sorted(_called_names(path) & STAGES)
             for path in sorted((ROOT / "worker").rglob("*.py")) if str(path.relative_to(ROOT)) != ASSEMBLY}
    assert {path: names for path, names in built.items() if names} == {}
    assert _called_names(ROOT / ASSEMBLY) >= STAGES
    clients = {str(path.relative_to(ROOT)) for path in (ROOT / "worker").rglob("*.py")
               if _called_names(path) & {"OutputProducer", "GroupMember"}}
    assert clients == {"worker/kafka/clients.py"}


def test_wire_pipeline_hands_the_pipeline_its_parts_sharing_one_latch_and_one_deadline() -> None:
    profile = Profile("test", (Bucket(8, 4, 4), Bucket(16, 4, 4)), token_budget=64, pad_to="bucket")
    s = Settings(input_format="raw", pad_to="bucket", shutdown_timeout_s=2.0)
    pipeline = wire_pipeline(s, tokenizer=_Tokenizer(), backend=_NoContexts(), profile=profile, model_name="m",
                             codec=OutputCodec(model="m", dim=4, encoding="float-list"),
                             consumer_factory=lambda config: FakeGroupConsumer(config),
                             producer_factory=_Producer)
    member, producer = pipeline._member, pipeline._producer  # noqa: SLF001 - what was wired in
    assert member._latch is pipeline.latch and producer._latch is pipeline.latch  # noqa: SLF001
    assert member._revoke_wait_s() == s.revoke_timeout_s  # noqa: SLF001 - not stopping: the setting
    pipeline.request_stop()
    pipeline.request_stop()  # the second request aborts: the member's revocations stop waiting
    assert member._revoke_wait_s() == 0.0  # noqa: SLF001


def test_the_revoke_wait_is_the_setting_within_the_drain_and_nothing_once_aborting() -> None:
    shutdown = Shutdown(Settings(revoke_timeout_s=5.0))
    assert shutdown.revoke_wait_s() == 5.0  # no stop requested: the deadline is not running
    shutdown.deadline.start(8.0)  # the drain ends 6 s before the deadline: 2 s left
    assert 1.5 < shutdown.revoke_wait_s() <= 2.0
    shutdown.abort.set()
    assert shutdown.revoke_wait_s() == 0.0


def test_the_pipeline_is_not_changed_after_it_is_built() -> None:
    # What the commands decide (the overrun's exit, where the interpreter's hold starts) and what the
    # assembly knows (the model's identity) are handed to the Pipeline when it is built: nothing
    # outside pipeline.py sets one of its attributes afterwards.
    assigned = []
    for path in sorted((ROOT / "worker").rglob("*.py")):
        if path == ROOT / "worker" / "pipeline.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "pipeline"):
                    assigned.append(f"{path.relative_to(ROOT)}:{node.lineno}: pipeline.{target.attr}")
    assert not assigned, f"the Pipeline changed after it was built (pass it to wire_pipeline instead): {assigned}"
