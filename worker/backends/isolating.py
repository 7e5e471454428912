"""Failure isolation around a backend: a failing batch never takes good keywords with it.

A context's failed batch is retried once (a transient fault costs nothing), then split in
halves, recursively, so that only items that fail on their own are reported. An item that
fails alone is either poison (this input breaks the model) or the backend is broken; a
canary (a short, known-good input) tells which: poison is reported for a dead letter, a
broken backend stops the worker, so a dead GPU never dead-letters the whole stream.

Runs on the dispatcher thread that owns the wrapped context, like the context itself.
"""

from __future__ import annotations

import numpy as np
import structlog

from worker.backends.base import Backend, InferenceContext, PartialBatchError
from worker.errors import BackendBrokenError

log = structlog.get_logger(__name__)


class IsolatingContext:
    def __init__(self, ctx: InferenceContext, dim: int, canary_ids: np.ndarray) -> None:
        self._ctx = ctx
        self._dim = dim
        self._canary = (canary_ids.reshape(1, -1).astype(np.int64), np.ones((1, canary_ids.size), dtype=np.int64))

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        try:
            return self._ctx.run(input_ids, attention_mask)
        except Exception as first:  # noqa: BLE001 - any backend failure is isolated, then judged
            log.warning("batch failed; retrying once", size=len(input_ids), error=repr(first))
        try:
            return self._ctx.run(input_ids, attention_mask)
        except Exception as again:  # noqa: BLE001
            rows = np.zeros((len(input_ids), self._dim), dtype=np.float32)
            failed: list[int] = []
            self._isolate(input_ids, attention_mask, np.arange(len(input_ids)), again, rows, failed)
            if not failed:  # every part ran on its own: the fault was transient
                return rows
            raise PartialBatchError(rows, failed, again) from again

    def _isolate(self, ids: np.ndarray, mask: np.ndarray, index: np.ndarray, error: BaseException,
                 rows: np.ndarray, failed: list[int]) -> None:
        """`index` failed together with `error`: run its halves apart, down to single items."""
        if len(index) == 1:
            self._check_canary(error)
            failed.append(int(index[0]))
            return
        half = len(index) // 2
        for part in (index[:half], index[half:]):
            try:
                rows[part] = self._ctx.run(ids[part], mask[part])
            except Exception as exc:  # noqa: BLE001
                self._isolate(ids, mask, part, exc, rows, failed)

    def _check_canary(self, item_error: BaseException) -> None:
        try:
            self._ctx.run(*self._canary)
        except Exception as exc:  # noqa: BLE001
            raise BackendBrokenError(f"the inference backend fails on known-good input: {exc!r} "
                                     f"(a batch item failed with {item_error!r})") from exc

    def close(self) -> None:
        self._ctx.close()


class IsolatingBackend:
    """The same backend, its contexts wrapped in `IsolatingContext`."""

    def __init__(self, backend: Backend, canary_ids: np.ndarray) -> None:
        self._backend = backend
        self._canary = canary_ids
        self.name: str = backend.name
        self.dim: int = backend.dim
        self.max_contexts: int | None = backend.max_contexts
        self.requires_serial_dispatch: bool = backend.requires_serial_dispatch

    def create_context(self, index: int) -> InferenceContext:
        return IsolatingContext(self._backend.create_context(index), self.dim, self._canary)

    def close(self) -> None:
        self._backend.close()
