"""Choose and load the inference backend and its bucket profile from the settings.

backend = auto | onnxruntime | tensorrt:
- tensorrt: needs the gpu extra (tensorrt, pycuda), a visible NVIDIA GPU and a plan
  (engine_path); anything missing is one BackendError that names it and how to get it.
- auto: TensorRT when all of those are present, otherwise ONNX Runtime (the reason is logged).
Whether the gpu extra is there is decided with importlib.util.find_spec, which locates a
package without importing it, and whether a GPU is there from the driver's device nodes, so
choosing never loads CUDA; only the TensorRT backend itself imports tensorrt and pycuda.

profile = auto -> "gpu" for TensorRT, "cpu" for ONNX Runtime; the profile must reach the
model's max sequence length (load_profile checks it).
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from worker.backends.base import Backend, BackendError
from worker.config import Settings
from worker.profiles import Profile, load_profile

log = structlog.get_logger(__name__)

GPU_PACKAGES: tuple[str, ...] = ("tensorrt", "pycuda")
GPU_INSTALL_HINT = "pip install 'keyword-embedder[gpu]'"
DEFAULT_PROFILE = {"tensorrt": "gpu", "onnxruntime": "cpu"}

FindSpec = Callable[[str], Any]


def missing_gpu_packages(find_spec: FindSpec = importlib.util.find_spec) -> list[str]:
    """The gpu-extra packages that are not installed (found without importing them)."""
    missing = []
    for name in GPU_PACKAGES:
        try:
            found = find_spec(name) is not None
        except (ImportError, ValueError, AttributeError):
            # ValueError: in sys.modules as None (import blocked); ImportError: a finder refused it.
            found = False
        if not found:
            missing.append(name)
    return missing


def gpu_present(env: dict[str, str] | None = None, device_glob: str = "/dev/nvidia[0-9]*") -> bool:
    """True when the NVIDIA driver exposes a GPU to this process (no CUDA import).

    CUDA_VISIBLE_DEVICES set to "" or "-1" hides every GPU from CUDA, so it counts as none.
    """
    env = dict(os.environ) if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return False
    return bool(glob.glob(device_glob))


@dataclass(frozen=True)
class Choice:
    backend: str  # "tensorrt" | "onnxruntime"
    reason: str


def choose_backend(settings: Settings, *, find_spec: FindSpec = importlib.util.find_spec,
                   has_gpu: Callable[[], bool] = gpu_present) -> Choice:
    """Which backend `settings` get; BackendError when tensorrt is asked for and cannot be had."""
    if settings.backend == "onnxruntime":
        return Choice("onnxruntime", "backend = onnxruntime")
    missing = missing_gpu_packages(find_spec)
    gpu = has_gpu()
    engine = Path(settings.engine_path) if settings.engine_path else None
    if settings.backend == "tensorrt":
        if missing:
            raise BackendError(
                f"backend 'tensorrt' needs the gpu extra; missing: {', '.join(missing)}. "
                f"Install it on the GPU machine: {GPU_INSTALL_HINT}")
        if not gpu:
            raise BackendError("backend 'tensorrt': no NVIDIA GPU is visible (no /dev/nvidia* device, or "
                               "CUDA_VISIBLE_DEVICES hides them); use --backend onnxruntime on CPU")
        if engine is None:
            raise BackendError("backend 'tensorrt' needs a plan: set --engine-path (KWE_ENGINE_PATH); build it "
                               "with: keyword-embedder build-engine --output PLAN")
        if not engine.is_file():
            raise BackendError(f"backend 'tensorrt': engine_path {engine} does not exist; build it with: "
                               f"keyword-embedder build-engine --output {engine}")
        return Choice("tensorrt", "backend = tensorrt")
    # auto
    if missing:
        return Choice("onnxruntime", f"gpu extra not installed (missing {', '.join(missing)})")
    if not gpu:
        return Choice("onnxruntime", "no NVIDIA GPU visible")
    if engine is None:
        return Choice("onnxruntime", "no engine_path set (build a plan with keyword-embedder build-engine)")
    if not engine.is_file():
        return Choice("onnxruntime", f"engine_path {engine} does not exist")
    return Choice("tensorrt", f"gpu extra, a GPU and the plan {engine} are present")


def resolve_profile_name(settings: Settings, backend: str) -> str:
    return DEFAULT_PROFILE[backend] if settings.profile == "auto" else settings.profile


def _model_max_len(settings: Settings) -> int:
    from worker.model import ModelInfo, default_model_dir

    model_dir = settings.model_dir or default_model_dir()
    return ModelInfo.from_dir(model_dir).max_seq_length


def load_backend(settings: Settings, *, find_spec: FindSpec = importlib.util.find_spec,
                 has_gpu: Callable[[], bool] = gpu_present) -> tuple[Backend, Profile]:
    """The backend and bucket profile the settings ask for.

    Raises BackendError (backend cannot be had or loaded), ProfileError (bad profile) or
    ModelError (model folder), each with a message that names the setting or file.
    """
    choice = choose_backend(settings, find_spec=find_spec, has_gpu=has_gpu)
    profile = load_profile(resolve_profile_name(settings, choice.backend), settings.profiles_file or None,
                           model_max_len=_model_max_len(settings))
    log.info("backend chosen", backend=choice.backend, reason=choice.reason, profile=profile.name)
    if choice.backend == "tensorrt":
        from worker.backends.tensorrt import TensorRTBackend

        # trt_share_device_memory is not a setting yet (see docs/gpu.md); getattr so it works once added.
        backend: Any = TensorRTBackend(settings.engine_path, profile, onnx_path=settings.onnx_path or None,
                                       share_device_memory=bool(getattr(settings, "trt_share_device_memory", False)))
        return backend, profile
    from worker.backends.onnxruntime import OnnxRuntimeBackend

    onnx_path = settings.onnx_path
    if not onnx_path:
        from engines.export_onnx import ensure_onnx

        onnx_path = ensure_onnx(settings.model_dir or None, optimize=False)
    return OnnxRuntimeBackend(onnx_path, intra_op_threads=settings.intra_op_threads,
                              allow_spinning=settings.ort_allow_spinning), profile
