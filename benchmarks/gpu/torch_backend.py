"""A benchmark-only GPU backend: the exported ONNX graph's weights run by PyTorch on CUDA.

The lent GPU machine has PyTorch and CUDA but neither TensorRT nor a CUDA build of ONNX
Runtime, so this is how the worker's bucketing is measured on a GPU there. It reads the
weights from the same ONNX export that ONNX Runtime and TensorRT run (names as
engines/export_onnx.py writes them), computes the same BERT forward + mean pooling + L2
normalisation in float16, and implements the Backend protocol of worker/backends/base.py, one
CUDA stream per context, as the TensorRT backend does. It is not part of the worker: nothing
under worker/ imports torch.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper

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


class TorchBertBackend:
    name = "torch-cuda"
    max_contexts = None

    def __init__(self, onnx_path: Path, *, layers: int = 6, heads: int = 12, dtype: torch.dtype = torch.float16,
                 eps: float = 1e-12, pin: bool = True) -> None:
        self.pin = pin
        w = _weights(onnx_path)
        dev = torch.device("cuda")
        self.w = {k: torch.from_numpy(v).to(dev, dtype) for k, v in w.items()}
        self.layers, self.heads, self.eps = layers, heads, eps
        self.dim = self.w["embeddings.LayerNorm.weight"].shape[0]
        self.providers = [f"torch {torch.__version__} cuda {torch.version.cuda} {dtype}"]

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

    def create_context(self, index: int) -> TorchContext:
        return TorchContext(self)

    def close(self) -> None:
        self.w.clear()
