"""A whole pipeline's parts without a model or a broker, for tests that run `wire_pipeline` with fake
clients: a tokenizer that gives every text three tokens, a backend of constant rows, and a producer
that acknowledges what was produced at its next poll (or nothing, while `stuck` is set)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from worker.intake.tokenize import Encoded


class ThreeTokens:
    special_tokens = 2

    def encode(self, texts: list[str]) -> list[Encoded]:
        return [Encoded(np.array([101, 7, 102], dtype=np.int64), 3, False) for _ in texts]


class HalvesContext:
    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        return np.ones((input_ids.shape[0], 4), dtype=np.float32) / 2.0

    def close(self) -> None:
        pass


class HalvesBackend:
    """Every row [0.5, 0.5, 0.5, 0.5]."""

    name = "onnxruntime"
    dim = 4
    max_contexts = None
    requires_serial_dispatch = False

    def create_context(self, index: int) -> HalvesContext:
        return HalvesContext()

    def close(self) -> None:
        pass


class AckingProducer:
    """Acknowledges every record at the next poll and keeps the keys it acknowledged; while `stuck`
    is set (an output that hangs) it acknowledges nothing."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self._queued: list[tuple[bytes, Any]] = []
        self.acked: list[bytes] = []
        self.stuck = threading.Event()

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, partition: int = -1,
                on_delivery: Any = None, _alias: Any = None, timestamp: int = 0, headers: Any = None) -> None:
        """confluent-kafka's positional order (the worker passes every argument by position)."""
        with self._lock:
            self._queued.append((key or b"", on_delivery))

    def poll(self, timeout: float) -> int:
        if self.stuck.is_set():
            time.sleep(min(timeout, 0.005))
            return 0
        with self._lock:
            queued, self._queued = self._queued, []
            self.acked += [key for key, _ in queued]
        for _, callback in queued:
            callback(None, None)
        threading.Event().wait(min(timeout, 0.005))
        return len(queued)

    def flush(self, timeout: float = 0) -> int:
        return 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._queued)
