"""A worker pipeline run in this process against the real broker, on the real model with a backend
that fails on a schedule: the only way to hand a worker a failing backend. Shared by the broker
and system tests (the fixture `loaded` is imported into a test module to be used there)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from worker.app import wire_pipeline
from worker.formats.messages import OutputCodec
from worker.pipeline import Pipeline
from worker.settings.schema import Settings


@pytest.fixture(scope="module")
def loaded() -> tuple[Any, Any, Any]:
    """The real tokenizer, ONNX Runtime backend and profile, loaded once for the module."""
    from worker.backend_choice.select import load_backend
    from worker.intake.tokenize import KeywordTokenizer

    got = load_backend(Settings(intra_op_threads=1))
    return KeywordTokenizer.from_model(got.model), got.backend, got.profile


class FaultyBackend:
    """The real backend, its contexts failing on a schedule: `fail(call_no, ids)` says when."""

    def __init__(self, backend: Any, fail: Callable[[int, np.ndarray], bool]) -> None:
        self._backend = backend
        self._fail = fail
        self._calls = 0
        self._lock = threading.Lock()
        self.failures = 0
        self.name, self.dim = backend.name, backend.dim
        self.max_contexts = backend.max_contexts
        self.requires_serial_dispatch = backend.requires_serial_dispatch

    def create_context(self, index: int) -> Any:
        inner, outer = self._backend.create_context(index), self

        class Ctx:
            def run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
                with outer._lock:
                    outer._calls += 1
                    call = outer._calls
                if outer._fail(call, ids):
                    with outer._lock:
                        outer.failures += 1
                    raise RuntimeError(f"injected backend fault on call {call}")
                return inner.run(ids, mask)

            def close(self) -> None:
                inner.close()

        return Ctx()

    def close(self) -> None:
        pass


class InProcessWorker:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.code: int | None = None
        self._thread = threading.Thread(target=self._run, name="test-worker")

    def _run(self) -> None:
        self.code = self.pipeline.run()

    def start(self) -> InProcessWorker:
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> int | None:
        self.pipeline.request_stop()
        return self.join(timeout)

    def join(self, timeout: float) -> int | None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the pipeline did not return"
        return self.code


def in_process(loaded: tuple[Any, Any, Any], bootstrap: str, names: tuple[str, str, str], group: str,
               fail: Callable[[int, np.ndarray], bool], **settings: Any) -> tuple[InProcessWorker, FaultyBackend]:
    tokenizer, backend, profile = loaded
    faulty = FaultyBackend(backend, fail)
    s = Settings(bootstrap_servers=bootstrap, input_topic=names[0], output_topic=names[1],
                 dead_letter_topic=names[2], group_id=group, pad_to=profile.pad_to, **settings)
    return InProcessWorker(wire_pipeline(s, tokenizer=tokenizer, backend=faulty, profile=profile,
                                         model_name="all-MiniLM-L6-v2",
                                         codec=OutputCodec(model="all-MiniLM-L6-v2", dim=384,
                                                           encoding="float-list"))), faulty


def topics(make_topic: Callable[..., str], partitions: int) -> tuple[str, str, str]:
    return make_topic("kw", partitions), make_topic("emb", partitions), make_topic("dlq", 1)
