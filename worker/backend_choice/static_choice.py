"""The backend of a static model (worker/core/static.py): always the static backend, a numpy lookup
on the CPU, whatever `backend` says among the CPU ones (there is no graph for ONNX Runtime or
OpenVINO to run, and nothing to measure between them); the GPU backends and the settings that
shape a graph are refused, each with one BackendError naming the setting."""

from __future__ import annotations

import structlog

from worker.backend_choice import select
from worker.backend_choice.select import Loaded, resolve_profile_name, resolve_settings
from worker.core.errors import BackendError
from worker.core.model import ModelInfo
from worker.core.profiles import load_profile
from worker.settings.schema import Settings

log = structlog.get_logger(__name__)


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


def load_static(settings: Settings, model: ModelInfo) -> Loaded:
    """The static backend and the CPU profile, the settings resolved as for ONNX Runtime on CPU
    (the profile, pad_to; `backend` reads onnxruntime there, kwe_backend_info says static)."""
    why = static_refusal(model, backend=settings.backend, precision=settings.precision,
                         onnx_path=settings.onnx_path, engine_path=settings.engine_path)
    if why is not None:
        raise BackendError(why)
    profile = load_profile(resolve_profile_name(settings, "onnxruntime"), settings.profiles_file or None,
                           model_max_len=model.max_seq_length)
    reason = f"a static model: a table lookup in numpy (backend {settings.backend} has no graph to run here)"
    log.info("backend chosen", backend="static", reason=reason, profile=profile.name)
    # Through open_backend, the one place a backend is assembled (and a benchmark's seam).
    backend = select.open_backend("onnxruntime", model, profile)
    return Loaded(resolve_settings(settings, "onnxruntime", profile), model, backend, profile, reason)
