"""PyTorch on CUDA: the model's BERT forward, one CUDA graph per bucket shape, one context per bucket.

For GPU hosts without TensorRT (PyTorch images are the common GPU base). The forward is the one
this backend computes exactly (worker/backends/torch_plan.py: BERT encoders, mean or CLS pooling,
an optional Normalize; anything else is refused at start, naming the backends that run it), from
the weights the ONNX exporter reads (model.safetensors via ModelInfo). The encoder runs in the
chosen dtype (fp16, bf16 or fp32: worker/backend_choice/torch_choice.py gates it against fp32
ONNX Runtime); the pooling and the normalisation always run in fp32.

Layout, as TensorRT's: `max_contexts = len(profile.buckets)`, context i serves bucket i only
(worker/batching/bucket_queues.py plan_layout: one lane, one dispatcher thread per bucket). Per
bucket, *slots* built at start, one per batch tier (torch_plan.batch_tiers: the bucket's max batch
and each half of it down to 64, so that a partial batch the deadline flushed replays a graph at
most twice its size, not the max batch's):
- static device inputs [tier, L_i] (int64 ids and mask) and, with graphs, one CUDA graph of the
  forward at that shape and its static [tier, dim] fp32 output;
- its own CUDA stream, pinned host buffers for the inputs and the output (allocated once: a
  per-call pin_memory() is the slow pattern), and an event for the device->host copy.
Per batch: stage into the pinned buffers (padded to the bucket's shape, rows past the batch given
one visible token), host->device copies, `graph.replay()`, a non-blocking device->host copy of the
batch's rows, `event.record()`, `event.synchronize()` (which releases the GIL, so the other
buckets' dispatchers run meanwhile), a numpy copy of the rows. The event is where the overlap
pays: the copies and the replay are queued on the bucket's stream without a host sync between
them, and the buckets' streams run side by side on the card.

Threads. The constructor runs on the starting thread and captures every graph there, before any
context exists: while a capture is underway no other CUDA work may run in the process, on any
thread ("global" capture mode, PyTorch's default, which reports a violation instead of hiding it).
Warm-up runs on the slot's side stream first (lazy initialisation stays out of the graph). Each
graph has its own memory pool: graphs of different buckets replay concurrently, so they must not
share one. `create_context(i)` may be called from any thread; the context belongs to the thread
that runs it (the Bucketer's dispatcher, or the starting thread for the parity gate), and a slot
is lent to one context at a time. `close()` of the backend needs every context closed.

eager (graphs=False): the same slots without graphs; each batch runs the forward at its own
[batch, length] (benchmarks/gpu/torch_graphs.py compares the two). Not a setting: graphs always
run in the worker.

torch is imported only inside `cuda_device()` and `TorchCudaBackend.__init__`: the CPU install
never imports it (tests/unit/repo/test_no_gpu_imports.py). The forward uses only calls the numpy fake of
tests/fakes/gpu_modules/torch models, so the whole backend runs in CI on CPU.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from worker.backends.torch_plan import (
    EncoderWeights,
    GraphShape,
    TorchDtype,
    bucket_graphs,
    check_fits,
    check_model,
    graph_shapes,
    read_weights,
    stage_rows,
    tier_for,
    trim_padding,
)
from worker.core.errors import BackendError, extra_missing
from worker.core.model import ModelInfo
from worker.core.profiles import Profile

log = structlog.get_logger(__name__)

# Eager runs before each capture: PyTorch's recipe says "a few"; cuBLAS handles, attention kernel
# choices and the allocator's blocks are made then, not inside the graph.
WARMUP_RUNS = 3
# Floors of sentence-transformers' mean pooling (the clamp of the token count) and of
# torch.nn.functional.normalize, as the exporter's graph has them.
COUNT_MIN = 1e-9
NORM_EPS = 1e-12


class TorchUnavailableError(BackendError):
    """torch cannot be imported, or it finds no usable CUDA device; the message says which."""


@dataclass(frozen=True)
class CudaDevice:
    index: int
    name: str
    capability: tuple[int, int]
    torch_version: str
    cuda_version: str

    def describe(self) -> str:
        return f"{self.name} (sm {self.capability[0]}.{self.capability[1]})"


def cuda_device(device: int = 0) -> CudaDevice:
    """The CUDA device torch runs on, or one TorchUnavailableError line saying why there is none.

    Imports torch: call it only where a GPU is visible (worker/backend_choice/select.py checks
    /dev/nvidia* and find_spec first). torch.cuda.is_available() never raises; what it warns
    (a driver too old, "Error 803") is the reason, kept to its first line.
    """
    try:
        import torch
    except ImportError as exc:
        raise TorchUnavailableError(extra_missing("torch", "backend 'torch'", f"torch ({exc})")) from None
    except OSError as exc:  # a torch whose CUDA libraries cannot be loaded
        raise TorchUnavailableError(f"backend 'torch': torch cannot be loaded ({exc})") from None
    version = str(torch.__version__)
    cuda = getattr(torch.version, "cuda", None)
    if not cuda:
        raise TorchUnavailableError(f"backend 'torch': torch {version} is a CPU-only build (torch.version.cuda is "
                                    "None); install a CUDA build of PyTorch, or use --backend onnxruntime")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = bool(torch.cuda.is_available())
        count = int(torch.cuda.device_count()) if available else 0
    if not available or count == 0:
        said = "; ".join(str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip())
        raise TorchUnavailableError(f"backend 'torch': torch {version} (CUDA {cuda}) finds no usable CUDA device"
                                    f"{': ' + said if said else ' (no driver, or no GPU visible to it)'}; "
                                    "use --backend onnxruntime on CPU")
    if not 0 <= device < count:
        raise TorchUnavailableError(f"backend 'torch': CUDA device {device} requested, torch sees {count}")
    major, minor = torch.cuda.get_device_capability(device)
    return CudaDevice(device, str(torch.cuda.get_device_name(device)), (int(major), int(minor)), version, str(cuda))


@dataclass
class _Slot:
    """One bucket's static buffers, stream, event and (with graphs) CUDA graph; lent to one context at a time."""

    shape: GraphShape
    stream: Any
    done: Any
    ids: Any  # device [B, L] int64
    mask: Any
    host_ids: Any  # pinned [B, L] int64 (and its numpy view below)
    host_mask: Any
    host_out: Any  # pinned [B, dim] float32
    host_ids_np: np.ndarray
    host_mask_np: np.ndarray
    host_out_np: np.ndarray
    graph: Any = None
    out: Any = None  # the graph's static output


