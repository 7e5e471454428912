"""TensorRT backend: one multi-profile plan, one execution context per bucket on its own CUDA stream.

Layout (engines/build_engine.py builds the plan): optimisation profile i is bucket i of the
profile, with a fixed sequence length L_i (its bound) and batch 1..max_batch_i. Context i:
- one `IExecutionContext`, `set_optimization_profile_async(i, stream)` once at creation;
- its own pycuda `Stream`;
- pinned host buffers (`pagelocked_empty`) and device buffers for [max_batch_i, L_i] inputs
  and the [max_batch_i, dim] output, with their tensor addresses set once;
- per batch: copy into the pinned buffers (padding to L_i), `set_input_shape` (only when the
  batch size changed), async host->device copies, `execute_async_v3`, async device->host copy,
  `stream.synchronize()`, and a numpy copy of the output.

Padding: the bucketer should pad a batch to its bucket bound (the `gpu` profile's pad_to). A
batch that is shorter (L < L_i, e.g. with `pad_to = longest`) is padded up to L_i here with
id 0 and mask 0: profile i only admits sequence length L_i, and masked positions change
neither the attention of real tokens nor the masked mean pooling. L > L_i or more than
max_batch_i rows is an error (BackendError): the batch belongs to another bucket.

Threads and the CUDA context. TensorRT uses the CUDA runtime, which works in the device's
*primary* context; pycuda uses the driver API, where a context is current per thread. The
backend therefore uses the primary context, retained once per process and never detached
(engines/cuda_context.py), so that pycuda and TensorRT share it, and:
- the backend's constructor and close() push/pop it around their own work;
- `create_context(i)` must be called *from the dispatcher thread that will run context i*: it
  pushes the primary context on that thread (once per thread, reference-counted) and keeps it
  current; `TensorRTContext.close()` must be called from the same thread and pops it when that
  thread's last context closes. `run()` from another thread raises BackendError.
- close every context before `TensorRTBackend.close()`.

share_device_memory=True: contexts are created with user-managed device memory
(ExecutionContextAllocationStrategy.USER_MANAGED) and all point at one block sized for the
largest profile. Two contexts running at once would overwrite each other's activations, so
this is only valid when no two contexts ever run concurrently: `requires_serial_dispatch` is
then True and the bucketer must run every context from ONE dispatcher thread. Without it, each
context is created with ON_PROFILE_CHANGE and so holds activation memory for its own profile
only (instead of STATIC's maximum over all profiles per context).

The pure logic (buffer sizing, bucket -> profile mapping, shape checks, staging into host
buffers) is worker/backends/tensorrt_plan.py, unit-tested without a GPU. tensorrt and pycuda
are imported only inside `TensorRTBackend.__init__`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from worker.backends.tensorrt_plan import (
    INPUT_NAMES,
    PAD_ID,
    buffer_plan,
    check_engine_profiles,
    numpy_dtype,
    profile_index_for_bucket,
    shared_memory_size,
    stage_batch,
)
from worker.core.errors import BackendError
from worker.core.profiles import Profile


# ---------------------------------------------------------------------------- the backend
class _ThreadCudaContext:
    """Keeps the shared CUDA context pushed on each thread that holds a TensorRT context."""

    def __init__(self, cuda_ctx: Any, cuda: Any) -> None:
        self._ctx = cuda_ctx
        self._cuda = cuda
        self._local = threading.local()

    def enter(self) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._ctx.push()
        self._local.depth = depth + 1

    def leave(self) -> None:
        depth = getattr(self._local, "depth", 0)
        if depth <= 0:
            raise BackendError("CUDA context popped on a thread that never pushed it: a TensorRT context "
                               "must be closed on the thread that created it")
        self._local.depth = depth - 1
        if depth == 1:
            self._cuda.Context.pop()


class TensorRTContext:
    """One bucket's execution context; owned by exactly one dispatcher thread."""

    def __init__(self, backend: TensorRTBackend, index: int) -> None:
        self._backend = backend
        self.index = index
        self.plan = backend.buffer_plans[index]
        self._owner = threading.get_ident()
        self._closed = False
        self._last_batch = -1
        cuda, trt = backend._cuda, backend._trt
        backend._thread_ctx.enter()
        try:
            engine = backend._engine
            strategy = trt.ExecutionContextAllocationStrategy
            # USER_MANAGED: the shared block is set below; ON_PROFILE_CHANGE: memory for this
            # context's own profile, not STATIC's maximum over all profiles.
            kind = strategy.USER_MANAGED if backend.share_device_memory else strategy.ON_PROFILE_CHANGE
            # Dispatcher threads start together; TensorRT does not document creating contexts of
            # one engine concurrently as safe, so they take turns.
            with backend._create_lock:
                self._context = engine.create_execution_context(kind)
            if self._context is None:
                raise BackendError(f"TensorRT could not create execution context {index} (out of GPU memory?)")
            self._stream = cuda.Stream()
            if backend.share_device_memory:
                # set_device_memory(ptr, size): TensorRT 10.1 and 11 (the gpu extra's floor is 10.1;
                # the write-only `device_memory` property of 10.0 is deprecated).
                self._context.set_device_memory(int(backend._shared_memory), backend._shared_memory_size)
            try:
                # The binding raises RuntimeError where the C++ call returns false.
                ok = self._context.set_optimization_profile_async(index, self._stream.handle)
            except RuntimeError as exc:
                raise BackendError(f"TensorRT refused optimisation profile {index} for context {index}: "
                                   f"{exc}") from None
            if ok is False:
                raise BackendError(f"TensorRT refused optimisation profile {index} for context {index}")
            self._stream.synchronize()
            p = self.plan
            self._host = {n: cuda.pagelocked_empty(p.input_shape, dt) for n, dt in p.input_dtypes}
            for buf in self._host.values():
                buf.fill(PAD_ID)
            self._host_out = cuda.pagelocked_empty(p.output_shape, p.output_dtype)
            self._device = {n: cuda.mem_alloc(p.input_nbytes(n)) for n, _ in p.input_dtypes}
            self._device_out = cuda.mem_alloc(p.output_nbytes)
            for name, buf in [*self._device.items(), (p.output_name, self._device_out)]:
                # False means TensorRT has no tensor of that name (or refused the address): say
                # so here, not later as a bare execute_async_v3 failure.
                if not self._context.set_tensor_address(name, int(buf)):
                    raise BackendError(f"TensorRT context {index}: set_tensor_address({name!r}) refused; the "
                                       f"plan's I/O tensors are {[*INPUT_NAMES, p.output_name]}")
        except BaseException:
            self._release()
            raise

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        if self._closed:
            raise BackendError(f"TensorRT context {self.index} is closed")
        if threading.get_ident() != self._owner:
            raise BackendError(f"TensorRT context {self.index} run from a thread other than the one that "
                               "created it; its CUDA context is current only there")
        cuda, p = self._backend._cuda, self.plan
        batch = stage_batch(p, self._host, input_ids, attention_mask)
        if batch != self._last_batch:
            for name in INPUT_NAMES:
                if not self._context.set_input_shape(name, (batch, p.seq_len)):
                    raise BackendError(f"TensorRT rejected input shape {(batch, p.seq_len)} for {name!r} on "
                                       f"profile {self.index}")
            self._last_batch = batch
        for name in INPUT_NAMES:
            # Rows [:batch] of a C-ordered buffer are one contiguous, still page-locked block.
            cuda.memcpy_htod_async(self._device[name], self._host[name][:batch], self._stream)
        if not self._context.execute_async_v3(self._stream.handle):
            raise BackendError(f"TensorRT execute_async_v3 failed on profile {self.index} for batch "
                               f"{(batch, p.seq_len)}")
        out = self._host_out[:batch]
        cuda.memcpy_dtoh_async(out, self._device_out, self._stream)
        self._stream.synchronize()
        # A copy: the pinned buffer is overwritten by the next batch.
        return np.array(out, dtype=np.float32, copy=True)

    def _release(self) -> None:
        # While the CUDA context is still pushed on this thread: the TensorRT context first (it
        # may reference the buffers), then device and pinned memory, then the stream.
        try:
            self._context = None
            for buf in [*getattr(self, "_device", {}).values(), getattr(self, "_device_out", None)]:
                if buf is not None:
                    buf.free()
            for arr in [*(getattr(self, "_host", None) or {}).values(), getattr(self, "_host_out", None)]:
                base = getattr(arr, "base", None)
                if base is not None and hasattr(base, "free"):  # pycuda's page-locked allocation
                    base.free()
            self._device, self._device_out = {}, None
            self._host, self._host_out = {}, None  # type: ignore[assignment]
            self._stream = None
        finally:
            self._backend._thread_ctx.leave()

    def close(self) -> None:
        if self._closed:
            return
        if threading.get_ident() != self._owner:
            raise BackendError(f"TensorRT context {self.index} must be closed on the thread that created it")
        self._closed = True
        with self._backend._contexts_lock:
            self._backend._contexts.discard(self)
        try:
            self._release()
        finally:
            self._backend._unclaim()


