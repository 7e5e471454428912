"""ONNX Runtime backend (CPU): one InferenceSession shared by every context.

`InferenceSession.run` is thread-safe, so a context is only a thin handle that checks shapes
and feeds the shared session; ONNX Runtime parallelises inside each run with its intra-op pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from worker.backends.base import check_batch
from worker.core.errors import BackendError

GraphOptimization = Literal["disable", "basic", "extended", "all"]

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
OUTPUT = "sentence_embedding"


@dataclass
class OnnxRuntimeContext:
    backend: OnnxRuntimeBackend
    index: int
    closed: bool = False

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        if self.closed:
            raise BackendError(f"onnxruntime context {self.index}: run() after close()")
        return self.backend.run(input_ids, attention_mask)

    def close(self) -> None:
        self.closed = True


class OnnxRuntimeBackend:
    name = "onnxruntime"
    max_contexts: int | None = None
    requires_serial_dispatch: bool = False

    def __init__(self, onnx_path: str | Path, *, intra_op_threads: int = 0, allow_spinning: bool = True,
                 graph_optimization: GraphOptimization = "all",
                 providers: Sequence[str] = ("CPUExecutionProvider",)) -> None:
        import onnxruntime as ort

        self.path = Path(onnx_path).expanduser()
        if not self.path.is_file():
            raise BackendError(f"onnxruntime: model file {self.path} not found "
                               "(run `keyword-embedder export-onnx`, or let Embedder export it)")
        if intra_op_threads < 0:
            raise BackendError(f"onnxruntime: intra_op_threads must be >= 0 (0: ORT default), got {intra_op_threads}")
        levels = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }
        if graph_optimization not in levels:
            raise BackendError(f"onnxruntime: graph_optimization must be one of {sorted(levels)}, "
                               f"got {graph_optimization!r}")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = intra_op_threads
        # One run at a time per caller thread; parallelism comes from the intra-op pool.
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = levels[graph_optimization]
        # Spinning pool threads answer the next run a few microseconds sooner, but between runs
        # they burn the cores the poll, output and delivery threads (and a co-located broker) need.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
        opts.log_severity_level = 3  # errors only: the fused graph's contrib ops log notices
        try:
            # Other providers (CUDA) serve benchmarks on a GPU host without TensorRT; the worker
            # itself runs ONNX Runtime on CPU and TensorRT on GPUs.
            self._session = ort.InferenceSession(str(self.path), opts, providers=list(providers))
        except Exception as exc:  # ORT raises its own Fail/InvalidGraph/InvalidProtobuf types
            raise BackendError(f"onnxruntime: cannot load {self.path}: {exc}") from None
        self.providers = self._session.get_providers()
        self.intra_op_threads = intra_op_threads
        self.allow_spinning = allow_spinning
        self.graph_optimization = graph_optimization
        inputs = {i.name: i for i in self._session.get_inputs()}
        outputs = {o.name: o for o in self._session.get_outputs()}
        if set(inputs) != {INPUT_IDS, ATTENTION_MASK} or OUTPUT not in outputs:
            raise BackendError(f"onnxruntime: {self.path} has inputs {sorted(inputs)} and outputs "
                               f"{sorted(outputs)}; expected {INPUT_IDS}, {ATTENTION_MASK} -> {OUTPUT}")
        # The exporter writes int64 inputs; an int32 graph (e.g. from another tool) is fed int32.
        self._input_dtype = {name: (np.int32 if "int32" in i.type else np.int64) for name, i in inputs.items()}
        dim = outputs[OUTPUT].shape[-1]
        meta = self._session.get_modelmeta().custom_metadata_map
        if not isinstance(dim, int):
            dim = int(meta.get("dim", 0))
        if dim <= 0:
            raise BackendError(f"onnxruntime: {self.path}: cannot tell the embedding size of {OUTPUT}")
        self.dim = dim
        self.metadata: dict[str, str] = dict(meta)
        self._closed = False

    def create_context(self, index: int) -> OnnxRuntimeContext:
        if self._closed:
            raise BackendError(f"onnxruntime: {self.path}: create_context() after close()")
        return OnnxRuntimeContext(self, index)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        """[B, L] ids and mask -> [B, dim] float32 (callable from any thread)."""
        if self._closed:
            raise BackendError(f"onnxruntime: {self.path}: run() after close()")
        check_batch("onnxruntime", input_ids, attention_mask)
        if input_ids.shape[0] == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        feed = {
            INPUT_IDS: np.ascontiguousarray(input_ids, dtype=self._input_dtype[INPUT_IDS]),
            ATTENTION_MASK: np.ascontiguousarray(attention_mask, dtype=self._input_dtype[ATTENTION_MASK]),
        }
        try:
            (out,) = self._session.run([OUTPUT], feed)
        except Exception as exc:
            raise BackendError(f"onnxruntime: {self.path}: run failed on a batch of shape "
                               f"{tuple(input_ids.shape)}: {exc}") from None
        return out

    def close(self) -> None:
        # ORT frees the session when the last reference goes; dropping ours is all there is.
        self._closed = True
        self._session = None  # type: ignore[assignment]
