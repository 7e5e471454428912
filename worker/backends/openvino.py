"""OpenVINO backend (CPU): the exported ONNX graph compiled for each context, one infer request each.

Thread ownership: each context owns its compiled model and its `InferRequest`, and a context is
owned by one dispatcher thread (worker/backends/base.py), so no request is ever run from two
threads at once. The one compiled at load (which tells the embedding size) is handed to the
first context; a lock guards that hand-over, as contexts may be created on their own threads.

Why these settings:
- Threads and streams are set explicitly: NUM_STREAMS = 1 and INFERENCE_NUM_THREADS = the
  threads per context, CPU pinning off. Left to itself OpenVINO sizes its own pools to the
  machine and pins them, which fights the dispatchers and the worker's other threads for the
  same cores. One compiled model (one stream) per context, measured against one compiled model
  with a stream per context, 2 contexts x 1 thread calling at once: 1054 / 874 vs 807 / 703
  calls/s at 1 x 8 (two rounds), 46.8 / 45.9 vs 46.0 / 45.5 at 64 x 8; one stream shared by two
  requests runs them one at a time (491 and 24.4 calls/s). The second compile loads the cached blob.
- precision "bf16" sets INFERENCE_PRECISION_HINT=bf16: matrix products on the CPU's bf16 units
  (AMX or AVX-512 BF16); "f32" keeps fp32 arithmetic. Whether bf16 is good enough is decided by
  the parity gate (worker/backend_choice/auto.py), never assumed.
- Shapes stay dynamic: the worker's exact-length buckets give many (rows, length) shapes, and
  a static compile costs 0.15-0.3 s per shape for at most 0.3 ms per call on the smallest ones
  (1 x 8: 1.23 vs 1.55 ms; 64 x 8: no difference), so per-shape reshapes never pay back.
- CACHE_DIR under the project's cache root (beside the ONNX exports): a restart loads the
  compiled blob instead of compiling again.

Imported lazily (worker/backend_choice/select.py): the `openvino` extra is optional.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from worker.backends.base import OvPrecision, check_batch
from worker.core.disk_cache import cache_dir
from worker.core.errors import BackendError, extra_missing

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
OUTPUT = "sentence_embedding"
# The CPU plugin keeps the kernels it built for each input shape it has seen, 5,000 shapes by
# default, and a worker under load meets a new (batch, length) pair with nearly every batch:
# 1,200 calls of random shapes up to 32 x 32 grew RSS by 482 MiB, still rising, with the default,
# and settled at +113 MiB (reached by the 600th call) with 128; tests/unit/worker/test_embedder_parity.py walks it.
# 128 keeps a trickle's common shapes as fast as the default (60 shapes, paired: 0.99x the time;
# 32: 1.07x; no cache: 1.57x).
RUNTIME_CACHE_SHAPES = 128


def import_openvino() -> Any:
    """The openvino module, or one BackendError that leads with the install line."""
    try:
        import openvino
    except ImportError as exc:
        raise BackendError(extra_missing("openvino", "backend 'openvino'", exc.name or str(exc))) from None
    return openvino


def default_cache_dir() -> Path:
    return cache_dir("openvino")


def version() -> str:
    """The installed OpenVINO version, or "-" where the extra is missing (cache keys use it)."""
    try:
        import openvino
    except ImportError:
        return "-"
    return str(openvino.get_version())


@dataclass
class OpenVinoContext:
    backend: OpenVinoBackend
    index: int
    request: Any  # openvino.InferRequest, owned by this context's dispatcher thread
    closed: bool = False

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        if self.closed:
            raise BackendError(f"openvino context {self.index}: run() after close()")
        check_batch("openvino", input_ids, attention_mask)
        if input_ids.shape[0] == 0:
            return np.zeros((0, self.backend.dim), dtype=np.float32)
        feed = {INPUT_IDS: np.ascontiguousarray(input_ids, dtype=np.int64),
                ATTENTION_MASK: np.ascontiguousarray(attention_mask, dtype=np.int64)}
        try:
            result = self.request.infer(feed)
        except Exception as exc:  # OpenVINO raises RuntimeError with the plugin's message
            raise BackendError(f"openvino: {self.backend.path}: run failed on a batch of shape "
                               f"{tuple(input_ids.shape)}: {exc}") from None
        # The request's output tensor is reused by its next call: copy it out.
        return np.array(result[self.backend.output], dtype=np.float32, copy=True)

    def close(self) -> None:
        self.closed = True
        self.request = None


class OpenVinoBackend:
    name = "openvino"
    max_contexts: int | None = None
    requires_serial_dispatch: bool = False

    def __init__(self, onnx_path: str | Path, *, precision: OvPrecision = "bf16", threads: int = 1,
                 cache_dir: str | Path | None = None, runtime_cache_shapes: int = RUNTIME_CACHE_SHAPES) -> None:
        ov = import_openvino()
        self.path = Path(onnx_path).expanduser()
        if not self.path.is_file():
            raise BackendError(f"openvino: model file {self.path} not found "
                               "(run `keyword-embedder export-onnx`, or let Embedder export it)")
        if precision not in ("bf16", "f32"):
            raise BackendError(f"openvino: precision must be 'bf16' or 'f32', got {precision!r}")
        if threads < 1:
            raise BackendError(f"openvino: threads must be >= 1, got {threads}")
        self.precision: OvPrecision = precision
        self.threads = threads
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        config = {"INFERENCE_PRECISION_HINT": precision, "NUM_STREAMS": "1",
                  "INFERENCE_NUM_THREADS": str(threads), "ENABLE_CPU_PINNING": "NO",
                  "CPU_RUNTIME_CACHE_CAPACITY": str(runtime_cache_shapes), "CACHE_DIR": str(self.cache_dir)}
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            del config["CACHE_DIR"]  # a read-only cache costs a compile per start, not the start
        try:
            # From the file path, not a read model: with CACHE_DIR a warm start loads the compiled
            # blob without parsing the ONNX file at all (0.66 s of a cold compile here).
            self._core = ov.Core()
            self._config = config
            compiled = self._core.compile_model(str(self.path), "CPU", config)
            inputs = {i.get_any_name() for i in compiled.inputs}
            # Every name of each output: where the graph's last node is an Identity (a pipeline
            # without Normalize), OpenVINO folds it and the tensor keeps both names, of which
            # get_any_name may give the other (it refused every un-normalised model before).
            outputs = {name: o for o in compiled.outputs for name in o.get_names()}
            if inputs != {INPUT_IDS, ATTENTION_MASK} or OUTPUT not in outputs:
                raise BackendError(f"openvino: {self.path} has inputs {sorted(inputs)} and outputs "
                                   f"{sorted(outputs)}; expected {INPUT_IDS}, {ATTENTION_MASK} -> {OUTPUT}")
            dim = outputs[OUTPUT].get_partial_shape()[-1]
            if not dim.is_static or dim.get_length() <= 0:
                raise BackendError(f"openvino: {self.path}: cannot tell the embedding size of {OUTPUT}")
            self.dim = int(dim.get_length())
        except BackendError:
            raise
        except Exception as exc:  # RuntimeError from the frontend or the CPU plugin
            raise BackendError(f"openvino: cannot load {self.path}: {exc}") from None
        self.output = OUTPUT
        self._first: Any = compiled
        self._lock = threading.Lock()
        self._closed = False
        # One call here, on the loading thread, before any dispatcher runs: the bindings build
        # function-local statics on their first call (pybind11's numpy API among them), and one
        # thread building them releases the GIL inside while another, holding the GIL, waits on
        # the same static: the whole process deadlocks (seen as a worker that stalls on its first
        # batches, every thread in a futex; 9 of 10 fresh processes with 4 contexts calling at once).
        self._warm_up(compiled)

    def _warm_up(self, compiled: Any) -> None:
        # Through a context's own `run`, so the warm-up takes every binding a dispatcher's call takes.
        ids = np.ones((1, 3), dtype=np.int64)
        OpenVinoContext(self, -1, compiled.create_infer_request()).run(ids, ids)

    def create_context(self, index: int) -> OpenVinoContext:
        with self._lock:
            if self._closed:
                raise BackendError(f"openvino: {self.path}: create_context() after close()")
            compiled, self._first = self._first, None
        if compiled is None:
            try:
                compiled = self._core.compile_model(str(self.path), "CPU", self._config)
            except Exception as exc:  # noqa: BLE001 - the plugin's RuntimeError
                raise BackendError(f"openvino: cannot compile {self.path} for context {index}: {exc}") from None
        return OpenVinoContext(self, index, compiled.create_infer_request())

    def close(self) -> None:
        # Freed when the last reference (ours and the contexts' requests) goes.
        with self._lock:
            self._closed = True
            self._first = None
