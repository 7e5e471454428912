"""The sentence-transformers modules after the encoder (worker.core.st_pipeline): the Pooling
(pooling.py), then the Dense layers and Normalize in the order modules.json lists them.

The last of them is the graph output `sentence_embedding`: float32 [batch, dim] (the pipeline's
width), unit L2 norm where the pipeline normalises (metadata "normalize": "l2", else "none").
A new Dense activation is a branch of `_dense`.
"""

from __future__ import annotations

import numpy as np

from engines.onnx_export.graph import OUTPUT_NAME, ExportError, Graph, f32, gelu, read_safetensors
from engines.onnx_export.pooling import pool, without_prompt
from worker.core.model import ModelInfo
from worker.core.st_pipeline import Dense

# Node-name prefixes of the float layers of the pooling (pooling.py) and of the normalisation
# below (not the integer mask's Unsqueeze/Cast, nor the pool_index_* integer and boolean nodes),
# and of a sparse model's MLM head and SPLADE pooling (mlm.py, splade.py; not their sparse_index_*
# nodes): the fp16 graph for TensorRT keeps these, and everything downstream of them (Dense layers
# included), in FP32 by Casts (engines/fp16_onnx.py; the build checks it, engines.build_engine.
# fp32_region), so keep them in step with those names.
FP32_NODE_PREFIXES: tuple[str, ...] = ("masked_states", "pool_sum", "pool_count", "pooled", "norm_", "mlm_",
                                       "splade_", OUTPUT_NAME)


def head(g: Graph, info: ModelInfo, dense_weights: list[tuple[np.ndarray, np.ndarray | None]],
         hidden_states: str | None, attention_mask: str, *, pooled: str | None = None) -> str:
    """sentence-transformers' modules after the encoder: Pooling (unless the encoder gives the
    `pooled` [B, hidden] itself, engines.onnx_export.rotary), then Dense and Normalize in order."""
    pipeline = info.pipeline
    if pooled is not None:
        x = pooled
    else:
        assert hidden_states is not None
        mask = attention_mask
        if pipeline.prompt_tokens_excluded:
            mask = without_prompt(g, attention_mask, pipeline.prompt_tokens_excluded)
        x = pool(g, pipeline.pooling.modes, hidden_states, mask,
                 prompt_excluded=bool(pipeline.prompt_tokens_excluded))
    dense = iter(zip(pipeline.dense, dense_weights))
    for i, step in enumerate(pipeline.steps):
        if isinstance(step, Dense):
            layer, (weight, bias) = next(dense)
            x = _dense(g, layer, weight, bias, x, i)
        else:
            x = _normalise(g, x, output=OUTPUT_NAME if i == len(pipeline.steps) - 1 else None)
    if not pipeline.normalized:
        x = g.op("Identity", [x], output=OUTPUT_NAME)
    return x


def _dense(g: Graph, layer: Dense, weight: np.ndarray, bias: np.ndarray | None, x: str, i: int) -> str:
    """sentence-transformers' Dense: activation(x W^T + b) on the [B, in] embedding."""
    p = f"dense_{i}"
    y = g.op("MatMul", [x, g.const(f"{p}.weight", weight.T.copy())], f"{p}.matmul")
    if bias is not None:
        y = g.op("Add", [y, g.const(f"{p}.bias", bias)], f"{p}.add")
    act = layer.activation
    if act == "tanh":
        return g.op("Tanh", [y], f"{p}.tanh")
    if act == "relu":
        return g.op("Relu", [y], f"{p}.relu")
    if act == "sigmoid":
        return g.op("Sigmoid", [y], f"{p}.sigmoid")
    if act == "silu":
        return g.op("Mul", [y, g.op("Sigmoid", [y], f"{p}.silu_gate")], f"{p}.silu")
    if act == "gelu":  # torch.nn.GELU(): the exact erf form, as the encoder's
        return gelu(g, y, p)
    if act == "identity":
        return y
    raise ExportError(f"{layer.config_path}: activation {act!r} is not supported")


def _normalise(g: Graph, x: str, *, output: str | None) -> str:
    # torch.nn.functional.normalize: x / max(||x||, 1e-12).
    norm = g.op("ReduceL2", [x], "norm", axes=[1], keepdims=1)
    norm = g.op("Max", [norm, g.const("norm_min", f32(1e-12))], "norm_c")
    return g.op("Div", [x, norm], "norm_div", output=output)


def load_dense(info: ModelInfo) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """The (weight [out, in], bias [out] or None) of each Dense layer, float32."""
    out = []
    for layer in info.pipeline.dense:
        raw = read_safetensors(layer.weights_path)
        expect = {"linear.weight": (layer.out_features, layer.in_features)}
        if layer.bias:
            expect["linear.bias"] = (layer.out_features,)
        for key, shape in expect.items():
            if key not in raw:
                raise ExportError(f"{layer.weights_path}: missing tensor {key!r}")
            if raw[key].shape != shape:
                raise ExportError(f"{layer.weights_path}: tensor {key!r} has shape {raw[key].shape}, "
                                  f"{layer.config_path.name} implies {shape}")
        bias = np.ascontiguousarray(raw["linear.bias"], dtype=np.float32) if layer.bias else None
        out.append((np.ascontiguousarray(raw["linear.weight"], dtype=np.float32), bias))
    return out
