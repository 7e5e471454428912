"""SPLADE pooling (sentence-transformers' SpladePooling) of the MLM logits, inside the graph.

sentence-transformers computes, for logits [B, S, V] and the attention mask m:

    x = activation(logits * m)          relu -> log1p; log1p_relu: log1p once more
    max: out = max_s x                  sum: out = sum_s x

The graph output is the [B, V] float32 weights (non-negative, nearly all zero); the worker keeps
the non-zero entries (worker/core/sparse.py).

max, the strategy every published SPLADE model uses, is written as
`activation(max_s logits_s + bias)`, which is the same number: relu and log1p are monotone (so the
max can go before them), a masked position contributes a 0 that relu makes of every negative
logit anyway, and float rounding of `+ bias` is monotone (so the bias can go after the max).
The activation then runs on [B, V] instead of [B, S, V]. Padded positions are kept out of the max
by giving them the first position's hidden state (rows are right-padded and start with [CLS],
which counts in sentence-transformers too): a duplicate of a real position never changes a max,
and the [B, S, H] select costs nothing beside the [B, S, V] product. The product itself is the
one [B, S, V] tensor the graph materialises (S x V x 4 bytes per row: 3.9 MB for 32 tokens of a
30,522-entry vocabulary), which is why a sparse model's batches have a smaller token budget
(worker/batching/...: sparse_token_budget).

sum has no such shortcut: the activation runs per position and the mask is applied to it.

ONNX has no log1p, and `Log(1 + x)` in float32 is off by up to 1.7e-4 relative on the small
weights a SPLADE model gives (the parity check allows 1e-4). Kahan's form is exact to a few ulp:
u = 1 + x; log1p(x) = x where u == 1, else log(u) * x / (u - 1).

Node names: splade_* (float) and sparse_index_* (integer and boolean); an FP16 TensorRT build
keeps everything from the MLM head on in FP32 (head.FP32_NODE_PREFIXES).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from engines.onnx_export.graph import OUTPUT_NAME, ExportError, Graph, f32, i64
from engines.onnx_export.mlm import Decoder
from worker.core.st_pipeline import SpladePooling


def log1p(g: Graph, x: str, hint: str) -> str:
    """log(1 + x) for x >= 0 to a few ulp (Kahan), from standard operators."""
    u = g.op("Add", [x, g.const("one_f", f32(1.0))], f"{hint}_u")
    same = g.op("Equal", [u, g.const("one_f", f32(1.0))], f"sparse_index_{hint}_tiny")
    scaled = g.op("Div", [g.op("Mul", [g.op("Log", [u], f"{hint}_log"), x], f"{hint}_logx"),
                          g.op("Sub", [u, g.const("one_f", f32(1.0))], f"{hint}_um1")], f"{hint}_ratio")
    return g.op("Where", [same, x, scaled], hint)


def _activation(g: Graph, x: str, pooling: SpladePooling, *, output: str | None = None) -> str:
    y = log1p(g, g.op("Relu", [x], "splade_relu"), "splade_log1p")
    if pooling.activation == "log1p_relu":
        y = log1p(g, y, "splade_log1p2")
    if output is not None:
        return g.op("Identity", [y], output=output)
    return y


def splade(g: Graph, pooling: SpladePooling, decoder: Decoder, transformed: str, attention_mask: str) -> str:
    """The [B, V] SPLADE weights of the MLM head's transformed states [B, S, H]; the graph output."""
    weight_t = g.const("mlm_decoder_weight_t", np.ascontiguousarray(decoder.weight.T))  # [H, V]
    bias = g.const("mlm_decoder_bias", decoder.bias)
    keep = g.op("Cast", [g.op("Unsqueeze", [attention_mask, g.const("axis2", i64(2))], "sparse_index_mask_u")],
                "sparse_index_keep", to=TensorProto.BOOL)  # [B, S, 1]
    if pooling.strategy == "max":
        first = g.op("Gather", [transformed, g.const("zero_i", np.asarray([0], dtype=np.int64))],
                     "splade_first", axis=1)  # [B, 1, H]
        states = g.op("Where", [keep, transformed, first], "splade_states")
        logits = g.op("MatMul", [states, weight_t], "splade_logits")  # [B, S, V]: the big one
        best = g.op("ReduceMax", [logits], "splade_max", axes=[1], keepdims=0)
        weights = _activation(g, g.op("Add", [best, bias], "splade_max_bias"), pooling)
        # A row with no token at all (never one of the worker's) gives zeros, as sentence-transformers'.
        mask_f = g.op("Cast", [attention_mask], "splade_mask_f", to=TensorProto.FLOAT)
        any_token = g.op("ReduceMax", [mask_f], "splade_any", axes=[1], keepdims=1)  # [B, 1]
        return g.op("Mul", [weights, any_token], "splade_weights", output=OUTPUT_NAME)
    if pooling.strategy == "sum":
        logits = g.op("Add", [g.op("MatMul", [transformed, weight_t], "splade_logits"), bias], "splade_logits_b")
        per_token = _activation(g, logits, pooling)
        mask_f = g.op("Cast", [keep], "splade_mask_f", to=TensorProto.FLOAT)
        masked = g.op("Mul", [per_token, mask_f], "splade_masked")
        return g.op("ReduceSum", [masked, g.const("axis1", i64(1))], "splade_sum", keepdims=0, output=OUTPUT_NAME)
    raise ExportError(f"SpladePooling pooling_strategy {pooling.strategy!r} is not supported")
