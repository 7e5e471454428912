"""The device's primary CUDA context for pycuda: retained once per process, never released.

TensorRT uses the CUDA runtime, which works in each device's primary context; pycuda's driver
API needs that context pushed on every thread that makes a call. So the builder and the
TensorRT backend retain the primary context through pycuda and push/pop it around their work.

Retained once per process and never detached, because pycuda's `Context.detach()` cannot be
made clean here: on the retaining thread it pushes the context when it is not current (it is
not, after our pop), releases it with cuDevicePrimaryCtxRelease, which does not pop, and so
leaves it current on that thread behind pycuda's back; on any other thread it releases nothing
(pycuda's src/cpp/cuda.hpp, context::detach). Releasing the last reference would also reset the
context and free every allocation in it, the runtime's included. The CUDA runtime itself holds
the primary context until the process exits; one more reference held as long costs nothing.

This registry is the module's only state, and it is per process by nature: a retained primary
context is a process-wide resource.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
# (id of the pycuda.driver module, device) -> (that module, its retained primary context); the
# module is kept so its id cannot be reused (tests load several fake ones in one process).
_retained: dict[tuple[int, int], tuple[Any, Any]] = {}


def primary_context(cuda: Any, device: int = 0) -> Any:
    """`device`'s primary context (a pycuda Context), retained on the first call of the process."""
    key = (id(cuda), device)
    with _lock:
        entry = _retained.get(key)
        if entry is None:
            entry = _retained[key] = (cuda, cuda.Device(device).retain_primary_context())
        return entry[1]
