"""The backend of a static model (worker/core/static.py): always the static backend, a numpy lookup
on the CPU, whatever `backend` says among the CPU ones (there is no graph for ONNX Runtime or
OpenVINO to run, and nothing to measure between them); the GPU backends and the settings that
shape a graph are refused, each with one BackendError naming the setting. The rules only: select.py
applies them where it assembles backends (open_backend, load_backend), so this module imports nothing
of select."""

from __future__ import annotations

from worker.core.model import ModelInfo


def static_refusal(model: ModelInfo, *, backend: str, precision: str = "fp32", onnx_path: str = "",
                   engine_path: str = "") -> str | None:
    """Why these settings cannot run the static model `model`, or None."""
    where = f"{model.model_dir} is a static model (a table lookup, no encoder)"
    if backend in ("tensorrt", "torch"):
        return f"backend {backend!r}: {where}, which runs on the CPU in numpy; set backend auto"
    if precision != "fp32":
        return f"precision {precision!r}: {where}; its table is used as stored (no int8 graph)"
    if onnx_path or engine_path:
        return f"{'onnx_path' if onnx_path else 'engine_path'} is set: {where}, which has no graph to run"
    return None


def static_reason(backend: str) -> str:
    """Why the static backend runs, for the "backend chosen" log and kwe_backend_info."""
    return f"a static model: a table lookup in numpy (backend {backend} has no graph to run here)"
