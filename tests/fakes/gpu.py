"""Fake tensorrt and pycuda.driver: the part of TensorRT 10's or 11's and pycuda's Python API the project uses.

They check the calls the way the real bindings fail: CUDA calls need the context pushed on the
calling thread, input shapes must lie inside the selected optimisation profile, the output is
computed from what was actually copied to "device" memory. By default a "plan" returns token
sums; with `FakeTrt(compute="onnxruntime")` it runs the ONNX file it was built from through
ONNX Runtime, so that a whole GPU script can pass on them (tests/fakes/gpu_modules installs
them as importable `tensorrt` and `pycuda` packages for a subprocess). What they cannot show is
that real TensorRT accepts the plan or produces the right numbers (docs/gpu.md).
"""

from __future__ import annotations

import json
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

DIM = 384


class FakeCuda(types.ModuleType):
    """pycuda.driver, as far as the backend uses it; every call checks a context is current."""

    def __init__(self, name: str = "NVIDIA L40S", cc: tuple[int, int] = (8, 9)) -> None:
        super().__init__("pycuda.driver")
        self.gpu_name, self.cc = name, cc
        # Further devices of a multi-GPU host: index -> (name, compute capability).
        self.other_devices: dict[int, tuple[str, tuple[int, int]]] = {}
        self.local = threading.local()
        self.memory: dict[int, np.ndarray] = {}
        self.host_live: set[int] = set()  # ids of page-locked allocations not yet freed
        self.next_ptr = 0x1000
        self.detached = 0
        self.pushes = 0
        self.retained: dict[int, int] = {}  # device -> primary-context references held (cuDevicePrimaryCtxRetain)
        # (thread, device) of each context pycuda's detach() left current: like pycuda's
        # context::detach, which pushes a non-current context, releases it and never pops it.
        self.left_current: list[tuple[int, int]] = []
        fake = self

        class Context:
            @staticmethod
            def pop() -> None:
                fake.stack().pop()

        class PrimaryContext:
            def __init__(self, device: int = 0) -> None:
                self.device, self.valid, self.thread = device, True, threading.get_ident()
                fake.retained[device] = fake.retained.get(device, 0) + 1

            def push(self) -> None:
                assert self.valid, "cannot activate dead context"
                fake.pushes += 1
                fake.stack().append(self)

            def detach(self) -> None:
                # pycuda's context::detach: on the retaining thread it pushes the context when it is
                # not current, releases it (cuDevicePrimaryCtxRelease does not pop) and leaves it
                # current; on another thread it releases nothing.
                if not self.valid:
                    raise RuntimeError("context::detach failed: invalid device context - cannot detach "
                                       "from invalid context")
                self.valid = False
                fake.detached += 1
                if threading.get_ident() == self.thread:
                    fake.retained[self.device] -= 1
                    fake.left_current.append((self.thread, self.device))

        class Device:
            def __init__(self, i: int) -> None:
                assert i == 0 or i in fake.other_devices, f"no CUDA device {i}"
                self.i = i

            def name(self) -> str:
                return fake.other_devices[self.i][0] if self.i else fake.gpu_name

            def compute_capability(self) -> tuple[int, int]:
                return fake.other_devices[self.i][1] if self.i else fake.cc

            def retain_primary_context(self) -> PrimaryContext:
                return PrimaryContext(self.i)

        class HostAllocation:
            """pycuda's page-locked block: the .base of the array pagelocked_empty returns."""

            def __init__(self, shape: Any, dtype: Any) -> None:
                self._mem = np.empty(shape, dtype)
                self.__array_interface__ = self._mem.__array_interface__
                fake.host_live.add(id(self))

            def free(self) -> None:
                fake.need_context()
                fake.host_live.discard(id(self))

        class Alloc:
            def __init__(self, nbytes: int) -> None:
                fake.need_context()
                self.ptr = fake.next_ptr
                fake.next_ptr += max(nbytes, 1) + 256
                fake.memory[self.ptr] = np.zeros(nbytes, np.uint8)

            def __int__(self) -> int:
                return self.ptr

            def free(self) -> None:
                fake.need_context()
                del fake.memory[self.ptr]

        class Stream:
            def __init__(self) -> None:
                fake.need_context()
                self.handle = fake.next_ptr
                fake.next_ptr += 16

            def synchronize(self) -> None:
                fake.need_context()

        self.Context, self.Device, self.Stream, self.Alloc = Context, Device, Stream, Alloc
        self.HostAllocation = HostAllocation

    def stack(self) -> list[Any]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def need_context(self) -> None:
        assert self.stack(), "CUDA call on a thread with no current context"

    def current_device(self) -> int:
        self.need_context()
        return int(self.stack()[-1].device)

    def init(self) -> None:
        pass

    def pagelocked_empty(self, shape: Any, dtype: Any) -> np.ndarray:
        self.need_context()
        arr = np.asarray(self.HostAllocation(shape, dtype))
        assert arr.base is not None and hasattr(arr.base, "free")
        return arr

    def mem_alloc(self, nbytes: int) -> Any:
        return self.Alloc(nbytes)

    def memcpy_htod_async(self, dest: Any, src: np.ndarray, stream: Any) -> None:
        self.need_context()
        assert src.flags.c_contiguous
        self.memory[int(dest)][: src.nbytes] = src.reshape(-1).view(np.uint8)

    def memcpy_dtoh_async(self, dest: np.ndarray, src: Any, stream: Any) -> None:
        self.need_context()
        assert dest.flags.c_contiguous
        dest.reshape(-1).view(np.uint8)[:] = self.memory[int(src)][: dest.nbytes]


