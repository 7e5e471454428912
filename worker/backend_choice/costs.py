"""The cost model of the chosen backend: what its calibration is keyed by (worker/batching/calibration.py
measures and caches it), for the worker and `bench --calibrate` alike."""

from __future__ import annotations

from typing import Any

from worker.backends.base import Backend
from worker.batching.cost_model import CostModel
from worker.core.model import ModelInfo
from worker.settings.schema import Settings


def calibration_key(settings: Settings, info: ModelInfo) -> dict[str, Any]:
    """What changes the price of a backend call, besides the backend and the machine."""
    weights = info.weights_path.stat()
    key: dict[str, Any] = {"model": str(info.model_dir), "weights": [weights.st_size, weights.st_mtime_ns],
                           "onnx": settings.onnx_path, "precision": settings.precision,
                           "intra_op_threads": settings.intra_op_threads, "spinning": settings.ort_allow_spinning,
                           "dispatchers": settings.dispatchers}
    if settings.backend == "openvino":  # the cost model follows the chosen backend and its arithmetic
        from worker.backends.openvino import version

        key.update(openvino_precision=settings.openvino_precision, openvino=version())
    return key


def cost_model(settings: Settings, info: ModelInfo, backend: Backend) -> CostModel | None:
    """The backend's measured `t(B, L)` where merge_buckets uses it; None where it is off."""
    if not settings.merge_buckets:
        return None
    from worker.batching.calibration import cost_model_for

    return cost_model_for(backend, calibration_key(settings, info), vocab_size=info.vocab_size)
