"""The inference backend protocol shared by ONNX Runtime and TensorRT.

A backend is loaded once per process. It hands out *contexts*: each context is owned by
exactly one dispatcher thread for its whole life (TensorRT: one IExecutionContext on its
own CUDA stream per bucket profile; ONNX Runtime: a handle on a shared session), so a
context needs no locking of its own.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

# Defined in the lowest layer because the engine build raises it too; every backend raises it.
from kwe_core.errors import BackendError
# The backends the worker can run on: defined among the shared names, which the settings read
# without importing the backends; re-exported here beside the protocol.
from worker.names import BackendName

__all__ = ["Backend", "BackendError", "BackendName", "InferenceContext", "requires_serial_dispatch"]


@runtime_checkable
class InferenceContext(Protocol):
    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """[B, L] int64 ids and mask in, [B, dim] float32 embeddings out (L2-normalised where the
        model's pipeline ends in Normalize, kwe_core.model.ModelInfo.normalized).

        B and L must fit the context's shape limits (for TensorRT, its profile's max shape).
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    name: str
    dim: int
    # How many contexts create_context() may be asked for; None: any number. A backend may also
    # set `requires_serial_dispatch = True` (TensorRT sharing one block of activation memory):
    # no two of its contexts may run at once, so the bucketer runs them all from one thread.
    max_contexts: int | None

    def create_context(self, index: int) -> InferenceContext:
        """Context `index`: for TensorRT, the one bound to bucket profile `index`."""
        ...

    def close(self) -> None: ...


def requires_serial_dispatch(backend: Backend) -> bool:
    """Whether no two of the backend's contexts may run at once, so one thread must run them all.

    An optional ability (TensorRT sharing one block of activation memory), absent on most
    backends: read here, in one place, rather than with getattr at every caller.
    """
    return bool(getattr(backend, "requires_serial_dispatch", False))
