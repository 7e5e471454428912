"""Build a multi-profile TensorRT plan from the ONNX export, and describe it in a JSON sidecar.

One optimisation profile per bucket of a bucket profile (worker/core/profiles.toml), in bucket
order, so that bucket i runs on TensorRT profile i: for a bucket of bound L the profile is
min = (1, L), opt = (opt_batch, L), max = (max_batch, L) for both `input_ids` and
`attention_mask`. The sequence length is fixed per profile (the batch is padded to the bound),
which lets TensorRT tune one shape per bucket; every L must be a multiple of 8 so its fused
attention kernels are chosen.

A plan only runs where it was built: on the same GPU architecture, with the same TensorRT
version, from the same ONNX file, with the same buckets. The sidecar `<plan>.json` records
all of that, and `validate_sidecar` refuses a stale, foreign or mismatched plan with a message
that says what differs and how to rebuild, instead of an opaque TensorRT deserialisation
error (or, worse, a plan that loads and then rejects every batch shape).

Everything above `build_engine` is pure logic, imported and tested without a GPU. TensorRT
and pycuda (the `gpu` extra) are imported only inside the functions that need them.

Over 400 lines because the plan and its sidecar are checked against each other wherever they meet
(the build, the load, `--check`), and those checks read best beside the build.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from engines.cuda_context import primary_context
from engines.onnx_export.head import FP32_NODE_PREFIXES
from worker.core.errors import GPU_INSTALL_HINT, BackendError, KeywordEmbedderError
from worker.core.profiles import Profile, ProfileError

# The two network inputs the ONNX export has, both [batch, seq] integer tensors.
INPUT_NAMES: tuple[str, ...] = ("input_ids", "attention_mask")
# TensorRT picks its fused multi-head-attention kernels only for sequence lengths aligned to 8.
DEFAULT_ALIGN = 8
DEFAULT_WORKSPACE_GIB = 4.0
SIDECAR_SCHEMA = 1


class AlignmentError(ProfileError):
    """A bucket bound cannot become a TensorRT profile: it is not a multiple of the alignment."""


class PlanSidecarError(BackendError):
    """The plan's sidecar is missing or invalid, or says the plan does not fit this machine/model."""


class EngineBuildError(KeywordEmbedderError, RuntimeError):
    """TensorRT could not parse the ONNX file or build the plan; the message carries its errors."""


class GpuExtraMissingError(BackendError):
    """tensorrt or pycuda (the `gpu` extra) cannot be imported; the message names which and how to install."""


# ---------------------------------------------------------------------------- profile shapes
@dataclass(frozen=True)
class ProfileShape:
    """The TensorRT optimisation profile for one bucket (index = bucket index = profile index)."""

    index: int
    seq_len: int
    min: tuple[int, int]
    opt: tuple[int, int]
    max: tuple[int, int]

    @property
    def max_batch(self) -> int:
        return self.max[0]


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def profile_shapes(profile: Profile, *, align: int | None = None) -> list[ProfileShape]:
    """The optimisation profiles for `profile`, one per bucket, in bucket order.

    Raises AlignmentError naming every unaligned bound (with the aligned bound it would round
    up to) when a bound is not a multiple of `align` (default: the profile's own `align`, else 8).
    """
    align = align or profile.align or DEFAULT_ALIGN
    if align < 1:
        raise AlignmentError(f"profile {profile.name!r}: align must be >= 1, got {align}")
    bad = [b.max_len for b in profile.buckets if b.max_len % align]
    if bad:
        fixes = ", ".join(f"{m} -> {_round_up(m, align)}" for m in bad)
        raise AlignmentError(
            f"profile {profile.name!r}: TensorRT needs every bucket bound to be a multiple of {align} "
            f"(fused attention kernels are only chosen for aligned lengths); not aligned: {bad} "
            f"(round up: {fixes}). Use the 'gpu' profile of worker/core/profiles.toml or align this one.")
    shapes = []
    for i, b in enumerate(profile.buckets):
        opt = min(max(1, b.opt_batch), b.max_batch)
        shapes.append(ProfileShape(i, b.max_len, (1, b.max_len), (opt, b.max_len), (b.max_batch, b.max_len)))
    return shapes


def profile_table(profile: Profile) -> list[dict[str, int]]:
    """The bucket table as it is stored in the sidecar (and compared against at load)."""
    return [{"max_len": b.max_len, "max_batch": b.max_batch, "opt_batch": b.opt_batch} for b in profile.buckets]


