"""A numpy-backed fake `torch`: exactly the part of PyTorch's API that worker/backends/torch_cuda.py uses,
so that the torch backend runs in CI on CPU (tests/unit/worker/backends/test_torch_cuda.py; tests/fakes/gpu.py
install_fake_torch loads a fresh copy per test, and this folder on PYTHONPATH makes it importable
in a subprocess).

What it computes: tensors are numpy arrays with a torch dtype and device; float16 is numpy's
float16 and bfloat16 is float32 rounded to bf16's 8 mantissa bits after every op; every float op
computes in float32 and rounds to its dtype, as tensor cores accumulate. "cuda" tensors live in
host memory like the rest, but never mix with "cpu" ones, and `.numpy()` refuses them.

What it checks, as PyTorch and CUDA would fail:
- dtypes: linear, embedding, layer_norm and scaled_dot_product_attention want matching dtypes;
- inference mode (thread-local): tensors made under it refuse in-place updates outside it;
- streams (thread-local current stream): a non-blocking copy between pinned host memory and the
  device is queued on the current stream and only happens at a sync point of that stream (its
  synchronize, an event recorded after it, torch.cuda.synchronize) or before the stream's next
  device op: reading a pinned output before the event shows stale data;
- CUDA graphs: `torch.cuda.graph(g)` records every device op the capturing thread runs and
  `g.replay()` runs the recording again, writing into the same output tensors (static
  addresses); what a capture made holds garbage (NaN) until the first replay. Refused: a capture
  on the default stream, a second capture while one is underway, a sync inside a capture, any
  device op from another thread while a capture is underway (in "global" mode; recorded as a
  violation in any mode), and an op whose library state is made lazily (cuBLAS for linear, the
  attention kernels) seen for the first time inside a capture: warm up on a side stream first
  (a stylised form of the lazy initialisation that real captures trip over).
What it cannot show: speed, the real kernels' numbers, memory pools, real concurrency on a GPU.

Knobs (environment at import, or `torch._fake` in process): FAKE_TORCH_CUDA=0 (no usable device),
FAKE_TORCH_CUDA_VERSION= (empty: a CPU-only build), FAKE_TORCH_CC=8.0, FAKE_TORCH_DEVICE=name,
FAKE_TORCH_WARNING=text (what is_available warns), FAKE_TORCH_PERTURB=float16:0.05 (linear in
that dtype adds an error of that relative size: a precision that misses the parity gate).
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import math
import os
import sys
import threading
import types
import warnings
from typing import Any

import numpy as np

__version__ = "2.11.0+fake"


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.cuda_available = os.environ.get("FAKE_TORCH_CUDA", "1") == "1"
        self.cuda_version: str | None = os.environ.get("FAKE_TORCH_CUDA_VERSION", "13.0") or None
        self.device_name = os.environ.get("FAKE_TORCH_DEVICE", "NVIDIA H200")
        self.capability = tuple(int(x) for x in os.environ.get("FAKE_TORCH_CC", "9.0").split("."))
        self.warning = os.environ.get("FAKE_TORCH_WARNING", "")
        self.perturb: dict[str, float] = {}
        for item in filter(None, os.environ.get("FAKE_TORCH_PERTURB", "").split(",")):
            name, _, size = item.partition(":")
            self.perturb[name] = float(size)
        self.oom = False  # device allocations raise torch.cuda.OutOfMemoryError
        self.capture: Any = None  # the _GraphContext of the capture underway
        self.violations: list[str] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.warmed: set[str] = set()
        self.local = threading.local()


_fake = _State()


# ---------------------------------------------------------------------------- dtypes and devices
class dtype:
    def __init__(self, name: str, np_dtype: Any, is_floating_point: builtins.bool, itemsize: builtins.int) -> None:
        self.name, self.np, self.is_floating_point, self.itemsize = name, np.dtype(np_dtype), is_floating_point, itemsize

    def __repr__(self) -> str:
        return f"torch.{self.name}"


float32 = dtype("float32", np.float32, True, 4)
float16 = dtype("float16", np.float16, True, 2)
bfloat16 = dtype("bfloat16", np.float32, True, 2)  # stored as float32, rounded to bf16 after every op
int64 = dtype("int64", np.int64, False, 8)
int32 = dtype("int32", np.int32, False, 4)
_bool = dtype("bool", np.bool_, False, 1)
_BY_NUMPY = {np.dtype(np.float32): float32, np.dtype(np.float16): float16, np.dtype(np.int64): int64,
             np.dtype(np.int32): int32, np.dtype(np.bool_): _bool}


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16's precision (round to nearest even), kept as float32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = a.view(np.uint32)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32).reshape(a.shape)


def _cast(a: Any, dt: dtype) -> np.ndarray:
    out = np.asarray(a).astype(dt.np, copy=False)
    return _bf16(out) if dt is bfloat16 else out


class device:
    def __init__(self, type: str | device, index: builtins.int | None = None) -> None:  # noqa: A002 - torch's name
        if isinstance(type, device):
            self.type, self.index = type.type, type.index
            return
        name, _, idx = str(type).partition(":")
        if name not in ("cpu", "cuda"):
            raise RuntimeError(f"Expected one of cpu, cuda device type at start of device string: {type}")
        self.type = name
        self.index = (builtins.int(idx) if idx else (index if index is not None else 0)) if name == "cuda" else None

    def __eq__(self, other: object) -> builtins.bool:
        return isinstance(other, device) and (self.type, self.index) == (other.type, other.index)

    def __hash__(self) -> builtins.int:
        return hash((self.type, self.index))

    def __repr__(self) -> str:
        return f"device(type='{self.type}'" + (f", index={self.index})" if self.index is not None else ")")


_CPU = device("cpu")


def _as_device(d: Any) -> device:
    if d is None:
        return _CPU
    if isinstance(d, builtins.int):
        return device("cuda", d)
    return d if isinstance(d, device) else device(d)


# ---------------------------------------------------------------------------- modes, streams, capture
def _inference_on() -> builtins.bool:
    return getattr(_fake.local, "inference", 0) > 0


class inference_mode(contextlib.ContextDecorator):
    def __init__(self, mode: builtins.bool = True) -> None:
        self.mode = mode

    def __enter__(self) -> None:
        _fake.local.inference = getattr(_fake.local, "inference", 0) + (1 if self.mode else 0)

    def __exit__(self, *exc: Any) -> None:
        _fake.local.inference = getattr(_fake.local, "inference", 0) - (1 if self.mode else 0)


class _Stream:
    _ids = 0

    def __init__(self, device: Any = None, *, default: builtins.bool = False) -> None:
        if not _fake.cuda_available:
            raise RuntimeError("Found no NVIDIA driver on your system.")
        self.device = _as_device(device if device is not None else "cuda")
        self.default = default
        self._pending: list[tuple[builtins.int, Any]] = []
        self._seq = 0
        self._lock = threading.Lock()
        _Stream._ids += 1
        self.id = _Stream._ids

    def _enqueue(self, fn: Any) -> None:
        with self._lock:
            self._seq += 1
            self._pending.append((self._seq, fn))

    def _flush(self, upto: builtins.int | None = None) -> None:
        with self._lock:
            due = [(s, f) for s, f in self._pending if upto is None or s <= upto]
            self._pending = [(s, f) for s, f in self._pending if not (upto is None or s <= upto)]
        for _, fn in due:
            fn()

    def synchronize(self) -> None:
        _no_sync_in_capture("Stream.synchronize")
        self._flush()

    def wait_stream(self, other: _Stream) -> None:
        other._flush()  # the dependency: this stream's later work sees other's queued work done

    def record_event(self, event: Any = None) -> Any:
        event = event or Event()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream id={self.id}{' default' if self.default else ''}>"


_DEFAULT_STREAMS: dict[builtins.int, _Stream] = {}


def _default_stream(index: builtins.int = 0) -> _Stream:
    with _fake.lock:
        if index not in _DEFAULT_STREAMS:
            _DEFAULT_STREAMS[index] = _Stream(device("cuda", index), default=True)
        return _DEFAULT_STREAMS[index]


def _current_stream() -> _Stream:
    return getattr(_fake.local, "stream", None) or _default_stream()


def _no_sync_in_capture(what: str) -> None:
    cap = _fake.capture
    if cap is not None and cap.thread == threading.get_ident():
        _fake.violations.append(f"{what} during capture")
        raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({what})")


_LAZY = {"linear", "scaled_dot_product_attention"}


def _device_op(kind: str, dev: device) -> None:
    """What every device op goes through: the capture rules, the stream's queued copies, warm-up."""
    if dev.type != "cuda":
        return
    if _fake.oom:
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (fake)")
    cap = _fake.capture
    me = threading.get_ident()
    if cap is not None and cap.thread != me:
        _fake.violations.append(f"{kind} on another thread during a capture")
        if cap.mode == "global":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (another thread's "
                               f"{kind} while a CUDA graph is being captured)")
    stream = _current_stream()
    stream._flush()
    if cap is not None and cap.thread == me:
        if kind in _LAZY and kind not in _fake.warmed:
            _fake.violations.append(f"{kind} first used inside a capture")
            raise RuntimeError(f"{kind}: first use inside a CUDA graph capture (its library state would be made "
                               "during capture); warm up on a side stream before capturing")
    elif not stream.default:
        _fake.warmed.add(kind)