class FakeDType:
    def __init__(self, name: str) -> None:
        self.name = name


class FakeEngine:
    """A 'plan' whose output row is [sum(ids*mask), sum(mask), seq_len, profile, 0...]."""

    def __init__(self, trt: FakeTrt, spec: dict[str, Any]) -> None:
        self.trt, self.spec = trt, spec
        self.names = ["input_ids", "attention_mask", "sentence_embedding"]
        self.num_io_tensors = 3
        self.num_optimization_profiles = len(spec["profiles"])
        self.contexts: list[FakeExecContext] = []
        self.creating = 0
        self.concurrent_creates = 0
        self.session: Any = None

    def onnxruntime(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        import onnxruntime as ort

        with self.trt.lock:
            if self.session is None:
                opts = ort.SessionOptions()
                opts.intra_op_num_threads = 1
                self.session = ort.InferenceSession(self.spec["onnx"], opts, providers=["CPUExecutionProvider"])
        # Only up to the longest row: masked positions change no output (what the backend's
        # padding relies on), and a fake padded to 256 would make the tests slow for nothing.
        n = max(1, int(np.flatnonzero(mask.any(0)).max(initial=0)) + 1)
        feed = {"input_ids": np.ascontiguousarray(ids[:, :n]), "attention_mask": np.ascontiguousarray(mask[:, :n])}
        return np.asarray(self.session.run(None, feed)[0], np.float32)

    def get_tensor_name(self, i: int) -> str:
        return self.names[i]

    def get_tensor_mode(self, name: str) -> str:
        return "OUTPUT" if name == "sentence_embedding" else "INPUT"

    def get_tensor_dtype(self, name: str) -> FakeDType:
        return FakeDType("FLOAT" if name == "sentence_embedding" else self.spec["input_dtype"])

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (-1, self.spec["dim"]) if name == "sentence_embedding" else (-1, -1)

    def get_tensor_profile_shape(self, name: str, i: int) -> list[tuple[int, int]]:
        L, opt, mx = self.spec["profiles"][i]
        return [(1, L), (opt, L), (mx, L)]

    def get_device_memory_size_for_profile_v2(self, i: int) -> int:
        return 1000 * (i + 1)

    def __getattr__(self, name: str) -> Any:
        # TensorRT 10 still has these (deprecated); 11 removed them: the project uses none.
        if self.trt.major < 11 and name in ("device_memory_size", "get_device_memory_size_for_profile",
                                            "create_execution_context_without_device_memory"):
            raise AssertionError(f"ICudaEngine.{name}: deprecated in 10, removed in 11; use the _v2 / "
                                 "USER_MANAGED forms")
        raise AttributeError(f"'tensorrt.ICudaEngine' object has no attribute {name!r}")

    def create_execution_context(self, strategy: str = "STATIC") -> FakeExecContext:
        self.trt.cuda.need_context()
        with self.trt.lock:
            self.creating += 1
            overlap = self.creating > 1
        time.sleep(0.005)  # long enough for a second dispatcher thread to arrive meanwhile
        with self.trt.lock:
            self.creating -= 1
        if overlap:
            self.concurrent_creates += 1
        ctx = FakeExecContext(self, strategy)
        self.contexts.append(ctx)
        return ctx


class FakeExecContext:
    def __init__(self, engine: FakeEngine, strategy: str) -> None:
        self.engine, self.strategy = engine, strategy
        self.profile: int | None = None
        self.addresses: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, int]] = {}
        self.shape_calls = 0
        self.device_memory: tuple[int, int] | None = None
        self.thread = threading.get_ident()

    def set_optimization_profile_async(self, i: int, stream: int) -> bool:
        # The real binding raises RuntimeError where the C++ call returns false, else True.
        self.engine.trt.cuda.need_context()
        if not 0 <= i < self.engine.num_optimization_profiles or i in self.engine.trt.refuse_profiles:
            raise RuntimeError("Error in set optimization profile async.")
        self.profile = i
        return True

    def set_device_memory(self, ptr: int, size: int) -> None:
        self.device_memory = (ptr, size)

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        # Like setTensorAddress: false for a name the engine has no I/O tensor for.
        assert ptr in self.engine.trt.cuda.memory
        if name not in self.engine.names or name in self.engine.trt.refuse_addresses:
            return False
        self.addresses[name] = ptr
        return True

    def set_input_shape(self, name: str, shape: tuple[int, int]) -> bool:
        self.shape_calls += 1
        assert self.profile is not None
        (mn, _, mx) = self.engine.get_tensor_profile_shape(name, self.profile)
        if not (mn[0] <= shape[0] <= mx[0] and mn[1] <= shape[1] <= mx[1]):
            return False
        self.shapes[name] = tuple(shape)  # type: ignore[assignment]
        return True

    def execute_async_v3(self, stream: int) -> bool:
        cuda = self.engine.trt.cuda
        cuda.need_context()
        assert threading.get_ident() == self.thread, "context run off its thread"
        if self.strategy == "USER_MANAGED":
            assert self.device_memory is not None, "user-managed context run without device memory"
        b, L = self.shapes["input_ids"]
        dt = np.dtype(np.int64 if self.engine.spec["input_dtype"] == "INT64" else np.int32)
        ids = cuda.memory[self.addresses["input_ids"]][: b * L * dt.itemsize].view(dt).reshape(b, L)
        mask = cuda.memory[self.addresses["attention_mask"]][: b * L * dt.itemsize].view(dt).reshape(b, L)
        dim = self.engine.spec["dim"]
        if self.engine.spec.get("onnx"):  # a plan that computes: the ONNX file it was built from
            out = self.engine.onnxruntime(ids.astype(np.int64), mask.astype(np.int64))
            if self.profile in self.engine.trt.nan_profiles:
                out[:] = np.nan
        else:
            out = np.zeros((b, dim), np.float32)
            out[:, 0] = (ids * mask).sum(1)
            out[:, 1] = mask.sum(1)
            out[:, 2] = L
            out[:, 3] = self.profile
        cuda.memory[self.addresses["sentence_embedding"]][: out.nbytes] = out.reshape(-1).view(np.uint8)
        return True


