"""What every part of the exporter builds with: the graph builder, the weights reader, the small
operator helpers (linear, layer norm, GELU), the names of the graph's inputs and output, and
ExportError.

The graph is written node by node with the `onnx` package; it uses only standard opset-17
operators (what TensorRT needs), and keeps the node layout `torch.onnx.export` gives HF models
(MatMul + Add rather than Gemm, LayerNormalization, Erf GELU) because that is what ONNX
Runtime's transformer optimizer pattern-matches. Node and constant names are numbered in the order
they are made, so the order of the calls that build a graph is part of the file's bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from worker.core.errors import KeywordEmbedderError
from worker.core.model import ModelInfo

OPSET = 17  # LayerNormalization is a standard op from 17; ReduceL2 still takes axes as attribute
INPUT_NAMES = ("input_ids", "attention_mask")  # int64 [batch, seq], both dynamic
OUTPUT_NAME = "sentence_embedding"  # float32 [batch, dim]


class ExportError(KeywordEmbedderError, RuntimeError):
    """The model cannot be exported; the message names the model folder or file and the reason."""


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, as numpy (the encoder's weights, a Dense layer's)."""
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises SafetensorError / OSError variants
        raise ExportError(f"{path}: cannot read safetensors weights ({exc})") from None


@dataclass
class Weights:
    """The encoder's tensors by name; `get` checks each against the shape config.json implies."""

    info: ModelInfo
    tensors: dict[str, np.ndarray]

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        try:
            value = self.tensors[name]
        except KeyError:
            raise ExportError(f"{self.info.weights_path}: missing tensor {name!r} "
                              f"(config.json says model_type {self.info.model_type!r}; is it?)") from None
        if value.shape != shape:
            raise ExportError(f"{self.info.weights_path}: tensor {name!r} has shape {value.shape}, "
                              f"config.json implies {shape}")
        # Weights may be stored in float16/bfloat16-as-float; compute is float32 throughout.
        return np.ascontiguousarray(value, dtype=np.float32)


@dataclass
class Graph:
    """The nodes and initializers written so far; every value gets a unique numbered name."""

    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    _counter: int = 0

    def _name(self, hint: str) -> str:
        self._counter += 1
        return f"{hint}_{self._counter}"

    def const(self, hint: str, value: np.ndarray) -> str:
        name = self._name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, *, output: str | None = None,
           **attrs: object) -> str:
        # `output` fixes the value's name (the graph output); otherwise it is made unique.
        out = output or self._name(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"{out}_node", **attrs))
        return out


def i64(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def f32(value: float) -> np.ndarray:
    return np.asarray(value, dtype=np.float32)


def seq_len(g: Graph, ids: str) -> str:
    """The scalar sequence length of an int64 [B, S] input."""
    return g.op("Gather", [g.op("Shape", [ids]), g.const("one", np.asarray(1, dtype=np.int64))],
                "seq_len", axis=0)  # scalar index -> scalar


def linear(g: Graph, w: Weights, x: str, prefix: str, n_in: int, n_out: int) -> str:
    # HF Linear stores [out, in]; MatMul wants [in, out]. MatMul + Add (not Gemm) is what ORT's
    # fusions expect, and it works on [B, S, H] without reshaping to 2-D.
    weight = g.const(f"{prefix}.weight", w.get(f"{prefix}.weight", (n_out, n_in)).T.copy())
    bias = g.const(f"{prefix}.bias", w.get(f"{prefix}.bias", (n_out,)))
    return g.op("Add", [g.op("MatMul", [x, weight], f"{prefix}.matmul"), bias], f"{prefix}.add")


def layer_norm(g: Graph, w: Weights, x: str, prefix: str, hidden: int, eps: float) -> str:
    scale = g.const(f"{prefix}.weight", w.get(f"{prefix}.weight", (hidden,)))
    bias = g.const(f"{prefix}.bias", w.get(f"{prefix}.bias", (hidden,)))
    return g.op("LayerNormalization", [x, scale, bias], f"{prefix}.ln", axis=-1, epsilon=eps)


def gelu(g: Graph, x: str, prefix: str) -> str:
    """Exact GELU in torch's erf form, x * 0.5 * (1 + erf(x / sqrt(2))): the encoder's feed-forward
    activation (ORT fuses it with the bias Add before it into BiasGelu) and a Dense layer's."""
    erf = g.op("Erf", [g.op("Div", [x, g.const("sqrt2", f32(math.sqrt(2.0)))], f"{prefix}.gelu.div")],
               f"{prefix}.gelu.erf")
    return g.op("Mul", [g.op("Mul", [x, g.op("Add", [erf, g.const("one_f", f32(1.0))], f"{prefix}.gelu.add")],
                             f"{prefix}.gelu.mul"), g.const("half", f32(0.5))], f"{prefix}.gelu")