# ---------------------------------------------------------------------------- tensors
def _promote(a: Tensor, b: Any) -> dtype:
    if not isinstance(b, Tensor):
        if isinstance(b, builtins.float) and not a.dtype.is_floating_point:
            return float32
        return a.dtype
    if a.dtype is b.dtype:
        return a.dtype
    if a.dtype.is_floating_point and b.dtype.is_floating_point:
        return float32
    if a.dtype.is_floating_point:
        return a.dtype
    if b.dtype.is_floating_point:
        return b.dtype
    return int64


def _record(out: Tensor, fn: Any, inputs: tuple[Any, ...]) -> None:
    cap = _fake.capture
    if cap is not None and cap.thread == threading.get_ident() and out.device.type == "cuda":
        cap.graph._tape.append((out, fn, inputs))
        cap.made.append(out)


def _compute(kind: str, fn: Any, inputs: tuple[Any, ...], dt: dtype, dev: device) -> Tensor:
    """Runs fn on the inputs' arrays now (Tensors by their arrays, anything else as is) and, inside a
    capture, records it for replay into the same output."""
    _device_op(kind, dev)
    arrays = [x._a if isinstance(x, Tensor) else x for x in inputs]
    out = Tensor(_cast(fn(*arrays), dt), dt, dev)
    if not out._a.flags.writeable or out._a.base is not None:
        out._a = out._a.copy()
    _record(out, lambda *a: _cast(fn(*a), dt), inputs)
    return out