class TensorRTBackend:
    name = "tensorrt"

    def __init__(self, engine_path: str | Path, profile: Profile, *, onnx_path: str | Path | None = None,
                 share_device_memory: bool = False, device: int = 0) -> None:
        # Imported here: the module is importable (and its pure logic testable) without the gpu extra.
        from engines.build_engine import check_plan, import_gpu_extra, profile_shapes, read_sidecar
        from engines.cuda_context import primary_context

        self.engine_path = Path(engine_path)
        self.profile = profile
        self.max_contexts: int | None = len(profile.buckets)
        self.share_device_memory = share_device_memory
        # One block of activation memory for all contexts: they must never run at once.
        self.requires_serial_dispatch: bool = share_device_memory
        profile_shapes(profile)  # alignment: a clear error instead of a plan that cannot match
        read_sidecar(self.engine_path)  # before the GPU import: a missing or broken sidecar fails fast
        self._trt, self._cuda = import_gpu_extra()
        trt, cuda = self._trt, self._cuda
        plan_bytes = self.engine_path.read_bytes()
        _, gpu_name, cc = check_plan(self.engine_path, profile, cuda=cuda, tensorrt_version=str(trt.__version__),
                                     onnx_path=onnx_path, device=device, plan_bytes=plan_bytes)

        # Retained once per process, never detached (engines/cuda_context.py says why).
        self._cuda_ctx = primary_context(cuda, device)
        self._thread_ctx = _ThreadCudaContext(self._cuda_ctx, cuda)
        self._contexts: set[TensorRTContext] = set()
        self._contexts_lock = threading.Lock()  # dispatcher threads create/close concurrently
        self._create_lock = threading.Lock()  # one create_execution_context at a time
        # share_device_memory: the one thread allowed to hold contexts, claimed at the first
        # create_context and freed when its last context closes; _claims counts contexts open or
        # being created (both under _contexts_lock).
        self._serial_owner: int | None = None
        self._claims = 0
        self._shared_memory: Any = None
        self._shared_memory_size = 0
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._thread_ctx.enter()
        try:
            self._runtime = trt.Runtime(self._logger)
            self._engine = self._runtime.deserialize_cuda_engine(plan_bytes)
            if self._engine is None:
                raise BackendError(f"TensorRT could not deserialise {self.engine_path} (its log above says why)")
            engine = self._engine
            io = {engine.get_tensor_name(i): engine.get_tensor_mode(engine.get_tensor_name(i))
                  for i in range(engine.num_io_tensors)}
            inputs = {n: numpy_dtype(engine.get_tensor_dtype(n)) for n, m in io.items() if m == trt.TensorIOMode.INPUT}
            outputs = [n for n, m in io.items() if m == trt.TensorIOMode.OUTPUT]
            if sorted(inputs) != sorted(INPUT_NAMES) or len(outputs) != 1:
                raise BackendError(f"plan {self.engine_path} has inputs {sorted(inputs)} and outputs {outputs}; "
                                   f"expected inputs {list(INPUT_NAMES)} and one embedding output")
            out_shape = tuple(engine.get_tensor_shape(outputs[0]))
            if len(out_shape) != 2 or out_shape[-1] < 1:
                raise BackendError(f"plan output {outputs[0]!r} has shape {out_shape}; expected [batch, dim]")
            self.dim = int(out_shape[-1])
            n_profiles = engine.num_optimization_profiles
            check_engine_profiles(profile, [
                {n: engine.get_tensor_profile_shape(n, i) for n in INPUT_NAMES} for i in range(n_profiles)])
            out_dtype = numpy_dtype(engine.get_tensor_dtype(outputs[0]))
            self.buffer_plans = [buffer_plan(profile, i, input_dtypes=inputs, output_name=outputs[0],
                                             output_dtype=out_dtype, dim=self.dim) for i in range(n_profiles)]
            if share_device_memory:
                # The _v2 sizes (int64) exist from 10.1; 11 removed `device_memory_size` and the v1 per-profile call.
                sizes = [engine.get_device_memory_size_for_profile_v2(i) for i in range(n_profiles)]
                self._shared_memory_size = shared_memory_size(sizes)
                self._shared_memory = cuda.mem_alloc(max(1, self._shared_memory_size))
        except BaseException:
            self._engine = None
            self._runtime = None
            self._thread_ctx.leave()
            raise
        self._thread_ctx.leave()
        self.gpu_name, self.compute_capability = gpu_name, cc
        self.device_name = f"{gpu_name} (sm {cc})"  # kwe_backend_info's device label

    def create_context(self, index: int) -> TensorRTContext:
        """Context for bucket `index` (= optimisation profile `index`). Call it on the thread that runs it."""
        profile_index_for_bucket(self.profile, index)
        if self._engine is None:
            raise BackendError("the TensorRT backend is closed")
        me = threading.get_ident()
        with self._contexts_lock:
            if self.share_device_memory:
                # One activation block for all contexts: a second thread would run concurrently
                # and overwrite another context's activations, so refuse it loudly. The thread is
                # claimed here, before the (slow) creation, so that two threads starting together
                # cannot both find no owner.
                if self._serial_owner not in (None, me):
                    raise BackendError(
                        "share_device_memory: every TensorRT context must be created and run on ONE "
                        "dispatcher thread (requires_serial_dispatch); context "
                        f"{index} was requested from a second thread")
                self._serial_owner = me
            self._claims += 1
        try:
            ctx = TensorRTContext(self, index)
        except BaseException:
            self._unclaim()
            raise
        with self._contexts_lock:
            self._contexts.add(ctx)
        return ctx

    def _unclaim(self) -> None:
        """A context closed (or failed to open): the last one frees the serial owner's claim."""
        with self._contexts_lock:
            self._claims -= 1
            if self._claims == 0:
                self._serial_owner = None

    def close(self) -> None:
        """Frees the engine and the shared block; contexts must have been closed on their own threads."""
        if self._engine is None:
            return
        if self._contexts:
            raise BackendError(f"{len(self._contexts)} TensorRT context(s) still open; close each on its "
                               "dispatcher thread before closing the backend")
        self._thread_ctx.enter()
        try:
            if self._shared_memory is not None:
                self._shared_memory.free()
                self._shared_memory = None
            self._engine = None
            self._runtime = None
        finally:
            self._thread_ctx.leave()
