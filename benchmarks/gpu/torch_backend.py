"""A benchmark-only GPU backend: the exported ONNX graph's weights run by PyTorch on CUDA.

The lent GPU machine has PyTorch and CUDA but neither TensorRT nor a CUDA build of ONNX
Runtime, so this is how the worker's bucketing is measured on a GPU there. It reads the
weights from the same ONNX export that ONNX Runtime and TensorRT run (names as
engines/onnx_export/encoder.py writes them), computes the same BERT forward + mean pooling + L2
normalisation in float16, and implements the Backend protocol of worker/backends/base.py, one
CUDA stream per context, as the TensorRT backend does. It is not part of the worker: nothing
under worker/ imports torch.

Graphs mode (`graphs(profile)`): eager PyTorch measured launch-bound on this model (2-3 ms per
forward for any shape), which hides what padding costs. With CUDA graphs each bucket's forward
is captured once at its static shape (graph_shapes.py) and replayed as one launch, the closest a
GPU without TensorRT comes to a fixed-shape engine per bucket. Captured graphs are pooled by the
backend: a context takes a set when it starts (capturing one the first time) and gives it back
when it closes, so later runs of the benchmark replay without capturing again. Captures are
serialised by a lock (two threads capturing at once would record each other's work).
NOT YET RUN ON A GPU (written after the last device session); its torch-free logic is tested.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper

from benchmarks.gpu.graph_shapes import GraphShape, graph_shapes, shape_for, stage_rows
from worker.core.profiles import Profile

_NAME = re.compile(r"^(.*)_\d+$")


def _weights(onnx_path: Path) -> dict[str, np.ndarray]:
    out = {}
    for init in onnx.load(str(onnx_path)).graph.initializer:
        name = init.name.removesuffix("__f16")
        m = _NAME.match(name)
        if m and ("." in m.group(1) or m.group(1).endswith("embeddings")):
            out[m.group(1)] = numpy_helper.to_array(init).astype(np.float32)
    return out


class TorchContext:
    def __init__(self, backend: TorchBertBackend) -> None:
        self._b = backend
        self._stream = torch.cuda.Stream()

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        with torch.cuda.stream(self._stream), torch.inference_mode():
            ids = torch.from_numpy(np.ascontiguousarray(input_ids))
            mask = torch.from_numpy(np.ascontiguousarray(attention_mask))
            if self._b.pin:
                ids, mask = ids.pin_memory(), mask.pin_memory()
            ids, mask = ids.cuda(non_blocking=True), mask.cuda(non_blocking=True)
            out = self._b.forward(ids, mask).float().cpu()
        return out.numpy()

    def close(self) -> None:
        pass


class _GraphSet:
    """One captured graph per bucket shape, with its static device and pinned host buffers."""

    def __init__(self, backend: TorchBertBackend, shapes: list[GraphShape]) -> None:
        self.stream = torch.cuda.Stream()
        self.graphs: list[tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor, torch.Tensor]] = []
        with torch.cuda.stream(self.stream), torch.inference_mode():
            for shape in shapes:
                ids = torch.zeros((shape.batch, shape.length), dtype=torch.long, device="cuda")
                mask = torch.ones_like(ids)
                for _ in range(2):  # warm-up on the capture stream: lazy init stays out of the graph
                    backend.forward(ids, mask)
                self.stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                    out = backend.forward(ids, mask)
                host_ids = torch.zeros(ids.shape, dtype=torch.long).pin_memory()
                host_mask = torch.zeros(ids.shape, dtype=torch.long).pin_memory()
                self.graphs.append((graph, ids, mask, out, host_ids, host_mask))

    def run(self, shape: GraphShape, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        graph, ids, mask, out, host_ids, host_mask = self.graphs[shape.bucket]
        with torch.cuda.stream(self.stream), torch.inference_mode():
            # The previous replay's device->host copy has finished (synchronised below), so the
            # pinned buffers are free to overwrite.
            batch = stage_rows(host_ids.numpy(), host_mask.numpy(), input_ids, attention_mask)
            ids.copy_(host_ids, non_blocking=True)
            mask.copy_(host_mask, non_blocking=True)
            graph.replay()
            result = out[:batch].float().cpu()  # synchronises the stream
        return result.numpy()


class TorchGraphContext:
    """A context of the graphs mode: a pooled set of captured graphs, one per bucket shape."""

    def __init__(self, backend: TorchBertBackend) -> None:
        self._b = backend
        self._set = backend._take_graphs()

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        assert self._b.profile is not None
        shape = shape_for(self._b.shapes, self._b.profile, *input_ids.shape)
        return self._set.run(shape, input_ids, attention_mask)

    def close(self) -> None:
        self._b._give_back(self._set)


class TorchBertBackend:
    name = "torch-cuda"
    max_contexts = None
    requires_serial_dispatch = False
    profile: Profile | None = None  # set in graphs mode: the shapes captured

    def __init__(self, onnx_path: Path, *, layers: int = 6, heads: int = 12, dtype: torch.dtype = torch.float16,
                 eps: float = 1e-12, pin: bool = True) -> None:
        self.pin = pin
        w = _weights(onnx_path)
        dev = torch.device("cuda")
        self.w = {k: torch.from_numpy(v).to(dev, dtype) for k, v in w.items()}
        self.layers, self.heads, self.eps = layers, heads, eps
        self.dim = self.w["embeddings.LayerNorm.weight"].shape[0]
        self.providers = [f"torch {torch.__version__} cuda {torch.version.cuda} {dtype}"]
        self.shapes: list[GraphShape] = []
        self._pool: list[_GraphSet] = []
        self._pool_lock = threading.Lock()

    def graphs(self, profile: Profile) -> TorchBertBackend:
        """The same weights in graphs mode for `profile`'s bucket shapes (a new backend object)."""
        twin = object.__new__(TorchBertBackend)
        twin.__dict__.update(self.__dict__)
        twin.name, twin.profile, twin.shapes = "torch-cuda-graphs", profile, graph_shapes(profile)
        twin.providers = [*self.providers, f"cuda graphs, profile {profile.name}"]
        twin._pool, twin._pool_lock = [], threading.Lock()
        return twin

    def _take_graphs(self) -> _GraphSet:
        with self._pool_lock:  # also serialises captures
            return self._pool.pop() if self._pool else _GraphSet(self, self.shapes)

    def _give_back(self, graphs: _GraphSet) -> None:
        with self._pool_lock:
            self._pool.append(graphs)

    def _ln(self, x: torch.Tensor, p: str) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.w[p + ".weight"], self.w[p + ".bias"], self.eps)

    def _lin(self, x: torch.Tensor, p: str) -> torch.Tensor:
        return torch.addmm(self.w[p + ".bias"], x.reshape(-1, x.shape[-1]), self.w[p + ".weight"]).reshape(
            *x.shape[:-1], -1)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        w = self.w
        b, L = ids.shape
        x = w["word_embeddings"][ids] + w["position_embeddings"][:L] + w["token_type_embeddings"][0]
        x = self._ln(x, "embeddings.LayerNorm")
        keep = mask.bool()[:, None, None, :]
        hd = self.dim // self.heads
        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            q, k, v = (self._lin(x, p + f"attention.self.{n}").view(b, L, self.heads, hd).transpose(1, 2)
                       for n in ("query", "key", "value"))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, L, self.dim)
            x = self._ln(x + self._lin(a, p + "attention.output.dense"), p + "attention.output.LayerNorm")
            h = F.gelu(self._lin(x, p + "intermediate.dense"))
            x = self._ln(x + self._lin(h, p + "output.dense"), p + "output.LayerNorm")
        m = mask.to(x.dtype)[:, :, None]
        pooled = (x.float() * m.float()).sum(1) / m.float().sum(1).clamp(min=1e-9)
        return F.normalize(pooled, dim=-1)

    def create_context(self, index: int) -> TorchContext | TorchGraphContext:
        return TorchGraphContext(self) if self.profile is not None else TorchContext(self)

    def close(self) -> None:
        self._pool.clear()
        if self.profile is None:  # a graphs-mode twin shares the weights of its eager backend
            self.w.clear()