class FakeTrt(types.ModuleType):
    def __init__(self, cuda: FakeCuda, version: str = "10.3.0", *, compute: str = "token-sums") -> None:
        super().__init__("tensorrt")
        self.cuda = cuda
        # "token-sums": row = [sum(ids*mask), sum(mask), seq_len, profile, 0...]; "onnxruntime": the
        # plan runs the ONNX file it was built from (so parity can pass).
        self.compute = compute
        # Failures to inject: build_serialized_network returns None, deserialize_cuda_engine
        # returns None, a profile's outputs are NaN; a deserialisation that takes that long.
        self.fail_build = self.fail_deserialize = False
        self.nan_profiles: set[int] = set()
        self.deserialize_sleep_s = 0.0
        self.__version__ = version
        self.major = int(version.split(".")[0])
        self.networks: list[Any] = []
        self.errors: list[str] = []  # what the builder would log (a refused build)
        self.half_tensors: set[str] = set()  # tensors a test makes HALF after parsing
        self.lock = threading.Lock()
        self.refuse_profiles: set[int] = set()
        self.refuse_addresses: set[str] = set()
        self.float32, self.float16 = "FLOAT", "HALF"
        self.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
        self.ExecutionContextAllocationStrategy = types.SimpleNamespace(
            STATIC="STATIC", ON_PROFILE_CHANGE="ON_PROFILE_CHANGE", USER_MANAGED="USER_MANAGED")
        self.engines: list[FakeEngine] = []
        self.built: list[dict[str, Any]] = []
        trt = self

        class Logger:
            WARNING = 2

            def __init__(self, level: int) -> None:
                self.level = level

        class Runtime:
            def __init__(self, logger: Any) -> None:
                pass

            def deserialize_cuda_engine(self, data: bytes) -> FakeEngine | None:
                trt.cuda.need_context()
                time.sleep(trt.deserialize_sleep_s)
                if trt.fail_deserialize:
                    return None
                engine = FakeEngine(trt, json.loads(data))
                trt.engines.append(engine)
                return engine

        self.Logger, self.Runtime = Logger, Runtime
        self._install_builder()

    def _install_builder(self) -> None:
        """The builder API of TensorRT 10 (10.1+) or 11, as the version says.

        10: strong typing is opt-in (NetworkDefinitionCreationFlag.STRONGLY_TYPED = 1); on a
        strongly typed network, setting a layer's precision or output type, or a tensor's dtype,
        raises, and a build with a precision flag (FP16, OBEY_PRECISION_CONSTRAINTS, ...) fails.
        11: every network is strongly typed; the flag is kept at value 0 and ignored (1 is
        PREFER_JIT_PYTHON_PLUGINS, 2 PREFER_AOT_PYTHON_PLUGINS); the precision flags, ILayer's
        precision/set_output_type, a writable ITensor.dtype and EXPLICIT_BATCH are gone (an
        AttributeError, as pybind gives for a missing attribute).
        """
        import enum

        trt = self
        major = self.major
        self.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
        if major >= 11:
            self.NetworkDefinitionCreationFlag = enum.IntEnum(
                "NetworkDefinitionCreationFlag", {"STRONGLY_TYPED": 0, "PREFER_JIT_PYTHON_PLUGINS": 1,
                                                  "PREFER_AOT_PYTHON_PLUGINS": 2})
            self.BuilderFlag = types.SimpleNamespace(TF32="TF32", STRIP_PLAN="STRIP_PLAN", DEBUG="DEBUG",
                                                     DIRECT_IO="DIRECT_IO", REFIT="REFIT")
        else:
            self.NetworkDefinitionCreationFlag = enum.IntEnum(
                "NetworkDefinitionCreationFlag", {"EXPLICIT_BATCH": 0, "STRONGLY_TYPED": 1,
                                                  "PREFER_JIT_PYTHON_PLUGINS": 2, "PREFER_AOT_PYTHON_PLUGINS": 3})
            self.BuilderFlag = types.SimpleNamespace(
                FP16="FP16", BF16="BF16", INT8="INT8", FP8="FP8", TF32="TF32", STRIP_PLAN="STRIP_PLAN",
                OBEY_PRECISION_CONSTRAINTS="OBEY_PRECISION_CONSTRAINTS",
                PREFER_PRECISION_CONSTRAINTS="PREFER_PRECISION_CONSTRAINTS")
        precision_flags = {"FP16", "BF16", "INT8", "FP8", "OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS"}

        class StronglyTypedError(RuntimeError):
            pass

        class Tensor:
            def __init__(self, name: str, shape: tuple[int, ...] = (), dtype: str = "FLOAT") -> None:
                self.name, self.shape, self._dtype = name, shape, dtype
                self.network: Any = None

            @property
            def dtype(self) -> str:
                return self._dtype

            if major < 11:  # 11: read-only (def_property_readonly)
                @dtype.setter
                def dtype(self, value: str) -> None:
                    if self.network is not None and self.network.strongly_typed:
                        raise StronglyTypedError("ITensor::setType: not allowed on a strongly typed network")
                    self._dtype = value

        class Layer:
            def __init__(self, name: str, inputs: list[Tensor], outputs: list[Tensor]) -> None:
                self.name = name
                self.inputs, self.outputs = inputs, outputs
                self.num_inputs, self.num_outputs = len(inputs), len(outputs)
                self.network: Any = None
                self._precision = "DEFAULT"

            def get_input(self, i: int) -> Tensor:
                return self.inputs[i]

            def get_output(self, i: int) -> Tensor:
                return self.outputs[i]

            def get_output_type(self, i: int) -> str:  # kept in 11
                return self.outputs[i].dtype

        if major < 11:
            def _get_precision(layer: Any) -> str:
                return layer._precision

            def _set_precision(layer: Any, value: str) -> None:
                if layer.network.strongly_typed:
                    raise StronglyTypedError("ILayer::setPrecision: setting layer precision is not allowed on a "
                                             "strongly typed network")
                layer._precision = value

            def _set_output_type(layer: Any, i: int, dtype: str) -> None:
                if layer.network.strongly_typed:
                    raise StronglyTypedError("ILayer::setOutputType: setting layer output types is not allowed on "
                                             "a strongly typed network")
                layer.outputs[i]._dtype = dtype

            Layer.precision = property(_get_precision, _set_precision)  # type: ignore[attr-defined]
            Layer.set_output_type = _set_output_type  # type: ignore[attr-defined]

        class Network:
            """The parsed graph's tail, named as TensorRT's ONNX parser names layers.

            Only the first layer a node adds gets the node's name; the others keep TensorRT's
            "(Unnamed Layer* N) [Type]" (ReduceL2's squaring, the shuffles that broadcast a
            scalar to the other operand's rank); an initializer becomes a constant layer named
            after the initializer ("count_min", "norm_min"). (layer, inputs, outputs): a tensor
            is FLOAT unless it ends in ":i" (INT32); parsing an fp16 graph makes the encoder's
            tensors (":h") HALF, as a strongly typed network types them from the graph.
            """

            LAYERS = (
                ("embeddings_1_node", ["input_ids:i"], ["emb:h"]),
                ("(Unnamed Layer* 2) [Shuffle]", ["emb:h"], ["emb_heads:h"]),  # encoder: FP16 in an fp16 graph
                ("layer0_attn_5_node", ["emb_heads:h", "attention_mask:i"], ["hidden:h"]),
                ("pool_mask_u_88_node", ["attention_mask:i"], ["mask_u:i"]),
                ("pool_mask_89_node", ["mask_u:i"], ["mask_f"]),
                ("hidden_fp32_cast", ["hidden:h"], ["hidden32"]),
                ("masked_states_90_node", ["hidden32", "mask_f"], ["masked"]),
                ("pool_sum_91_node", ["masked"], ["summed"]),
                ("pool_count_92_node", ["mask_f"], ["count"]),
                ("count_min", [], ["count_min_w"]),
                ("(Unnamed Layer* 93) [Shuffle]", ["count_min_w"], ["count_min_b"]),
                ("pool_count_c_93_node", ["count", "count_min_b"], ["count_c"]),
                ("pooled_94_node", ["summed", "count_c"], ["pooled"]),
                ("(Unnamed Layer* 95) [ElementWise]", ["pooled", "pooled"], ["squares"]),
                ("norm_95_node", ["squares"], ["sum_squares"]),
                ("(Unnamed Layer* 96) [Unary]", ["sum_squares"], ["norm"]),
                ("norm_min", [], ["norm_min_w"]),
                ("(Unnamed Layer* 97) [Shuffle]", ["norm_min_w"], ["norm_min_b"]),
                ("norm_c_96_node", ["norm", "norm_min_b"], ["norm_c"]),
                ("sentence_embedding_node", ["pooled", "norm_c"], ["sentence_embedding"]),
            )

            def __init__(self, flags: int, strongly_typed: bool) -> None:
                self.flags, self.strongly_typed = flags, strongly_typed
                self.onnx_path = ""
                self.tensors: dict[str, Tensor] = {}
                self.half: set[str] = set()

                def tensor(spec: str) -> Tensor:
                    name, _, kind = spec.partition(":")
                    if kind == "h":
                        self.half.add(name)
                    t = self.tensors.setdefault(name, Tensor(name, (-1, -1), "INT32" if kind == "i" else "FLOAT"))
                    t.network = self
                    return t

                self.inputs = [tensor("input_ids:i"), tensor("attention_mask:i")]
                self.layers = [Layer(n, [tensor(t) for t in ins], [tensor(t) for t in outs])
                               for n, ins, outs in self.LAYERS]
                for layer in self.layers:
                    layer.network = self
                self.outputs = [self.tensors["sentence_embedding"]]
                self.outputs[0].shape = (-1, DIM)
                self.num_inputs, self.num_outputs = 2, 1
                self.num_layers = len(self.layers)

            def typed_from(self, onnx_path: str) -> None:
                """What parsing sets: a graph with float16 initializers makes the encoder's tensors HALF
                (and `trt.half_tensors`, for a test, any other tensor)."""
                import onnx

                model = onnx.load(onnx_path, load_external_data=False)
                if any(init.data_type == onnx.TensorProto.FLOAT16 for init in model.graph.initializer):
                    for name in self.half:
                        self.tensors[name]._dtype = "HALF"
                for name in trt.half_tensors:
                    self.tensors[name]._dtype = "HALF"

            def get_flag(self, flag: int) -> bool:
                return bool(self.flags & (1 << int(flag))) or (major >= 11 and int(flag) == 0)

            def get_layer(self, i: int) -> Layer:
                return self.layers[i]

            def get_input(self, i: int) -> Tensor:
                return self.inputs[i]

            def get_output(self, i: int) -> Tensor:
                return self.outputs[i]

        class OptProfile:
            def __init__(self) -> None:
                self.shapes: dict[str, tuple[Any, Any, Any]] = {}

            def set_shape(self, name: str, mn: Any, opt: Any, mx: Any) -> None:
                self.shapes[name] = (tuple(mn), tuple(opt), tuple(mx))

        class Cache:
            def __init__(self, data: bytes) -> None:
                self.data = data

            def serialize(self) -> bytes:
                return self.data + b"+tuned"

        class Config:
            def __init__(self) -> None:
                self.flags: set[str] = set()
                self.pools: dict[str, int] = {}
                self.profiles: list[OptProfile] = []
                self.cache: Cache | None = None

            def set_memory_pool_limit(self, pool: str, size: int) -> None:
                self.pools[pool] = size

            def set_flag(self, flag: str) -> None:
                self.flags.add(flag)

            def clear_flag(self, flag: str) -> None:
                self.flags.discard(flag)

            def add_optimization_profile(self, p: OptProfile) -> int:
                self.profiles.append(p)
                return len(self.profiles) - 1

            def create_timing_cache(self, data: bytes) -> Cache | None:
                return None if data.startswith(b"corrupt") else Cache(data)  # like createTimingCache

            def set_timing_cache(self, cache: Cache, ignore_mismatch: bool) -> bool:
                if cache is None:  # pybind refuses None for the reference parameter
                    raise TypeError("set_timing_cache(): incompatible function arguments")
                self.cache = cache
                return True

            def get_timing_cache(self) -> Cache:
                assert self.cache is not None
                return self.cache

        class Builder:
            def __init__(self, logger: Any) -> None:
                pass

            def create_network(self, flags: int = 0) -> Network:
                known = 0
                for flag in trt.NetworkDefinitionCreationFlag:
                    known |= 1 << int(flag)
                if flags & ~known:
                    raise TypeError(f"create_network(): unknown NetworkDefinitionCreationFlag bits {flags:#x}")
                strong = major >= 11 or bool(flags & (1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)))
                network = Network(flags, strong)
                trt.networks.append(network)
                return network

            def create_builder_config(self) -> Config:
                return Config()

            def create_optimization_profile(self) -> OptProfile:
                return OptProfile()

            def build_serialized_network(self, network: Network, config: Config) -> bytes | None:
                trt.built.append({"config": config, "network": network, "device": trt.cuda.current_device()})
                bad = sorted(config.flags & precision_flags)
                if network.strongly_typed and bad:
                    # TensorRT 10 logs "BuilderFlag::kFP16 is not compatible with a strongly typed network"
                    # and returns no plan.
                    trt.errors.append(f"{', '.join(bad)} not compatible with a strongly typed network")
                    return None
                if trt.fail_build:
                    return None
                profiles = []
                for p in config.profiles:
                    (mn, opt, mx) = p.shapes["input_ids"]
                    assert p.shapes["attention_mask"] == p.shapes["input_ids"]
                    profiles.append([mx[1], opt[0], mx[0]])
                onnx = network.onnx_path if trt.compute == "onnxruntime" else None
                return json.dumps({"profiles": profiles, "dim": DIM, "input_dtype": "INT64", "onnx": onnx}).encode()

        class OnnxParser:
            def __init__(self, network: Network, logger: Any) -> None:
                self.num_errors = 0
                self.network = network

            def parse_from_file(self, path: str) -> bool:
                if not Path(path).is_file():
                    return False
                self.network.onnx_path = path
                self.network.typed_from(path)
                return True

        if major < 11:
            def supports_model(parser: Any, model: bytes) -> tuple[bool, list[Any]]:  # removed in 11
                return True, []

            OnnxParser.supports_model = supports_model  # type: ignore[attr-defined]

        self.Builder, self.OnnxParser = Builder, OnnxParser
        self.StronglyTypedError = StronglyTypedError