def _view(kind: str, src: Tensor, fn: Any) -> Tensor:
    """fn(src's array): a view of its memory (shared, so replays reach it), or, where numpy had to copy
    (a reshape of a non-contiguous array), a computed op recorded like the others."""
    _device_op(kind, src.device)
    arr = fn(src._a)
    out = Tensor(arr, src.dtype, src.device, pinned=src._pinned)
    out._inference = src._inference or out._inference  # a view of an inference tensor is one
    if not np.shares_memory(arr, src._a):
        _record(out, fn, (src,))
    return out


def _same_device(*tensors: Any) -> device:
    devs = {t.device for t in tensors if isinstance(t, Tensor)}
    if len(devs) > 1:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{', '.join(map(str, devs))}!")
    return next(iter(devs))


class Tensor:
    def __init__(self, a: np.ndarray, dt: dtype, dev: device, *, pinned: builtins.bool = False) -> None:
        self._a, self.dtype, self.device, self._pinned = a, dt, dev, pinned
        self._inference = _inference_on()

    # -- shape
    @property
    def shape(self) -> tuple[builtins.int, ...]:
        return tuple(self._a.shape)

    def size(self, dim: builtins.int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> builtins.int:
        return self._a.ndim

    @property
    def ndim(self) -> builtins.int:
        return self._a.ndim

    def numel(self) -> builtins.int:
        return builtins.int(self._a.size)

    @property
    def is_cuda(self) -> builtins.bool:
        return self.device.type == "cuda"

    def is_pinned(self) -> builtins.bool:
        return self._pinned

    def __repr__(self) -> str:
        return f"FakeTensor(shape={self.shape}, dtype={self.dtype}, device={self.device})"

    # -- arithmetic
    def _binary(self, other: Any, fn: Any, kind: str) -> Tensor:
        dev = _same_device(self, other)
        dt = _promote(self, other)
        return _compute(kind, lambda a, b: fn(np.asarray(a, np.float32) if dt.is_floating_point else a,
                                                 np.asarray(b, np.float32) if dt.is_floating_point else b),
                        (self, other), dt, dev)

    def __add__(self, other: Any) -> Tensor:
        return self._binary(other, np.add, "add")

    __radd__ = __add__

    def __sub__(self, other: Any) -> Tensor:
        return self._binary(other, np.subtract, "sub")

    def __rsub__(self, other: Any) -> Tensor:
        return self._binary(other, lambda a, b: np.subtract(b, a), "sub")

    def __mul__(self, other: Any) -> Tensor:
        return self._binary(other, np.multiply, "mul")

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> Tensor:
        return self._binary(other, np.divide, "div")

    def __gt__(self, other: Any) -> Tensor:
        return _compute("gt", lambda a, b: np.greater(a, b), (self, other), _bool, _same_device(self, other))

    def sum(self, dim: Any = None, keepdim: builtins.bool = False) -> Tensor:
        dt = self.dtype if self.dtype.is_floating_point else int64
        return _compute("sum", lambda a: np.sum(np.asarray(a, np.float32) if dt.is_floating_point else a,
                                                axis=dim, keepdims=keepdim), (self,), dt, self.device)

    def clamp(self, min: Any = None, max: Any = None) -> Tensor:  # noqa: A002 - torch's names
        return _compute("clamp", lambda a: np.clip(a, min, max), (self,), self.dtype, self.device)

    # -- views
    def __getitem__(self, idx: Any) -> Tensor:
        if isinstance(idx, Tensor):
            raise NotImplementedError("fake torch: indexing by a tensor (use F.embedding)")
        return _view("getitem", self, lambda a: a[idx])

    def view(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if len(shape) == 1 and isinstance(shape[0], dtype):
            raise NotImplementedError("fake torch: view(dtype)")
        def as_view(a: np.ndarray) -> np.ndarray:
            v = a.view()
            v.shape = shape  # AttributeError where a copy would be needed
            return v

        try:
            return _view("view", self, as_view)
        except AttributeError:
            raise RuntimeError(f"view size is not compatible with input tensor's size and stride (at least one "
                               f"dimension spans across two contiguous subspaces). Use .reshape(...) instead. "
                               f"{self.shape} -> {shape}") from None

    def reshape(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return _view("reshape", self, lambda a: a.reshape(shape))

    def permute(self, *dims: builtins.int) -> Tensor:
        return _view("permute", self, lambda a: np.transpose(a, dims))

    def transpose(self, d0: builtins.int, d1: builtins.int) -> Tensor:
        return _view("transpose", self, lambda a: np.swapaxes(a, d0, d1))

    def unsqueeze(self, d: builtins.int) -> Tensor:
        axis = d if d >= 0 else self._a.ndim + 1 + d
        return _view("unsqueeze", self, lambda a: np.expand_dims(a, axis))

    def unbind(self, dim: builtins.int = 0) -> tuple[Tensor, ...]:
        index = (slice(None),) * (dim % self._a.ndim)
        return tuple(_view("unbind", self, lambda a, i=i: a[index + (i,)]) for i in range(self._a.shape[dim]))

    def contiguous(self) -> Tensor:
        if self._a.flags.c_contiguous:
            return self
        return _compute("contiguous", np.ascontiguousarray, (self,), self.dtype, self.device)

    # -- dtype and device
    def float(self) -> Tensor:
        return self.to(float32)

    def half(self) -> Tensor:
        return self.to(float16)

    def bool(self) -> Tensor:
        return self.to(_bool)

    def long(self) -> Tensor:
        return self.to(int64)

    def to(self, *args: Any, device: Any = None, dtype: Any = None, non_blocking: builtins.bool = False,
           copy: builtins.bool = False) -> Tensor:
        for arg in args:
            if isinstance(arg, globals()["dtype"]):
                dtype = arg
            else:
                device = arg
        dt = dtype or self.dtype
        dev = _as_device(device) if device is not None else self.device
        if dev == self.device:
            if dt is self.dtype and not copy:
                return self
            return _compute("cast", lambda a: a, (self,), dt, dev)
        # A transfer: into a new tensor on the other side.
        out = Tensor(np.empty(self._a.shape, dt.np), dt, dev)
        out.copy_(self, non_blocking=non_blocking, _new=True)
        return out

    def cuda(self, device: Any = None, non_blocking: builtins.bool = False) -> Tensor:
        return self.to(_as_device(device if device is not None else "cuda"), non_blocking=non_blocking)

    def cpu(self) -> Tensor:
        if self.device.type == "cpu":
            return self
        _no_sync_in_capture(".cpu()")
        return self.to(_CPU)

    def numpy(self) -> np.ndarray:
        if self.device.type != "cpu":
            raise TypeError(f"can't convert {self.device.type}:{self.device.index} device type tensor to numpy. "
                            "Use Tensor.cpu() to copy the tensor to host memory first.")
        return self._a

    def item(self) -> Any:
        _no_sync_in_capture(".item()")
        return self._a.item()

    def pin_memory(self) -> Tensor:
        if not _fake.cuda_available:
            raise RuntimeError("Cannot access accelerator device when none is available.")
        _fake.counts["pin_memory_calls"] += 1
        return Tensor(self._a.copy(), self.dtype, _CPU, pinned=True)

    # -- in place
    def _check_inplace(self) -> None:
        if self._inference and not _inference_on():
            raise RuntimeError("Inplace update to inference tensor outside InferenceMode is not allowed. You can make "
                               "a clone to get a normal tensor before doing inplace update.")

    def copy_(self, src: Tensor, non_blocking: builtins.bool = False, *, _new: builtins.bool = False) -> Tensor:
        if not _new:
            self._check_inplace()
        if src.shape != self.shape:
            try:
                np.broadcast_to(src._a, self.shape)
            except ValueError:
                raise RuntimeError(f"copy_: shapes {src.shape} and {self.shape} do not match") from None
        dst = self

        def do() -> None:
            np.copyto(dst._a, _cast(src._a, dst.dtype), casting="unsafe")

        cuda_side = self.device if self.device.type == "cuda" else src.device
        if self.device.type == "cuda" and src.device.type == "cuda":
            _device_op("copy", self.device)
            do()
            cap = _fake.capture
            if cap is not None and cap.thread == threading.get_ident():
                cap.graph._tape.append((None, do, ()))
            return self
        if cuda_side.type == "cpu":
            do()
            return self
        # Host <-> device. Inside a capture nothing host-side may be captured here.
        _no_sync_in_capture("a host<->device copy_")
        _device_op("copy", cuda_side)
        host = src if src.device.type == "cpu" else self
        if non_blocking and host._pinned:
            _current_stream()._enqueue(do)  # happens at the stream's next sync point or device op
            _fake.counts["async_copies"] += 1
        else:
            _current_stream()._flush()
            do()  # pageable memory (or blocking): a synchronous copy
        return self

    def fill_(self, value: Any) -> Tensor:
        self._check_inplace()
        _device_op("fill", self.device)
        self._a[...] = value
        return self

    def zero_(self) -> Tensor:
        return self.fill_(0)

    def __setitem__(self, idx: Any, value: Any) -> None:
        self._check_inplace()
        _device_op("setitem", self.device)
        self._a[idx] = value._a if isinstance(value, Tensor) else value


# ---------------------------------------------------------------------------- factories
def _new(shape: Any, dt: dtype | None, dev: Any, fill: Any, pin_memory: builtins.bool) -> Tensor:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    dt = dt or float32
    d = _as_device(dev)
    if d.type == "cuda":
        if not _fake.cuda_available:
            raise RuntimeError("Found no NVIDIA driver on your system.")
        _device_op("empty", d)
        _fake.counts["device_allocations"] += 1
    if pin_memory:
        if d.type != "cpu":
            raise RuntimeError("Only dense CPU tensors can be pinned")
        if not _fake.cuda_available:
            raise RuntimeError("Cannot access accelerator device when none is available.")
        _fake.counts["pinned_allocations"] += 1
    a = np.empty(shape, dt.np) if fill is None else np.full(shape, fill, dt.np)
    if fill is None and dt.is_floating_point:
        a.fill(np.nan)  # uninitialised memory
    return Tensor(a, dt, d, pinned=pin_memory)


def empty(*shape: Any, dtype: dtype | None = None, device: Any = None, pin_memory: builtins.bool = False) -> Tensor:
    return _new(shape, dtype, device, None, pin_memory)


def zeros(*shape: Any, dtype: dtype | None = None, device: Any = None, pin_memory: builtins.bool = False) -> Tensor:
    return _new(shape, dtype, device, 0, pin_memory)


def ones(*shape: Any, dtype: dtype | None = None, device: Any = None, pin_memory: builtins.bool = False) -> Tensor:
    return _new(shape, dtype, device, 1, pin_memory)


def zeros_like(t: Tensor, dtype: dtype | None = None, device: Any = None) -> Tensor:
    return zeros(t.shape, dtype=dtype or t.dtype, device=device or t.device)


def from_numpy(a: np.ndarray) -> Tensor:
    if not a.flags.writeable:
        warnings.warn("The given NumPy array is not writable, and PyTorch does not support non-writable tensors.",
                      UserWarning, stacklevel=2)
    try:
        dt = _BY_NUMPY[a.dtype]
    except KeyError:
        raise TypeError(f"can't convert np.ndarray of type {a.dtype}") from None
    return Tensor(a, dt, _CPU)


# ---------------------------------------------------------------------------- torch.nn.functional
def _erf(x: np.ndarray) -> np.ndarray:
    """erf, Abramowitz and Stegun 7.1.26 (|error| < 1.5e-7): numpy has none, and the fake needs no scipy."""
    sign = np.sign(x)
    x = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * x)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t \
        * np.exp(-x * x)
    return sign * y


def _need_same_dtype(what: str, *tensors: Any) -> None:
    kinds = {t.dtype for t in tensors if isinstance(t, Tensor)}
    if len(kinds) > 1:
        raise RuntimeError(f"{what}: expected all inputs to have the same dtype, got {sorted(map(str, kinds))}")


def _perturbed(dt: dtype, y: np.ndarray) -> np.ndarray:
    size = _fake.perturb.get(dt.name)
    if not size:
        return y
    direction = np.random.default_rng(0).standard_normal(y.shape[-1]).astype(np.float32)
    return y + size * np.float32(np.abs(y).mean()) * direction


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    _need_same_dtype("linear (expected mat1 and mat2 to have the same dtype)", x, weight, bias)
    dev = _same_device(x, weight, bias)
    dt = x.dtype

    def fn(a: np.ndarray, w: np.ndarray, b: Any) -> np.ndarray:
        y = np.matmul(np.asarray(a, np.float32), np.asarray(w, np.float32).T)
        if b is not None:
            y = y + np.asarray(b, np.float32)
        return _perturbed(dt, y)

    return _compute("linear", fn, (x, weight, bias), dt, dev)


def _embedding(ids: Tensor, weight: Tensor) -> Tensor:
    if ids.dtype not in (int64, int32):
        raise RuntimeError("Expected tensor for argument #1 'indices' to have one of the following scalar types: "
                           f"Long, Int; but got {ids.dtype} instead")
    return _compute("embedding", lambda i, w: np.take(w, i, axis=0), (ids, weight), weight.dtype,
                    _same_device(ids, weight))


def _layer_norm(x: Tensor, normalized_shape: Any, weight: Tensor | None = None, bias: Tensor | None = None,
                eps: builtins.float = 1e-5) -> Tensor:
    _need_same_dtype("layer_norm", x, weight, bias)

    def fn(a: np.ndarray, w: Any, b: Any) -> np.ndarray:
        a = np.asarray(a, np.float32)
        mean = a.mean(-1, keepdims=True)
        var = ((a - mean) ** 2).mean(-1, keepdims=True)
        y = (a - mean) / np.sqrt(var + np.float32(eps))
        if w is not None:
            y = y * np.asarray(w, np.float32)
        if b is not None:
            y = y + np.asarray(b, np.float32)
        return y

    return _compute("layer_norm", fn, (x, weight, bias), x.dtype, _same_device(x, weight, bias))


def _sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, dropout_p: builtins.float = 0.0,
          is_causal: builtins.bool = False, scale: builtins.float | None = None) -> Tensor:
    _need_same_dtype("scaled_dot_product_attention", q, k, v)
    if attn_mask is not None and attn_mask.dtype is not _bool:
        _need_same_dtype("scaled_dot_product_attention (a float mask)", q, attn_mask)
    if dropout_p or is_causal:
        raise NotImplementedError("fake torch: dropout or a causal mask")

    def fn(qa: np.ndarray, ka: np.ndarray, va: np.ndarray, m: Any) -> np.ndarray:
        qa, ka, va = (np.asarray(t, np.float32) for t in (qa, ka, va))
        s = np.matmul(qa, np.swapaxes(ka, -1, -2)) * np.float32(scale or 1.0 / math.sqrt(qa.shape[-1]))
        if m is not None:
            s = np.where(m, s, -np.inf) if m.dtype == np.bool_ else s + np.asarray(m, np.float32)
        s = s - s.max(-1, keepdims=True)
        p = np.exp(s)
        p = p / p.sum(-1, keepdims=True)
        return np.matmul(p, va)

    return _compute("scaled_dot_product_attention", fn, (q, k, v, attn_mask), q.dtype, _same_device(q, k, v, attn_mask))


def _gelu(x: Tensor, approximate: str = "none") -> Tensor:
    if approximate != "none":
        raise NotImplementedError("fake torch: tanh GELU")
    return _compute("gelu", lambda a: 0.5 * np.asarray(a, np.float32) * (1.0 + _erf(np.asarray(a, np.float32) /
                                                                                       np.float32(math.sqrt(2.0)))),
                    (x,), x.dtype, x.device)


def _normalize(x: Tensor, p: builtins.float = 2.0, dim: builtins.int = 1, eps: builtins.float = 1e-12) -> Tensor:
    if p != 2.0:
        raise NotImplementedError("fake torch: normalize with p != 2")

    def fn(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a, np.float32)
        return a / np.maximum(np.sqrt((a * a).sum(dim, keepdims=True)), np.float32(eps))

    return _compute("normalize", fn, (x,), x.dtype, x.device)


nn = types.ModuleType("torch.nn")
functional = types.ModuleType("torch.nn.functional")
functional.linear = _linear  # type: ignore[attr-defined]
functional.embedding = _embedding  # type: ignore[attr-defined]
functional.layer_norm = _layer_norm  # type: ignore[attr-defined]
functional.scaled_dot_product_attention = _sdpa  # type: ignore[attr-defined]
functional.gelu = _gelu  # type: ignore[attr-defined]
functional.normalize = _normalize  # type: ignore[attr-defined]
nn.functional = functional  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- torch.cuda
class OutOfMemoryError(RuntimeError):
    pass


class Event:
    def __init__(self, enable_timing: builtins.bool = False, blocking: builtins.bool = False) -> None:
        self._stream: _Stream | None = None
        self._seq = 0

    def record(self, stream: _Stream | None = None) -> None:
        self._stream = stream or _current_stream()
        self._seq = self._stream._seq

    def synchronize(self) -> None:
        _no_sync_in_capture("Event.synchronize")
        if self._stream is not None:
            self._stream._flush(self._seq)

    def query(self) -> builtins.bool:
        return self._stream is None or all(s > self._seq for s, _ in self._stream._pending)


class CUDAGraph:
    def __init__(self) -> None:
        self._tape: list[tuple[Any, Any, tuple[Any, ...]]] = []
        self._captured = False
        self._reset = False

    def replay(self) -> None:
        if not self._captured or self._reset:
            raise RuntimeError("CUDAGraph.replay: the graph was never captured, or was reset")
        cap = _fake.capture
        if cap is not None and cap.thread != threading.get_ident() and cap.mode == "global":
            _fake.violations.append("a replay on another thread during a capture")
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (a replay from another "
                               "thread while a CUDA graph is being captured)")
        _current_stream()._flush()
        _fake.counts["replays"] += 1
        for out, fn, inputs in self._tape:
            if out is None:
                fn()  # an in-place op (a device copy_)
                continue
            arrays = [x._a if isinstance(x, Tensor) else x for x in inputs]
            np.copyto(out._a, fn(*arrays), casting="unsafe")

    def reset(self) -> None:
        self._reset = True
        self._tape = []
        _fake.counts["graph_resets"] += 1

    def pool(self) -> Any:
        return id(self)


class _GraphContext:
    def __init__(self, graph: CUDAGraph, pool: Any = None, stream: _Stream | None = None,
                 capture_error_mode: str = "global") -> None:
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise RuntimeError(f"unknown capture_error_mode {capture_error_mode!r}")
        self.graph, self.mode = graph, capture_error_mode
        self.stream = stream
        self.thread = threading.get_ident()
        self.made: list[Tensor] = []
        self._prev: Any = None

    def __enter__(self) -> None:
        with _fake.lock:
            if _fake.capture is not None:
                _fake.violations.append("two captures at once")
                raise RuntimeError("Only one CUDA graph capture may be underway at a time in a process")
            stream = self.stream or _Stream()  # torch.cuda.graph's own side stream
            if stream.default:
                raise RuntimeError("CUDA graphs must be captured on a non-default stream")
            self.stream = stream
            stream._flush()
            self._prev = getattr(_fake.local, "stream", None)
            _fake.local.stream = stream
            _fake.capture = self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        with _fake.lock:
            _fake.capture = None
            _fake.local.stream = self._prev
        if exc_type is not None:
            return
        self.graph._captured = True
        _fake.counts["captures"] += 1
        # What a capture made holds nothing yet (no kernel ran): garbage until the first replay.
        for t in self.made:
            if t._a.base is None and t.dtype.is_floating_point:
                t._a.fill(np.nan)


def _is_available() -> builtins.bool:
    if _fake.warning:
        warnings.warn(_fake.warning, UserWarning, stacklevel=2)
    return _fake.cuda_available


def _device_count() -> builtins.int:
    return 1 if _fake.cuda_available else 0


def _check_index(d: Any) -> builtins.int:
    index = _as_device(d).index if d is not None else 0
    if not _fake.cuda_available or not 0 <= (index or 0) < _device_count():
        raise RuntimeError("CUDA error: invalid device ordinal")
    return index or 0


def _get_device_name(d: Any = None) -> str:
    _check_index(d)
    return _fake.device_name


def _get_device_capability(d: Any = None) -> tuple[builtins.int, builtins.int]:
    _check_index(d)
    return _fake.capability  # type: ignore[return-value]


@contextlib.contextmanager
def _stream_ctx(stream: _Stream | None) -> Any:
    if stream is None:
        yield
        return
    prev = getattr(_fake.local, "stream", None)
    _fake.local.stream = stream
    try:
        yield
    finally:
        _fake.local.stream = prev


@contextlib.contextmanager
def _device_ctx(d: Any) -> Any:
    _check_index(d)
    yield


def _current_stream_api(device: Any = None) -> _Stream:
    if device is not None:
        _check_index(device)
    return _current_stream()


def _synchronize(device: Any = None) -> None:
    _no_sync_in_capture("torch.cuda.synchronize")
    for stream in list(_DEFAULT_STREAMS.values()) + list(_ALL_STREAMS):
        stream._flush()


_ALL_STREAMS: list[_Stream] = []


def _new_stream(device: Any = None, priority: builtins.int = 0) -> _Stream:
    stream = _Stream(device)
    _ALL_STREAMS.append(stream)
    return stream


def _empty_cache() -> None:
    _fake.counts["empty_cache"] += 1


cuda = types.ModuleType("torch.cuda")
cuda.is_available = _is_available  # type: ignore[attr-defined]
cuda.device_count = _device_count  # type: ignore[attr-defined]
cuda.get_device_name = _get_device_name  # type: ignore[attr-defined]
cuda.get_device_capability = _get_device_capability  # type: ignore[attr-defined]
cuda.Stream = _new_stream  # type: ignore[attr-defined]
cuda.Event = Event  # type: ignore[attr-defined]
cuda.CUDAGraph = CUDAGraph  # type: ignore[attr-defined]
cuda.graph = _GraphContext  # type: ignore[attr-defined]
cuda.stream = _stream_ctx  # type: ignore[attr-defined]
cuda.device = _device_ctx  # type: ignore[attr-defined]
cuda.current_stream = _current_stream_api  # type: ignore[attr-defined]
cuda.synchronize = _synchronize  # type: ignore[attr-defined]
cuda.empty_cache = _empty_cache  # type: ignore[attr-defined]
cuda.OutOfMemoryError = OutOfMemoryError  # type: ignore[attr-defined]

version = types.ModuleType("torch.version")
version.cuda = _fake.cuda_version  # type: ignore[attr-defined]
version.__version__ = __version__  # type: ignore[attr-defined]

# torch's names that would shadow builtins inside this module: bound last.
globals()["bool"] = _bool
globals()["float"] = float32
globals()["half"] = float16
globals()["long"] = int64
globals()["int"] = int32

SUBMODULES = {"torch.cuda": cuda, "torch.nn": nn, "torch.nn.functional": functional, "torch.version": version}
sys.modules.update(SUBMODULES)