class TorchContext:
    """Bucket `index`'s context: runs its batches on the bucket's slot. Owned by one thread."""

    def __init__(self, backend: TorchCudaBackend, index: int) -> None:
        self._backend = backend
        self.index = index
        self._tiers = backend._slots[index]
        self._shapes = [slot.shape for slot in self._tiers]
        self._closed = False

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        if self._closed:
            raise BackendError(f"torch context {self.index} is closed")
        if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
            raise BackendError(f"torch: input_ids {input_ids.shape} and attention_mask {attention_mask.shape} "
                               "must be the same [batch, length] shape")
        slot = self._tiers[tier_for(self._shapes, input_ids.shape[0])]
        input_ids, attention_mask = trim_padding(slot.shape, input_ids, attention_mask)
        check_fits(slot.shape, *input_ids.shape)
        b = self._backend
        try:
            return b._run_graph(slot, input_ids, attention_mask) if b.graphs else \
                b._run_eager(slot, input_ids, attention_mask)
        except BackendError:
            raise
        except RuntimeError as exc:  # a CUDA error (out of memory, a launch failure) is the backend's
            raise BackendError(f"torch: bucket {self.index} batch {tuple(input_ids.shape)} failed: {exc}") from exc

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._backend._release(self.index)


class TorchCudaBackend:
    """The Backend protocol on PyTorch + CUDA; see the module docstring for the layout and the threads."""

    name = "torch"
    requires_serial_dispatch = False  # every context has its own graph, pool, stream and buffers

    def __init__(self, model: ModelInfo, profile: Profile, *, precision: TorchDtype = "fp16", graphs: bool = True,
                 device: int = 0, weights: EncoderWeights | None = None) -> None:
        check_model(model)  # before any GPU work: a family it cannot run is one line
        self.device = cuda_device(device)
        import torch
        import torch.nn.functional as F

        self._torch, self._F = torch, F
        self.model, self.profile, self.precision, self.graphs = model, profile, precision, graphs
        self.max_contexts: int | None = len(profile.buckets)
        self.dim = model.dim
        self.shapes = graph_shapes(profile, model.max_seq_length)
        self._dev = torch.device("cuda", device)
        self._dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision]
        self._mode = model.pipeline.pooling.modes[0]
        self._normalize = model.normalized
        self._lock = threading.Lock()  # slot claims: contexts are created from several threads
        self._slots: list[list[_Slot]] = []  # per bucket, its tiers ascending (eager: the max one)
        self._claimed: list[bool] = []
        self.device_name = self.device.describe()
        self.providers = [f"torch {self.device.torch_version} (CUDA {self.device.cuda_version})", self.device_name,
                          precision, "CUDA graph per bucket" if graphs else "eager"]
        try:
            with torch.inference_mode(), torch.cuda.device(self._dev):
                self._w = self._to_device(weights if weights is not None else read_weights(model))
                for shape in self.shapes:
                    tiers = bucket_graphs(shape) if graphs else [shape]
                    self._slots.append([self._make_slot(tier) for tier in tiers])
                    self._claimed.append(False)
                if graphs:
                    # All captures on this thread, before any context (and so any replay) exists.
                    for slot in (slot for tiers in self._slots for slot in tiers):
                        self._capture(slot)
                torch.cuda.synchronize(self._dev)
        except BackendError:
            self._free()
            raise
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one; a capture that failed is another
            self._free()
            raise BackendError(f"torch: cannot set up {model.name} in {precision} on {self.device_name} for "
                               f"profile {profile.name!r}: {str(exc).strip().splitlines()[0]}") from exc
        log.info("torch backend ready", device=self.device_name, precision=precision, graphs=graphs,
                 shapes=[f"{s.batch}x{s.length}" for s in self.shapes],
                 graphs_per_bucket=[len(tiers) for tiers in self._slots])

    # ------------------------------------------------------------------ setup
    def _to_device(self, w: EncoderWeights) -> dict[str, Any]:
        torch, dev, dt = self._torch, self._dev, self._dtype

        def t(a: np.ndarray) -> Any:
            return torch.from_numpy(a).to(device=dev, dtype=dt)

        return {"word": t(w.word), "position": t(w.position), "type0": t(w.token_type0),
                "emb_ln": (t(w.emb_ln_w), t(w.emb_ln_b)),
                "layers": [{k: t(getattr(lw, k)) for k in lw.__dataclass_fields__} for lw in w.layers]}

    def _make_slot(self, shape: GraphShape) -> _Slot:
        torch, dev = self._torch, self._dev
        size = (shape.batch, shape.length)
        host_ids = torch.empty(size, dtype=torch.int64, pin_memory=True)
        host_mask = torch.empty(size, dtype=torch.int64, pin_memory=True)
        host_out = torch.empty((shape.batch, self.dim), dtype=torch.float32, pin_memory=True)
        ids_np, mask_np = host_ids.numpy(), host_mask.numpy()
        # A placeholder batch for the warm-up and the capture: no rows, every row one visible token.
        stage_rows(ids_np, mask_np, np.zeros((0, 1), np.int64), np.zeros((0, 1), np.int64))
        ids = torch.empty(size, dtype=torch.int64, device=dev)
        mask = torch.empty(size, dtype=torch.int64, device=dev)
        ids.copy_(host_ids)
        mask.copy_(host_mask)
        return _Slot(shape, torch.cuda.Stream(device=dev), torch.cuda.Event(), ids, mask, host_ids, host_mask,
                     host_out, ids_np, mask_np, host_out.numpy())

    def _capture(self, slot: _Slot) -> None:
        torch = self._torch
        main = torch.cuda.current_stream(self._dev)
        slot.stream.wait_stream(main)
        with torch.cuda.stream(slot.stream):
            for _ in range(WARMUP_RUNS):
                self._forward(slot.ids, slot.mask)
        main.wait_stream(slot.stream)
        graph = torch.cuda.CUDAGraph()
        # No pool argument: a private pool per graph, since the buckets' graphs replay concurrently.
        with torch.cuda.graph(graph, stream=slot.stream):
            slot.out = self._forward(slot.ids, slot.mask)
        slot.graph = graph

    # ------------------------------------------------------------------ the forward
    def _forward(self, ids: Any, mask: Any) -> Any:
        """[B, L] int64 ids and mask -> [B, dim] float32: BERT, then the pooling and Normalize in fp32."""
        F, w, info = self._F, self._w, self.model
        b, length = ids.shape
        h, heads = info.hidden_size, info.num_heads
        hd, eps = h // heads, info.layer_norm_eps
        x = F.embedding(ids, w["word"]) + w["position"][:length] + w["type0"]
        x = F.layer_norm(x, (h,), *w["emb_ln"], eps)
        keep = mask.bool().view(b, 1, 1, length)  # attend where the mask is 1 (as the exporter's -10000 bias)
        for lw in w["layers"]:
            q, k, v = F.linear(x, lw["qkv_w"], lw["qkv_b"]).view(b, length, 3, heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, length, h)
            x = F.layer_norm(x + F.linear(a, lw["out_w"], lw["out_b"]), (h,), lw["ln1_w"], lw["ln1_b"], eps)
            inner = F.gelu(F.linear(x, lw["ffn_in_w"], lw["ffn_in_b"]))
            x = F.layer_norm(x + F.linear(inner, lw["ffn_out_w"], lw["ffn_out_b"]), (h,), lw["ln2_w"], lw["ln2_b"], eps)
        # fp32 from here: in half precision the count floor 1e-9 and the norm floor 1e-12 are 0.
        x = x.float()
        if self._mode == "cls":
            pooled = x[:, 0]
        else:
            m = mask.unsqueeze(-1).float()
            pooled = (x * m).sum(1) / m.sum(1).clamp(min=COUNT_MIN)
        return F.normalize(pooled, p=2.0, dim=1, eps=NORM_EPS) if self._normalize else pooled

    # ------------------------------------------------------------------ per batch
    def _run_graph(self, slot: _Slot, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        torch = self._torch
        # The previous batch's copies finished before its event returned, so the pinned buffers are free.
        batch = stage_rows(slot.host_ids_np, slot.host_mask_np, input_ids, attention_mask)
        # inference_mode: the static buffers were made under it, and PyTorch refuses in-place
        # updates of such tensors outside it.
        with torch.inference_mode(), torch.cuda.device(self._dev), torch.cuda.stream(slot.stream):
            slot.ids.copy_(slot.host_ids, non_blocking=True)
            slot.mask.copy_(slot.host_mask, non_blocking=True)
            slot.graph.replay()
            slot.host_out[:batch].copy_(slot.out[:batch], non_blocking=True)
            slot.done.record(slot.stream)
        slot.done.synchronize()
        # A copy: the pinned buffer is overwritten by the next batch.
        return np.array(slot.host_out_np[:batch], dtype=np.float32, copy=True)

    def _run_eager(self, slot: _Slot, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        torch = self._torch
        batch, length = input_ids.shape
        # The batch's own shape: its rows in the first batch x length elements of the pinned buffers.
        n = batch * length
        with torch.inference_mode(), torch.cuda.device(self._dev), torch.cuda.stream(slot.stream):
            flat_ids, flat_mask = slot.host_ids.view(-1)[:n], slot.host_mask.view(-1)[:n]
            flat_ids.numpy().reshape(batch, length)[:] = input_ids
            flat_mask.numpy().reshape(batch, length)[:] = attention_mask
            ids = flat_ids.view(batch, length).to(self._dev, non_blocking=True)
            mask = flat_mask.view(batch, length).to(self._dev, non_blocking=True)
            slot.host_out[:batch].copy_(self._forward(ids, mask), non_blocking=True)
            slot.done.record(slot.stream)
        slot.done.synchronize()
        return np.array(slot.host_out_np[:batch], dtype=np.float32, copy=True)

    # ------------------------------------------------------------------ contexts
    def create_context(self, index: int) -> TorchContext:
        """Context for bucket `index`: its slot, lent until the context closes."""
        if not 0 <= index < len(self.shapes):
            raise BackendError(f"context {index} requested, but profile {self.profile.name!r} has "
                               f"{len(self.shapes)} buckets (contexts 0..{len(self.shapes) - 1})")
        with self._lock:
            if not self._slots:
                raise BackendError("the torch backend is closed")
            if self._claimed[index]:
                raise BackendError(f"torch context {index} is already open: bucket {index}'s graphs, streams and "
                                   "buffers are run by one dispatcher")
            self._claimed[index] = True
        return TorchContext(self, index)

    def _release(self, index: int) -> None:
        with self._lock:
            if self._slots:
                self._claimed[index] = False

    def close(self) -> None:
        """Frees the graphs, buffers and weights; every context must be closed first."""
        with self._lock:
            if not self._slots:
                return
            open_ = [i for i, claimed in enumerate(self._claimed) if claimed]
            if open_:
                raise BackendError(f"torch context(s) {open_} still open; close them before the backend")
        self._free()

    def _free(self) -> None:
        torch = self._torch if hasattr(self, "_torch") else None
        for tiers in getattr(self, "_slots", []):
            for slot in tiers:
                if slot.graph is not None:
                    slot.graph.reset()
        self._slots = []
        self._claimed = []
        self._w = {}
        if torch is not None:
            torch.cuda.synchronize(self._dev)
            torch.cuda.empty_cache()
