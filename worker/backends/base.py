"""The inference backend protocol shared by ONNX Runtime, OpenVINO and TensorRT.

A backend is loaded once per process. It hands out *contexts*: each context is owned by
exactly one dispatcher thread for its whole life (TensorRT: one IExecutionContext on its
own CUDA stream per bucket profile; ONNX Runtime: a handle on a shared session; OpenVINO: one infer request), so a
context needs no locking of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

# Defined in the lowest layer because the engine build raises it too; every backend raises it.
from worker.core.errors import BackendError

# The backends the worker can run on and OpenVINO's arithmetic: defined among the shared names, which the settings read
# without importing the backends; re-exported here beside the protocol.
from worker.names import BackendName, OvPrecision

__all__ = ["Backend", "BackendError", "BackendName", "InferenceContext", "OvPrecision", "PartialBatchError",
           "check_batch"]


@runtime_checkable
class InferenceContext(Protocol):
    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """[B, L] int64 ids and mask in, [B, dim] float32 embeddings out (L2-normalised where the
        model's pipeline ends in Normalize, worker.core.model.ModelInfo.normalized).

        B and L must fit the context's shape limits (for TensorRT, its profile's max shape).
        """
        ...

    def close(self) -> None: ...


# Here, beside the protocol, rather than in isolating.py which raises it: the output stage catches
# it, and a stage reaches the backends through this interface only.
class PartialBatchError(Exception):
    """Some items of a batch failed on their own; `rows` holds the others' embeddings."""

    def __init__(self, rows: np.ndarray, failed: Sequence[int], cause: BaseException) -> None:
        super().__init__(f"{len(failed)} of {len(rows)} items failed on their own: {cause!r}")
        self.rows = rows
        self.failed = list(failed)
        self.cause = cause


# The backends that compute on the CPU, on the thread that calls them among others (their own
# pools): their dispatchers are never held on the interpreter's one CPU (interpreter_cpu).
CPU_BACKENDS = frozenset({"onnxruntime", "openvino"})


@runtime_checkable
class Backend(Protocol):
    name: str
    dim: int
    # How many contexts create_context() may be asked for; None: any number.
    max_contexts: int | None
    # True where no two of the backend's contexts may run at once (TensorRT sharing one block of
    # activation memory): the bucketer then runs them all from one thread. Every backend
    # declares it (False on ONNX Runtime and OpenVINO).
    requires_serial_dispatch: bool

    def create_context(self, index: int) -> InferenceContext:
        """Context `index`: for TensorRT, the one bound to bucket profile `index`."""
        ...

    def close(self) -> None: ...


def check_batch(backend: str, input_ids: np.ndarray, attention_mask: np.ndarray) -> None:
    """The one shape rule every CPU backend enforces before a call: ids and mask, the same [B, L]."""
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise BackendError(f"{backend}: input_ids {input_ids.shape} and attention_mask "
                           f"{attention_mask.shape} must be the same [batch, seq] shape")