# ---------------------------------------------------------------------------- sidecar
def sha256_file(path: str | Path, *, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    except OSError as exc:
        raise PlanSidecarError(f"{path}: cannot read it to hash it ({exc.strerror})") from None
    return h.hexdigest()


def fp16_onnx_path(plan_path: str | Path) -> Path:
    """`engine.plan` -> `engine.plan.fp16.onnx`: the fp16 graph an fp16 plan was parsed from."""
    return Path(str(plan_path) + ".fp16.onnx")


def sidecar_path(plan_path: str | Path) -> Path:
    """`engine.plan` -> `engine.plan.json` (appended, so the plan's own suffix stays visible)."""
    return Path(str(plan_path) + ".json")


@dataclass(frozen=True)
class PlanSidecar:
    tensorrt_version: str
    gpu_name: str
    compute_capability: str  # "9.0": TensorRT plans are specific to the SM architecture
    profile_name: str
    profile_table: list[dict[str, int]]
    onnx_sha256: str
    onnx_path: str
    fp16: bool
    exporter_version: str  # producer_name/producer_version recorded in the ONNX file
    created: str  # ISO 8601, UTC
    plan_sha256: str = ""
    schema: int = SIDECAR_SCHEMA
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, *, where: str = "sidecar") -> PlanSidecar:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanSidecarError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise PlanSidecarError(f"{where}: expected a JSON object")
        if raw.get("schema") != SIDECAR_SCHEMA:
            raise PlanSidecarError(f"{where}: sidecar schema {raw.get('schema')!r} is not {SIDECAR_SCHEMA}; "
                                   "rebuild the plan with this version of keyword-embedder build-engine")
        names = {f for f in cls.__dataclass_fields__}
        required = {"tensorrt_version", "gpu_name", "compute_capability", "profile_name", "profile_table",
                    "onnx_sha256", "onnx_path", "fp16", "exporter_version", "created"}
        missing = sorted(required - set(raw))
        if missing:
            raise PlanSidecarError(f"{where}: missing field(s) {', '.join(missing)}; "
                                   "not a sidecar written by keyword-embedder build-engine")
        table = raw["profile_table"]
        if not isinstance(table, list) or not all(
                isinstance(r, dict) and all(isinstance(r.get(k), int) for k in ("max_len", "max_batch", "opt_batch"))
                for r in table):
            raise PlanSidecarError(f"{where}: profile_table must be a list of {{max_len, max_batch, opt_batch}}")
        return cls(**{k: v for k, v in raw.items() if k in names})


