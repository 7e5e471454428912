"""Choose and load the inference backend and its bucket profile from the settings.

backend = auto | onnxruntime | openvino | tensorrt | torch:
- tensorrt: needs the gpu extra (tensorrt, pycuda), a visible NVIDIA GPU and a plan
  (engine_path); anything missing is one BackendError that names it and how to get it.
- torch: needs the torch extra, a visible NVIDIA GPU and a CUDA build of torch that finds it,
  and a model it runs exactly (BERT, mean or CLS pooling); its precision is the first candidate
  that passes the parity gate (worker/backend_choice/torch_choice.py). Anything missing is one
  BackendError (exit 2 at start).
- openvino: needs the openvino extra (one BackendError leading with its install line).
- auto: TensorRT when all of its needs are present; else torch when the torch extra and a GPU
  are (and torch then finds CUDA and runs the model: otherwise the reason is logged and auto
  goes on); otherwise the CPU backend measured fastest on this machine among those that pass
  the fp32 parity gate (worker/backend_choice/auto.py; cached), ONNX Runtime where the openvino
  extra is missing. The log line "backend chosen" and kwe_backend_info's `reason` say why.
Whether an extra is there is decided with importlib.util.find_spec, which locates a package
without importing it, and whether a GPU is there from the driver's device nodes, so choosing
never loads CUDA: torch is imported only where a GPU is visible, and only the backends themselves
import tensorrt, pycuda and torch.

profile = auto -> "gpu" for TensorRT and torch, "cpu" for ONNX Runtime and OpenVINO; the profile
must reach the model's max sequence length (load_profile checks it). pad_to = auto -> the
profile's pad_to.
Every "auto" is resolved here, where the settings are read (`Loaded.settings`).

`open_backend` is the one place a backend is assembled: the worker (through load_backend),
`Embedder` and the benchmark command all build theirs with it.

Over 400 lines because it is the one place that asks which backend runs: every `auto` of the
settings, in the order the choice is made; split, that order would be read across files.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from worker.backend_choice.auto import Candidate, CpuChoice
from worker.backend_choice.static_choice import static_reason, static_refusal
from worker.backends.base import Backend, BackendName, OvPrecision
from worker.names import TorchPrecision
from worker.core.errors import BackendError, extra_missing
from worker.core.model import ModelInfo, default_model_dir
from worker.core.profiles import PadPolicy, Profile, load_profile
from worker.core.sparse import token_budget as sparse_token_budget
from worker.settings.schema import Precision, Settings

if TYPE_CHECKING:
    from worker.backend_choice.torch_choice import TorchChoice

log = structlog.get_logger(__name__)

GPU_PACKAGES: tuple[str, ...] = ("tensorrt", "pycuda")
GPU_INSTALL_HINT = "pip install 'keyword-embedder[gpu]'"
DEFAULT_PROFILE: dict[BackendName, str] = {"tensorrt": "gpu", "torch": "gpu", "onnxruntime": "cpu", "openvino": "cpu"}
NO_GPU = "no NVIDIA GPU is visible (no /dev/nvidia* device, or CUDA_VISIBLE_DEVICES hides them)"

FindSpec = Callable[[str], Any]


def _found(find_spec: FindSpec, name: str) -> bool:
    """Whether package `name` is installed, found without importing it."""
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError, AttributeError):
        # ValueError: in sys.modules as None (import blocked); ImportError: a finder refused it.
        return False


def missing_gpu_packages(find_spec: FindSpec = importlib.util.find_spec) -> list[str]:
    """The gpu-extra packages that are not installed (found without importing them)."""
    return [name for name in GPU_PACKAGES if not _found(find_spec, name)]


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
    backend: BackendName
    reason: str
    # True where `backend` is only the fallback: auto on CPU measures the candidates (auto.py).
    measure_cpu: bool = False


def choose_backend(settings: Settings, *, find_spec: FindSpec = importlib.util.find_spec,
                   has_gpu: Callable[[], bool] = gpu_present) -> Choice:
    """Which backend `settings` get; BackendError when tensorrt is asked for and cannot be had."""
    if settings.backend == "onnxruntime":
        return Choice("onnxruntime", "backend = onnxruntime")
    if settings.backend == "openvino":
        if not _found(find_spec, "openvino"):
            raise BackendError(extra_missing("openvino", "backend 'openvino'", "openvino"))
        return Choice("openvino", f"backend = openvino ({settings.openvino_precision})")
    if settings.backend == "torch":
        if not _found(find_spec, "torch"):
            raise BackendError(extra_missing("torch", "backend 'torch'", "torch"))
        if not has_gpu():
            raise BackendError(f"backend 'torch': {NO_GPU}; use --backend onnxruntime on CPU")
        return Choice("torch", "backend = torch")
    missing = missing_gpu_packages(find_spec)
    gpu = has_gpu()
    engine = Path(settings.engine_path) if settings.engine_path else None
    if settings.backend == "tensorrt":
        if missing:
            raise BackendError(
                f"backend 'tensorrt' needs the gpu extra; missing: {', '.join(missing)}. "
                f"Install it on the GPU machine: {GPU_INSTALL_HINT}")
        if not gpu:
            raise BackendError(f"backend 'tensorrt': {NO_GPU}; use --backend onnxruntime on CPU")
        if engine is None:
            raise BackendError("backend 'tensorrt' needs a plan: set --engine-path (KWE_ENGINE_PATH); build it "
                               "with: keyword-embedder build-engine --output PLAN")
        if not engine.is_file():
            raise BackendError(f"backend 'tensorrt': engine_path {engine} does not exist; build it with: "
                               f"keyword-embedder build-engine --output {engine}")
        return Choice("tensorrt", "backend = tensorrt")
    # auto: TensorRT, else torch, else the CPU choice; each step says why the one before it was passed over.
    if not gpu:
        return Choice("onnxruntime", "no NVIDIA GPU visible", True)
    if missing:
        no_trt = f"no TensorRT: gpu extra not installed (missing {', '.join(missing)})"
    elif engine is None:
        no_trt = "no TensorRT: no engine_path set (build a plan with keyword-embedder build-engine)"
    elif not engine.is_file():
        no_trt = f"no TensorRT: engine_path {engine} does not exist"
    else:
        return Choice("tensorrt", f"gpu extra, a GPU and the plan {engine} are present")
    if _found(find_spec, "torch"):
        return Choice("torch", f"{no_trt}; torch and a GPU are present")
    return Choice("onnxruntime", f"{no_trt}; torch extra not installed", True)


def resolve_profile_name(settings: Settings, backend: BackendName) -> str:
    return DEFAULT_PROFILE[backend] if settings.profile == "auto" else settings.profile


def resolve_settings(settings: Settings, backend: BackendName, profile: Profile,
                     openvino_precision: OvPrecision | None = None,
                     torch_precision: TorchPrecision | None = None) -> Settings:
    """The settings with every "auto" replaced by what it stands for here.

    backend: the one chosen (and, for OpenVINO and torch, its precision); profile: the profile's name;
    pad_to: the profile's pad_to. What runs after this (the pipeline, the bucketer) never sees
    the word "auto".
    """
    pad_to: PadPolicy = profile.pad_to if settings.pad_to == "auto" else settings.pad_to
    return dataclasses.replace(settings, backend=backend, profile=profile.name, pad_to=pad_to,
                               intra_op_threads=intra_op_threads(settings),
                               openvino_precision=openvino_precision or settings.openvino_precision,
                               torch_precision=torch_precision or settings.torch_precision)


def precision_label(settings: Settings) -> str:
    """The arithmetic the resolved settings run: fp32/int8 (ONNX Runtime), bf16/f32 (OpenVINO), plan (TensorRT),
    fp16/bf16/fp32 (torch's encoder; its pooling is fp32)."""
    if settings.backend == "openvino":
        return settings.openvino_precision
    if settings.backend == "torch":
        return settings.torch_precision
    if settings.backend == "tensorrt":
        return "plan"
    return settings.precision


def usable_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """Cores this process may run on: its CPU affinity (which container CPU sets narrow), and no more
    than its cgroup's CPU quota (a Kubernetes CPU limit, which leaves the affinity at every core of
    the node), rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return cores  # cgroup v1, or no cgroup file: the affinity is all there is to go by
    if quota == "max":
        return cores
    try:
        return max(1, min(cores, -(-int(quota) // int(period))))
    except (ValueError, ZeroDivisionError):
        return cores


def intra_op_threads(settings: Settings, cores: int | None = None) -> int:
    """The setting, or for 0 the cores divided among the dispatchers: each call gets its own cores.

    One pool of every core shared by concurrent calls makes each call wait for pool threads
    that other work (the broker, the poll and output threads) has descheduled; single-threaded
    calls side by side have no such barrier (issue 19, benchmarks/results/latency/latency_diagnosis.md).
    """
    if settings.intra_op_threads:
        return settings.intra_op_threads
    return max(1, (cores or usable_cores()) // settings.dispatchers)


def check_sparse_precision(model: ModelInfo, kind: BackendName, openvino_precision: OvPrecision) -> None:
    """A sparse model on OpenVINO bf16 given by name (auto gates it, and refuses it on splade-tiny):
    bf16 logits move its weights by thousands of times the parity tolerance and change which are
    non-zero (docs/models.md, Sparse models), so it is refused rather than run unchecked."""
    if model.sparse and kind == "openvino" and openvino_precision == "bf16":
        raise BackendError(f"{model.model_dir}: backend openvino with openvino_precision bf16 is refused for a sparse "
                           "(SPLADE) model: bf16 logits change its weights far beyond the parity tolerance (on "
                           "splade-tiny: 4,951x, other non-zero indices in 53 of 224 texts); set openvino_precision "
                           "f32, or backend auto, which gates bf16 and keeps what passes")


def model_profile(model: ModelInfo, profile: Profile) -> Profile:
    """The profile as this model runs it: a sparse model's batches hold their [B, S, vocabulary]
    logits within worker.core.sparse.LOGITS_BYTES (the worker, the benchmark and the Embedder alike)."""
    if not model.sparse:
        return profile
    return profile.capped(sparse_token_budget(model.vocab_size, profile.token_budget),
                          f"a sparse model's logits ({model.vocab_size:,} x 4 bytes a token)")


def model_info(settings: Settings) -> ModelInfo:
    """The model folder the settings name (or the packaged default), read once."""
    return ModelInfo.from_dir(settings.model_dir or default_model_dir(), sparse_route=settings.sparse_route)


def open_backend(kind: BackendName, model: ModelInfo, profile: Profile | None = None, *, onnx_path: str | Path | None = None,
                 engine_path: str | Path | None = None, intra_op_threads: int = 0, fused: bool = False,
                 share_device_memory: bool = False, precision: Precision = "fp32",
                 allow_spinning: bool = True, openvino_precision: OvPrecision = "bf16",
                 torch_precision: TorchPrecision = "auto") -> Backend:
    """The one place a backend is assembled (the worker, Embedder and the benchmark all come here).

    onnxruntime: `onnx_path`, or the cached export of `model` (`fused`: the offline-fused
    graph; precision "int8": the quantized graph, cached beside it); openvino: the same ONNX file compiled with `openvino_precision`,
    `intra_op_threads` threads per context (0: the usable cores);
    tensorrt: the plan at `engine_path`, checked against `profile` and the ONNX file;
    torch: `model`'s weights with one CUDA graph per bucket of `profile`, in the first of
    `torch_precision`'s candidates that passes the parity gate (onnx_path is not used).
    The backend's embedding size must be the model's.
    """
    backend: Backend
    if model.static is not None:  # a table lookup whatever `kind` (worker/backend_choice/static_choice.py)
        from worker.backends.static import StaticBackend

        why = static_refusal(model, backend=kind, precision=precision, onnx_path=str(onnx_path or ""),
                             engine_path=str(engine_path or ""))
        if why is not None:
            raise BackendError(why)
        return StaticBackend(model)
    if kind == "torch":
        if precision != "fp32":
            raise BackendError(f"setting 'precision': {precision!r} is for the onnxruntime backend; the torch "
                               "backend's is torch_precision (auto, fp16, bf16, fp32)")
        if profile is None:
            raise BackendError("backend 'torch' needs the bucket profile its CUDA graphs are captured for")
        return open_torch(model, profile, torch_precision)[0]
    excluded = model.pipeline.prompt_tokens_excluded
    if excluded and (kind == "tensorrt" or onnx_path):
        # The graph built for a prompt leaves its tokens out of the pooling; a plan or a given
        # ONNX file was built without knowing the prompt.
        given = "a TensorRT plan" if kind == "tensorrt" else f"onnx_path {onnx_path}"
        raise BackendError(f"{model.model_dir}: its pooling leaves the prompt's {excluded} tokens out "
                           f"(include_prompt false), which {given} cannot be checked for; run it on onnxruntime "
                           "with the worker's own export (no onnx_path)")
    if model.sparse and precision == "int8":
        raise BackendError(f"{model.model_dir}: precision int8 is not offered for a sparse (SPLADE) model: its "
                           "recipe was chosen for dense models' neighbours, and a sparse model's weights are "
                           "held to 1e-4 of sentence-transformers'; run it in fp32")
    if kind == "tensorrt":
        if precision != "fp32":
            raise BackendError(f"setting 'precision': {precision!r} is for the onnxruntime backend; "
                               "TensorRT precision is chosen when the plan is built (build-engine --fp16)")
        if not engine_path or profile is None:
            raise BackendError("backend 'tensorrt' needs a plan (engine_path) and the bucket profile it was built "
                               "for; build it with: keyword-embedder build-engine --output PLAN")
        from worker.backends.tensorrt import TensorRTBackend

        backend = TensorRTBackend(engine_path, profile, onnx_path=onnx_path or None,
                                  share_device_memory=share_device_memory)
    elif kind == "openvino":
        if precision != "fp32":
            raise BackendError(f"setting 'precision': {precision!r} is for the onnxruntime backend; OpenVINO's "
                               "is openvino_precision (bf16 or f32)")
        from engines.onnx_export.export import ensure_onnx
        from worker.backends.openvino import OpenVinoBackend

        backend = OpenVinoBackend(onnx_path or ensure_onnx(model, optimize=fused), precision=openvino_precision,
                                  threads=intra_op_threads or usable_cores())
    else:
        from worker.backends.onnxruntime import OnnxRuntimeBackend

        if not onnx_path and precision == "int8":
            from engines.quantize_int8 import QuantizeError, ensure_int8_onnx

            try:
                onnx_path = ensure_int8_onnx(model)
            except QuantizeError as exc:  # e.g. a family the int8 recipe does not cover
                raise BackendError(f"{model.model_dir}: {exc}") from exc
        elif not onnx_path:
            from engines.onnx_export.export import ensure_onnx

            onnx_path = ensure_onnx(model, optimize=fused)
        backend = OnnxRuntimeBackend(onnx_path, intra_op_threads=intra_op_threads, allow_spinning=allow_spinning)
    if backend.dim != model.dim:
        backend.close()
        raise BackendError(f"{kind}: the backend gives {backend.dim}-d vectors but the model in {model.model_dir} "
                           f"gives {model.dim} ({model.pipeline.describe()}); the ONNX file or plan belongs to "
                           "another model")
    return backend


@dataclass(frozen=True)
class Loaded:
    """What a start needs: the model read once, the backend, its profile, and the resolved settings."""

    settings: Settings  # no "auto" left in backend, profile or pad_to
    model: ModelInfo
    backend: Backend
    profile: Profile
    reason: str = ""  # why this backend (auto: what was measured)
    cpu_choice: CpuChoice | None = None  # auto on CPU: the candidates' gate results and timings


def load_backend(settings: Settings, *, model: ModelInfo | None = None,
                 find_spec: FindSpec = importlib.util.find_spec,
                 has_gpu: Callable[[], bool] = gpu_present) -> Loaded:
    """The backend and bucket profile the settings ask for, and the settings with "auto" resolved.

    Raises BackendError (backend cannot be had or loaded), ProfileError (bad profile) or
    ModelError (model folder), each with a message that names the setting or file.
    """
    model = model or model_info(settings)
    if model.static is not None:  # no graph: the numpy lookup, the settings resolved as for ONNX Runtime on CPU
        why = static_refusal(model, backend=settings.backend, precision=settings.precision,
                             onnx_path=settings.onnx_path, engine_path=settings.engine_path)
        if why is not None:
            raise BackendError(why)
        profile = load_profile(resolve_profile_name(settings, "onnxruntime"), settings.profiles_file or None,
                               model_max_len=model.max_seq_length)
        reason = static_reason(settings.backend)
        log.info("backend chosen", backend="static", reason=reason, profile=profile.name)
        backend = open_backend("onnxruntime", model, profile)  # the benchmarks' seam, as for every backend
        return Loaded(resolve_settings(settings, "onnxruntime", profile), model, backend, profile, reason)
    choice = choose_backend(settings, find_spec=find_spec, has_gpu=has_gpu)
    threads = intra_op_threads(settings)
    if choice.backend == "torch":
        loaded, why_not = _load_torch(settings, model, choice)
        if loaded is not None:
            return loaded
        # auto only (an explicit torch raised): torch cannot serve here; the CPU choice, saying why.
        choice = Choice("onnxruntime", f"{choice.reason}; torch not used: {why_not}", True)
    profile = model_profile(model, load_profile(resolve_profile_name(settings, choice.backend),
                                                settings.profiles_file or None, model_max_len=model.max_seq_length))
    if choice.measure_cpu:
        cpu, backend = choose_cpu(settings, model, threads=threads,
                                  ov_available=_found(find_spec, "openvino"))
        kind: BackendName = cpu.candidate.backend
        ov_precision: OvPrecision | None = cpu.candidate.ov_precision if kind == "openvino" else None
        reason = f"{choice.reason}; {cpu.reason}"
        log.info("backend chosen", backend=kind, precision=cpu.candidate.precision, reason=reason,
                 profile=profile.name, measured=not cpu.cached, seconds=round(cpu.seconds, 2))
        return Loaded(resolve_settings(settings, kind, profile, ov_precision), model, backend, profile, reason, cpu)
    check_sparse_precision(model, choice.backend, settings.openvino_precision)
    log.info("backend chosen", backend=choice.backend, reason=choice.reason, profile=profile.name)
    # trt_share_device_memory is not a setting yet (see docs/gpu.md); getattr so it works once added.
    backend = open_backend(choice.backend, model, profile, onnx_path=settings.onnx_path or None,
                           engine_path=settings.engine_path or None, intra_op_threads=threads,
                           share_device_memory=bool(getattr(settings, "trt_share_device_memory", False)),
                           precision=settings.precision, allow_spinning=settings.ort_allow_spinning,
                           openvino_precision=settings.openvino_precision)
    return Loaded(resolve_settings(settings, choice.backend, profile), model, backend, profile, choice.reason)


def _load_torch(settings: Settings, model: ModelInfo, choice: Choice) -> tuple[Loaded | None, str]:
    """The torch backend gated in its best precision, or (auto only) None and why torch cannot serve.

    An explicit `backend = torch` raises instead: one BackendError line, exit 2 at start.
    """
    from worker.backends.torch_plan import refusal

    explicit = settings.backend == "torch"
    if settings.precision != "fp32":
        if explicit:
            raise BackendError(f"setting 'precision': {settings.precision!r} is for the onnxruntime backend; the torch "
                               "backend's is torch_precision (auto, fp16, bf16, fp32)")
        return None, f"precision {settings.precision} is ONNX Runtime's"
    why = refusal(model)
    if why is not None:  # before torch is imported: the model alone says no
        if explicit:
            raise BackendError(why)
        return None, why
    profile = load_profile(resolve_profile_name(settings, "torch"), settings.profiles_file or None,
                           model_max_len=model.max_seq_length)
    try:
        backend, torch_choice = open_torch(model, profile, settings.torch_precision)
    except BackendError as exc:  # no CUDA in this torch, no precision passes the gate, out of GPU memory
        if explicit:
            raise
        return None, str(exc)
    reason = f"{choice.reason}; {torch_choice.reason}"
    log.info("backend chosen", backend="torch", precision=torch_choice.precision, reason=reason,
             profile=profile.name, device=torch_choice.device, seconds=round(torch_choice.seconds, 2))
    resolved = resolve_settings(settings, "torch", profile, torch_precision=torch_choice.precision)
    return Loaded(resolved, model, backend, profile, reason), ""


def open_torch(model: ModelInfo, profile: Profile, requested: TorchPrecision = "auto") -> tuple[Backend, TorchChoice]:
    """The torch backend in the best precision that passes the parity gate, and its TorchChoice."""
    from worker.backend_choice.torch_choice import choose_torch

    torch_choice, backend = choose_torch(model, profile, requested=requested)
    if backend.dim != model.dim:
        backend.close()
        raise BackendError(f"torch: the backend gives {backend.dim}-d vectors but the model in {model.model_dir} "
                           f"gives {model.dim}")
    return backend, torch_choice


def choose_cpu(settings: Settings, model: ModelInfo, *, threads: int, ov_available: bool | None = None,
               remeasure: bool = False, flags: frozenset[str] | None = None,
               cache_dir: Path | None = None) -> tuple[CpuChoice, Backend]:
    """auto on CPU: the measured choice among ONNX Runtime and OpenVINO for this layout, and its open backend."""
    from worker.backend_choice import auto
    def open_candidate(cand: Candidate) -> Backend:
        return open_backend(cand.backend, model, onnx_path=settings.onnx_path or None, intra_op_threads=threads,
                            precision="int8" if cand.precision == "int8" else "fp32",
                            allow_spinning=settings.ort_allow_spinning, openvino_precision=cand.ov_precision)

    key = auto.layout_key(model, onnx_path=settings.onnx_path, threads=threads, dispatchers=settings.dispatchers,
                          spinning=settings.ort_allow_spinning)
    return auto.choose(key, open_candidate, lambda: auto.gate_token_ids(model), flags=flags,
                       ov_available=ov_available, int8=settings.precision == "int8", remeasure=remeasure,
                       cache_dir=cache_dir, gate=auto.check_sparse_gate if model.sparse else auto.check_gate)