FAMILIES = Path(__file__).resolve().parents[1] / "data" / "families"


def tiny_onnx(path: Path) -> Path:
    """The exporter's graph of the tiny BERT fixture (tests/data/families/bert): small, and named as
    the exporter names its pooling and normalisation, so that an fp16 build can convert it."""
    import onnx

    from engines.onnx_export.export import build_model

    onnx.save(build_model(FAMILIES / "bert"), str(path))
    return path


def install_fakes(monkeypatch: Any, *, compute: str = "token-sums", version: str = "10.3.0") -> FakeTrt:
    """A new FakeCuda and FakeTrt (TensorRT `version`: 10.x or 11.x) as `tensorrt`, `pycuda` and
    `pycuda.driver` for one test (pytest's monkeypatch)."""
    import sys

    cuda = FakeCuda()
    trt = FakeTrt(cuda, version, compute=compute)
    pycuda = types.ModuleType("pycuda")
    pycuda.driver = cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "pycuda", pycuda)
    monkeypatch.setitem(sys.modules, "pycuda.driver", cuda)
    return trt


FAKE_TORCH = Path(__file__).resolve().parent / "gpu_modules" / "torch" / "__init__.py"


def install_fake_torch(monkeypatch: Any, *, cuda: bool = True, capability: tuple[int, int] = (9, 0),
                       cuda_version: str | None = "13.0", warning: str = "",
                       perturb: dict[str, float] | None = None) -> Any:
    """A fresh numpy-backed fake `torch` (tests/fakes/gpu_modules/torch) as `torch` and its submodules
    for one test; its knobs (`torch._fake`) set as given. Restored by pytest's monkeypatch."""
    import importlib.util
    import sys

    names = ["torch", "torch.cuda", "torch.nn", "torch.nn.functional", "torch.version"]
    for name in names:  # recorded as they are now, so that the undo removes what the load adds
        monkeypatch.setitem(sys.modules, name, None)
    spec = importlib.util.spec_from_file_location("torch", FAKE_TORCH, submodule_search_locations=[])
    assert spec is not None and spec.loader is not None
    torch = importlib.util.module_from_spec(spec)
    sys.modules["torch"] = torch
    spec.loader.exec_module(torch)
    for name, module in {"torch": torch, **torch.SUBMODULES}.items():
        monkeypatch.setitem(sys.modules, name, module)
    state = torch._fake
    state.cuda_available, state.capability, state.warning = cuda, capability, warning
    state.perturb = dict(perturb or {})
    torch.version.cuda = state.cuda_version = cuda_version
    return torch