def write_sidecar(plan_path: str | Path, sidecar: PlanSidecar) -> Path:
    path = sidecar_path(plan_path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(sidecar.to_json(), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_sidecar(plan_path: str | Path) -> PlanSidecar:
    path = sidecar_path(plan_path)
    if not Path(plan_path).is_file():
        raise PlanSidecarError(f"TensorRT plan {plan_path} not found; build it with: "
                               f"keyword-embedder build-engine --output {plan_path}")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlanSidecarError(
            f"TensorRT plan {plan_path} has no sidecar {path}: cannot tell which GPU, TensorRT version, "
            f"ONNX file and buckets it was built for, so it is refused; rebuild it with "
            f"keyword-embedder build-engine --output {plan_path}") from None
    except OSError as exc:
        raise PlanSidecarError(f"{path}: {exc.strerror}") from None
    return PlanSidecar.from_json(text, where=str(path))


def _table_str(table: Sequence[dict[str, int]]) -> str:
    return " ".join(f"{r['max_len']}x{r['max_batch']}" for r in table)


def validate_sidecar(sidecar: PlanSidecar, *, plan_path: str | Path, profile: Profile | None = None,
                     onnx_sha256: str | None = None, tensorrt_version: str | None = None,
                     gpu_name: str | None = None, compute_capability: str | None = None,
                     plan_sha256: str | None = None) -> None:
    """Raises PlanSidecarError listing every way the plan does not fit; None for a check skips it.

    - stale: the ONNX file (given hash) is not the one the plan was built from;
    - foreign: built on another GPU (name or compute capability) or another TensorRT version
      (a plan is only guaranteed to deserialise on the exact version and SM it was built for);
    - mismatched profile: the plan's optimisation profiles are not the buckets the worker will
      send (every batch of a differing bucket would be rejected, or run on the wrong profile);
    - not this plan: the sidecar was written for another plan file (plan hash differs).
    """
    problems: list[str] = []
    if plan_sha256 is not None and sidecar.plan_sha256 and plan_sha256 != sidecar.plan_sha256:
        problems.append("the sidecar belongs to another plan (plan sha256 differs): the plan file was "
                        "replaced without its sidecar")
    if onnx_sha256 is not None and onnx_sha256 != sidecar.onnx_sha256:
        problems.append(f"stale: built from an ONNX file with sha256 {sidecar.onnx_sha256[:12]}... "
                        f"({sidecar.onnx_path}), the ONNX file now has {onnx_sha256[:12]}...")
    if tensorrt_version is not None and tensorrt_version != sidecar.tensorrt_version:
        problems.append(f"foreign: built with TensorRT {sidecar.tensorrt_version}, this is TensorRT "
                        f"{tensorrt_version}")
    if gpu_name is not None and gpu_name != sidecar.gpu_name:
        problems.append(f"foreign: built on GPU {sidecar.gpu_name!r}, this GPU is {gpu_name!r}")
    if compute_capability is not None and compute_capability != sidecar.compute_capability:
        problems.append(f"foreign: built for compute capability {sidecar.compute_capability}, this GPU has "
                        f"{compute_capability}")
    if profile is not None:
        want = profile_table(profile)
        if want != sidecar.profile_table:
            problems.append(f"profile mismatch: the plan has profiles for profile {sidecar.profile_name!r} "
                            f"[{_table_str(sidecar.profile_table)}] (max_len x max_batch), the worker uses "
                            f"profile {profile.name!r} [{_table_str(want)}]")
    if problems:
        raise PlanSidecarError(
            f"TensorRT plan {plan_path} refused: " + "; ".join(problems) +
            f". Rebuild it on this machine: keyword-embedder build-engine --profile "
            f"{profile.name if profile else sidecar.profile_name} --output {plan_path}")


def check_plan(plan_path: str | Path, profile: Profile, *, cuda: Any, tensorrt_version: str,
               onnx_path: str | Path | None = None, device: int = 0,
               plan_bytes: bytes | None = None) -> tuple[PlanSidecar, str, str]:
    """(sidecar, gpu_name, compute_capability) when the plan fits this machine; PlanSidecarError otherwise.

    Fits: built on this GPU (name and compute capability, read through pycuda's `cuda`), with this
    TensorRT version, from this ONNX file (`onnx_path`, or the one the sidecar recorded when it
    exists here), for these buckets, and the sidecar belongs to this very plan. The TensorRT
    backend runs it at load; `build-engine --check` runs it to decide whether to rebuild.
    """
    sidecar = read_sidecar(plan_path)
    gpu_name, cc = gpu_identity(cuda, device)
    onnx_hash = None
    check_onnx = Path(onnx_path) if onnx_path else Path(sidecar.onnx_path)
    if onnx_path or check_onnx.is_file():  # the recorded path may be another machine's
        onnx_hash = sha256_file(check_onnx)
    plan_hash = hashlib.sha256(plan_bytes).hexdigest() if plan_bytes is not None else sha256_file(plan_path)
    validate_sidecar(sidecar, plan_path=plan_path, profile=profile, onnx_sha256=onnx_hash,
                     tensorrt_version=tensorrt_version, gpu_name=gpu_name, compute_capability=cc,
                     plan_sha256=plan_hash)
    return sidecar, gpu_name, cc


def onnx_exporter_version(onnx_path: str | Path) -> str:
    """producer_name/producer_version from the ONNX file's header (weights are not loaded)."""
    import onnx  # core dependency; imported here so importing this module stays cheap

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError, ... depending on the failure
        raise EngineBuildError(f"{onnx_path}: not a readable ONNX model ({exc})") from None
    name, version = model.producer_name or "unknown", model.producer_version or "unknown"
    return f"{name}/{version}"


# ---------------------------------------------------------------------------- gpu extra
def import_gpu_extra(*, need_pycuda: bool = True) -> tuple[ModuleType, ModuleType | None]:
    """(tensorrt, pycuda.driver), or one GpuExtraMissingError naming what is missing.

    Imported only here (and in the TensorRT backend), so that the CPU install never loads them.
    OSError is caught too: a tensorrt wheel whose libnvinfer cannot be loaded (no driver,
    wrong CUDA) fails with it rather than ImportError.
    """
    missing: list[str] = []
    trt = cuda = None
    try:
        import tensorrt as trt  # type: ignore[import-not-found, no-redef]
    except (ImportError, OSError) as exc:
        missing.append(f"tensorrt ({exc})")
    if need_pycuda:
        try:
            import pycuda.driver as cuda  # type: ignore[import-not-found, no-redef]
        except (ImportError, OSError) as exc:
            missing.append(f"pycuda ({exc})")
    if missing:
        raise GpuExtraMissingError(
            "the TensorRT backend needs the gpu extra, which cannot be imported: " + "; ".join(missing) +
            f". Install it on a machine with an NVIDIA GPU and driver: {GPU_INSTALL_HINT}")
    return trt, cuda  # type: ignore[return-value]


def gpu_identity(cuda: Any, device: int = 0) -> tuple[str, str]:
    """(name, "major.minor") of CUDA device `device` through pycuda's driver API."""
    cuda.init()
    dev = cuda.Device(device)
    major, minor = dev.compute_capability()
    return str(dev.name()), f"{major}.{minor}"


# ---------------------------------------------------------------------------- TensorRT build
def _check_network_inputs(network: Any) -> None:
    names = [network.get_input(i).name for i in range(network.num_inputs)]
    if sorted(names) != sorted(INPUT_NAMES):
        raise EngineBuildError(f"the ONNX graph has inputs {names}; the TensorRT backend feeds exactly "
                               f"{list(INPUT_NAMES)}")
    for i in range(network.num_inputs):
        shape = tuple(network.get_input(i).shape)
        if len(shape) != 2:
            raise EngineBuildError(f"input {network.get_input(i).name!r} has shape {shape}; expected "
                                   "[batch, sequence]")
    if network.num_outputs != 1:
        outs = [network.get_output(i).name for i in range(network.num_outputs)]
        raise EngineBuildError(f"the ONNX graph has outputs {outs}; expected one [batch, dim] embedding output")


def fp32_layer(name: str) -> bool:
    """Whether a parsed layer carries the name of a pooling or normalisation node of the exporter."""
    return name.startswith(FP32_NODE_PREFIXES)


def fp32_region(network: Any) -> list[int]:
    """Indexes of the layers that compute the pooling and the normalisation, found from the graph.

    Names alone miss layers: TensorRT's ONNX parser gives a node's name to the first layer it
    adds for the node only (ReduceL2's reduction and square root, the shuffles that broadcast a
    scalar operand keep "(Unnamed Layer* N) [...]"), and names an initializer's constant layer
    after the initializer (`count_min`, `norm_min`). So the named layers are the anchors, and
    the region is every layer downstream of one (up to the output), plus the constant
    subgraphs (constants and their shuffles: no path from a network input) that feed it.
    """
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    producer: dict[str, int] = {}
    consumers: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        for k in range(layer.num_outputs):
            producer[layer.get_output(k).name] = i
        for j in range(layer.num_inputs):
            t = layer.get_input(j)
            if t is not None:  # an optional input left out
                consumers.setdefault(t.name, []).append(i)
    network_inputs = {network.get_input(i).name for i in range(network.num_inputs)}

    def inputs_of(i: int) -> list[str]:
        return [t.name for j in range(layers[i].num_inputs) if (t := layers[i].get_input(j)) is not None]

    from_input: dict[str, bool] = {}

    def derived_from_input(tensor: str) -> bool:
        if tensor not in from_input:
            from_input[tensor] = False  # a cycle cannot occur in a network; this guards the recursion
            from_input[tensor] = tensor in network_inputs or (
                tensor in producer and any(derived_from_input(t) for t in inputs_of(producer[tensor])))
        return from_input[tensor]

    region: set[int] = set()
    todo = [i for i, layer in enumerate(layers) if fp32_layer(layer.name)]
    while todo:  # downstream of the anchors
        i = todo.pop()
        if i not in region:
            region.add(i)
            todo.extend(c for k in range(layers[i].num_outputs) for c in consumers.get(layers[i].get_output(k).name, []))
    todo = [producer[t] for i in region for t in inputs_of(i) if t in producer and not derived_from_input(t)]
    while todo:  # the constant subgraphs feeding the region
        i = todo.pop()
        if i not in region:
            region.add(i)
            todo.extend(producer[t] for t in inputs_of(i) if t in producer)
    return sorted(region)


def check_fp32_region(trt: Any, network: Any) -> int:
    """Checks that the parsed pooling/normalisation layers compute in FP32; returns how many were checked.

    In a strongly typed network a layer's type is its tensors' type, which the fp16 graph
    (engines/fp16_onnx.py) sets with Casts; this reads the parsed network back (reading a
    tensor's dtype is allowed on TensorRT 10 and 11 alike; setting it is not) so that a Cast left
    out shows up here, at build time, and not as a plan whose floors 1e-9 and 1e-12 are 0.
    """
    half = trt.float16
    n = 0
    for i in fp32_region(network):
        layer = network.get_layer(i)
        kinds = [layer.get_output(k).dtype for k in range(layer.num_outputs)]
        if half in kinds:
            raise EngineBuildError(f"fp16: layer {layer.name!r} of the pooling/normalisation region computes in "
                                   "FP16 in the parsed network; the fp16 ONNX graph lost a Cast to float32")
        n += 1
    if n == 0:
        raise EngineBuildError("fp16: no pooling/normalisation layer found by name "
                               f"({', '.join(FP32_NODE_PREFIXES)}) in the parsed network; build an FP32 plan "
                               "with --no-fp16")
    return n


def strongly_typed_flags(trt: Any) -> int:
    """`create_network`'s flags for a strongly typed network, on TensorRT 10 and 11 alike.

    10: strong typing is opt-in, NetworkDefinitionCreationFlag.STRONGLY_TYPED = 1 (so 1 << 1);
    11: always on, the flag kept for compatibility at value 0 and ignored, while 2 there means
    PREFER_JIT_PYTHON_PLUGINS. So the bit is taken from the enum, never written as a number.
    """
    flags = getattr(trt, "NetworkDefinitionCreationFlag", None)
    flag = getattr(flags, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def build_engine(onnx_path: str | Path, profile: Profile, output: str | Path, *, fp16: bool = True,
                 workspace_gib: float = DEFAULT_WORKSPACE_GIB, timing_cache: str | Path | None = None,
                 device: int = 0, log: Callable[[str], None] | None = None) -> PlanSidecar:
    """Parses the ONNX file, builds one optimisation profile per bucket, writes plan + sidecar.

    One strongly typed network on TensorRT 10.1+ and 11 alike: its arithmetic is the graph's
    types. fp16=True parses the fp16 graph of `onnx_path` (engines/fp16_onnx.py: the encoder in
    float16, the pooling and normalisation in float32; written beside the plan, fp16_onnx_path), fp16=False
    the file itself (FP32; TensorRT's TF32 matmuls stay on, its default). No precision flag and no
    per-layer precision is set: TensorRT 11 removed them, and 10 refuses them on a strongly typed
    network. The sidecar keeps the hash of `onnx_path` (what the backend and --check compare) and,
    under `extra`, that of the fp16 graph. The plan is written atomically (temporary file, then
    rename), its sidecar next to it; the timing cache, when given, is loaded first (if it exists)
    and saved after the build, so a rebuild on the same GPU skips most kernel timing.
    """
    say = log or (lambda msg: print(msg, file=sys.stderr))
    onnx_path, output = Path(onnx_path), Path(output)
    shapes = profile_shapes(profile)  # alignment errors before any GPU work
    if workspace_gib <= 0:
        raise EngineBuildError(f"workspace_gib must be positive, got {workspace_gib}")
    if not onnx_path.is_file():
        raise EngineBuildError(f"ONNX file {onnx_path} not found (export it: keyword-embedder export-onnx)")
    trt, cuda = import_gpu_extra()
    gpu_name, cc = gpu_identity(cuda, device)
    parse_path = onnx_path
    if fp16:
        from engines.fp16_onnx import Fp16Error, write_fp16_onnx

        try:
            parse_path = write_fp16_onnx(onnx_path, fp16_onnx_path(output))
        except Fp16Error as exc:
            raise EngineBuildError(f"fp16: {exc}") from None
        say(f"fp16: parsing {parse_path} (the encoder in float16, the pooling and normalisation in float32)")
    # TensorRT builds on the CUDA context current on this thread. Making `device`'s primary
    # context current (the one the runtime API uses, and the one the backend loads the plan
    # in) means the plan is built on the GPU the sidecar names, also on a multi-GPU host.
    # Retained once per process (engines/cuda_context.py says why it is never detached).
    primary_context(cuda, device).push()
    try:
        return _build(trt, onnx_path, parse_path, profile, output, shapes, fp16=fp16, workspace_gib=workspace_gib,
                      timing_cache=timing_cache, gpu_name=gpu_name, cc=cc, say=say)
    finally:
        cuda.Context.pop()


def _build(trt: Any, onnx_path: Path, parse_path: Path, profile: Profile, output: Path,
           shapes: Sequence[ProfileShape], *, fp16: bool, workspace_gib: float, timing_cache: str | Path | None,
           gpu_name: str, cc: str, say: Callable[[str], None]) -> PlanSidecar:
    say(f"building a TensorRT {trt.__version__} plan on {gpu_name} (sm {cc}) from {onnx_path}, "
        f"profile {profile.name!r}: {', '.join(f'{s.seq_len}x{s.max_batch}' for s in shapes)}, fp16={fp16}")

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # Strongly typed (strongly_typed_flags says why the bit comes from the enum); explicit batch
    # is every network's mode since TensorRT 10, and 11 removed the EXPLICIT_BATCH flag.
    network = builder.create_network(strongly_typed_flags(trt))
    parser = trt.OnnxParser(network, logger)
    # parse_from_file (not parse(bytes)) so weights stored as external data next to the file resolve.
    if not parser.parse_from_file(str(parse_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise EngineBuildError(f"TensorRT's ONNX parser rejected {parse_path}: " + " | ".join(errors))
    _check_network_inputs(network)

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    fp32_layers = 0
    if fp16:
        fp32_layers = check_fp32_region(trt, network)
        say(f"fp16: {fp32_layers} pooling/normalisation layers compute in FP32")
    for shape in shapes:
        opt_profile = builder.create_optimization_profile()
        for name in INPUT_NAMES:
            opt_profile.set_shape(name, shape.min, shape.opt, shape.max)
        index = config.add_optimization_profile(opt_profile)
        # The backend maps bucket i to profile i: the order here is that contract.
        if index != shape.index:
            raise EngineBuildError(f"TensorRT numbered optimisation profile {shape.index} as {index}; "
                                   "the bucket -> profile mapping would be wrong")

    cache_path = Path(timing_cache) if timing_cache else None
    if cache_path is not None:
        data = cache_path.read_bytes() if cache_path.is_file() else b""
        cache = config.create_timing_cache(data)
        if cache is None:  # TensorRT could not parse the file (truncated, not a timing cache)
            say(f"timing cache {cache_path} is unreadable; starting a new one (it is overwritten after the build)")
            data, cache = b"", config.create_timing_cache(b"")
        # ignore_mismatch=False: a cache from another GPU/TensorRT is rejected, not trusted.
        if cache is None or not config.set_timing_cache(cache, False):
            say(f"timing cache {cache_path} does not match this GPU/TensorRT; starting a new one")
            fresh = config.create_timing_cache(b"")
            if fresh is None or not config.set_timing_cache(fresh, False):
                raise EngineBuildError("TensorRT cannot create an empty timing cache; build without "
                                       "--timing-cache")
        elif data:
            say(f"timing cache {cache_path}: {len(data)} bytes loaded")

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError("TensorRT failed to build the plan (its log above says why; a larger "
                               "--workspace-gib helps when tactics were skipped for memory)")
    plan = bytes(serialized)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_bytes(plan)
    os.replace(tmp, output)
    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))

    sidecar = PlanSidecar(
        tensorrt_version=str(trt.__version__), gpu_name=gpu_name, compute_capability=cc,
        profile_name=profile.name, profile_table=profile_table(profile),
        onnx_sha256=sha256_file(onnx_path), onnx_path=str(onnx_path.resolve()), fp16=fp16,
        exporter_version=onnx_exporter_version(onnx_path),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        plan_sha256=hashlib.sha256(plan).hexdigest(),
        extra={"workspace_gib": workspace_gib, "fp32_layers": fp32_layers, "strongly_typed": True,
               **({"fp16_onnx": str(parse_path), "fp16_onnx_sha256": sha256_file(parse_path)} if fp16 else {})},
    )
    write_sidecar(output, sidecar)
    say(f"wrote {output} ({len(plan) / 1e6:.1f} MB) and {sidecar_path(output)}")
    return sidecar
