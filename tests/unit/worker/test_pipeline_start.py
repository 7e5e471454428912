"""The worker's start with fake clients: a backend that cannot create its contexts stops the
worker like any other fatal error (exit 1, one line), and the shutdown still runs (the group
member closed, the producer's delivery thread ended)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from worker.core.profiles import Bucket, Profile
from tests.fakes.consumer import FakeGroupConsumer
from worker.app import wire_pipeline
from worker.formats.messages import OutputCodec
from worker.batching.bucketer import BucketerError
from worker.settings.schema import Settings


@dataclass
class _Encoded:
    ids: np.ndarray


class _Tokenizer:
    def encode(self, texts: list[str]) -> list[_Encoded]:
        return [_Encoded(np.array([101, len(t), 102], dtype=np.int64)) for t in texts]


class _NoContexts:
    """A backend that loads but cannot create a context (a GPU out of memory, say)."""

    name = "onnxruntime"
    dim = 4
    max_contexts = None
    requires_serial_dispatch = False

    def create_context(self, index: int) -> Any:
        raise RuntimeError("out of device memory")

    def close(self) -> None:
        pass


class _Producer:
    def __init__(self, config: dict[str, Any]) -> None:
        self.polled_on: set[str] = set()

    def produce(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("nothing is produced before the worker started")

    def poll(self, timeout: float) -> int:
        self.polled_on.add(threading.current_thread().name)
        threading.Event().wait(min(timeout, 0.005))
        return 0

    def flush(self, timeout: float = 0) -> int:
        return 0


def test_a_backend_that_cannot_create_contexts_stops_the_worker_with_exit_1_and_a_full_shutdown() -> None:
    consumers: list[FakeGroupConsumer] = []

    class _Consumer(FakeGroupConsumer):
        closed = False

        def close(self) -> None:
            self.closed = True
            super().close()

    def consumer(config: dict[str, Any]) -> FakeGroupConsumer:
        consumers.append(_Consumer(config))
        return consumers[-1]

    profile = Profile("test", (Bucket(8, 4, 4), Bucket(16, 4, 4)), token_budget=64, pad_to="bucket")
    s = Settings(input_format="raw", pad_to="bucket", shutdown_timeout_s=2.0)
    pipeline = wire_pipeline(s, tokenizer=_Tokenizer(), backend=_NoContexts(), profile=profile, model_name="m",
                             codec=OutputCodec(model="m", dim=4, encoding="float-list"),
                             consumer_factory=consumer, producer_factory=_Producer)
    assert pipeline.run() == 1  # before the fix: BucketerError raised out of run(), a traceback
    assert isinstance(pipeline.latch.error, BucketerError)
    assert "cannot create backend contexts" in str(pipeline.latch.error)
    assert "out of device memory" in str(pipeline.latch.error)
    assert consumers[0].closed  # the shutdown ran: the member left (never having joined)
    assert not pipeline._producer.thread.is_alive()  # noqa: SLF001 - and no client thread is left
    assert not any(t.name.startswith("kwe-") and t.is_alive() for t in threading.enumerate())
