"""The encoder: embeddings -> N transformer layers -> hidden states [B, S, hidden], per family.

Sizes come from config.json, the family from its model_type (worker.core.model.BERT_FAMILIES); all are
post-LayerNorm encoders with exact-GELU feed-forward layers, so one layer function serves every
family through a table of where each keeps its tensors. A new family is a row in `_PREFIXES` and
`_LAYER_NAMES`, plus its own positions or attention bias here if it has them:

- bert: absolute positions 0..S-1, token type 0 added.
- roberta, xlm-roberta: BERT's layers; positions numbered from padding_idx + 1 over the real
  tokens (HF's create_position_ids_from_input_ids, computed here from the attention mask, so
  the pad id the batch uses does not matter); a one-row token type table.
- distilbert: BERT's layers under other names (q_lin, sa_layer_norm, ffn.lin1, ...); no token
  types.
- mpnet: RoBERTa's positions, no token types, and a relative position bias added to every
  layer's attention scores: T5-style buckets (32, max distance 128, as HF MPNetEncoder) of
  key - query, precomputed here as one [2 * max_pos - 1, heads] table indexed by the distance.

The node layout mirrors what `torch.onnx.export` produces for HF BertModel (Reshape to
[0, 0, heads, head_size], Transpose, MatMul, Div by sqrt(head_size), additive mask built as
(1 - mask) * -10000, Erf GELU, ...): the layout ONNX Runtime's transformer optimizer
pattern-matches into Attention, SkipLayerNormalization, BiasGelu and EmbedLayerNormalization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from engines.onnx_export.graph import (ExportError, Graph, Weights, f32, gelu, i64, layer_norm, linear,
                                       read_safetensors, seq_len)
from worker.core.model import BERT_FAMILIES, ModelInfo

# The additive mask value HF BERT used when ORT's fusion patterns were written; exp(-10000) is 0
# in float32, so padded positions get exactly zero attention weight (padding invariance).
MASK_FILL = -10000.0

# The checkpoint prefix of the encoder in XxxForYyy checkpoints (XLM-RoBERTa's classes reuse "roberta").
_PREFIXES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "distilbert": "distilbert",
             "mpnet": "mpnet"}


@dataclass(frozen=True)
class _LayerNames:
    """Where one family keeps a layer's tensors: the same maths under different names."""

    layer: str           # "encoder.layer.{i}"
    query: str
    key: str
    value: str
    attn_out: str
    attn_norm: str
    ffn_in: str
    ffn_out: str
    ffn_norm: str


_BERT_NAMES = _LayerNames("encoder.layer.{i}", "attention.self.query", "attention.self.key",
                          "attention.self.value", "attention.output.dense", "attention.output.LayerNorm",
                          "intermediate.dense", "output.dense", "output.LayerNorm")
_LAYER_NAMES = {
    "bert": _BERT_NAMES, "roberta": _BERT_NAMES, "xlm-roberta": _BERT_NAMES,
    "distilbert": _LayerNames("transformer.layer.{i}", "attention.q_lin", "attention.k_lin", "attention.v_lin",
                              "attention.out_lin", "sa_layer_norm", "ffn.lin1", "ffn.lin2", "output_layer_norm"),
    "mpnet": _LayerNames("encoder.layer.{i}", "attention.attn.q", "attention.attn.k", "attention.attn.v",
                         "attention.attn.o", "attention.LayerNorm", "intermediate.dense", "output.dense",
                         "output.LayerNorm"),
}
assert set(_PREFIXES) == set(_LAYER_NAMES) == set(BERT_FAMILIES)

# HF MPNetEncoder.compute_position_bias always buckets with these (not the config's bucket count).
MPNET_BUCKETS = 32
MPNET_MAX_DISTANCE = 128


def mpnet_buckets(relative: np.ndarray) -> np.ndarray:
    """HF MPNetEncoder.relative_position_bucket of (key position - query position), in numpy.

    float32 like torch's, so the truncation to a bucket lands the same way (checked against
    transformers 5.x for every distance below 4096).
    """
    half = MPNET_BUCKETS // 2
    n = -relative.astype(np.int64)
    ret = (n < 0).astype(np.int64) * half
    n = np.abs(n)
    max_exact = half // 2
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = (np.log(n.astype(np.float32) / np.float32(max_exact))
                  / np.float32(math.log(MPNET_MAX_DISTANCE / max_exact)) * np.float32(half - max_exact))
    large = np.minimum(max_exact + np.nan_to_num(scaled, neginf=0.0).astype(np.int64), half - 1)
    return ret + np.where(n < max_exact, n, large)


def load_weights(info: ModelInfo) -> Weights:
    """The encoder's tensors under the names the layer table uses, whatever the checkpoint's prefix."""
    raw = read_safetensors(info.weights_path)
    weights: dict[str, np.ndarray] = {}
    prefix = f"{_PREFIXES[info.model_type]}."
    for key, value in raw.items():
        # XxxForYyy checkpoints prefix the encoder with "bert." ("roberta.", ...); old TF ports
        # call LayerNorm parameters gamma/beta.
        name = key.removeprefix(prefix).replace("LayerNorm.gamma", "LayerNorm.weight")
        name = name.replace("LayerNorm.beta", "LayerNorm.bias")
        weights[name] = value
    return Weights(info, weights)


def _embeddings(g: Graph, w: Weights, info: ModelInfo, input_ids: str, attention_mask: str) -> str:
    h = info.hidden_size
    word = g.const("word_embeddings", w.get("embeddings.word_embeddings.weight", (info.vocab_size, h)))
    pos_table = w.get("embeddings.position_embeddings.weight", (info.max_position_embeddings, h))
    pos = g.const("position_embeddings", pos_table)
    type_table = w.tensors.get("embeddings.token_type_embeddings.weight")
    if info.position_offset == 0:
        # Position ids: Slice of a [1, max_pos] constant up to seq_len, as HF exports BERT (the
        # layout ORT's EmbedLayerNormalization fusion recognises).
        end = g.op("Unsqueeze", [seq_len(g, input_ids), g.const("axis0", i64(0))], "seq_end")
        pos_ids = g.op("Slice", [g.const("position_ids", np.arange(info.max_position_embeddings, dtype=np.int64)[None]),
                                 g.const("zero", i64(0)), end, g.const("axis1", i64(1)), g.const("step", i64(1))],
                       "position_ids")
    else:
        # padding_idx + cumsum(mask) * mask: real tokens get padding_idx + 1, + 2, ...; padding
        # gets padding_idx (HF computes the mask from input_ids != padding_idx, which is the
        # same for any text without pad tokens in it).
        counted = g.op("Mul", [g.op("CumSum", [attention_mask, g.const("axis1_scalar", np.asarray(1, dtype=np.int64))],
                                    "pos_cumsum"), attention_mask], "pos_counted")
        pos_ids = g.op("Add", [counted, g.const("padding_idx", np.asarray(info.position_offset - 1, dtype=np.int64))],
                       "position_ids")
    words = g.op("Gather", [word, input_ids], "word_emb")
    if type_table is not None:
        # Single-sentence input: token type 0 everywhere. Kept as a Gather on zeros shaped like
        # input_ids so the graph keeps BERT's three-Gather embedding layout.
        types = g.const("token_type_embeddings", w.get("embeddings.token_type_embeddings.weight", type_table.shape))
        zeros = g.op("Mul", [input_ids, g.const("zero_scalar", np.asarray(0, dtype=np.int64))], "token_type_ids")
        words = g.op("Add", [words, g.op("Gather", [types, zeros], "type_emb")], "word_type_emb")
    summed = g.op("Add", [words, g.op("Gather", [pos, pos_ids], "pos_emb")], "emb_sum")
    return layer_norm(g, w, summed, "embeddings.LayerNorm", h, info.layer_norm_eps)


def _relative_bias(g: Graph, w: Weights, info: ModelInfo, input_ids: str) -> str:
    """MPNet: [1, heads, S, S] bias of bucket(key - query), the same for every layer and row."""
    table = w.get("encoder.relative_attention_bias.weight", (info.relative_attention_buckets, info.num_heads))
    if info.relative_attention_buckets < MPNET_BUCKETS:
        raise ExportError(f"{info.config_path}: relative_attention_num_buckets {info.relative_attention_buckets} "
                          f"is below the {MPNET_BUCKETS} buckets MPNet's position bias uses")
    span = info.max_position_embeddings
    distances = np.arange(-(span - 1), span, dtype=np.int64)
    by_distance = g.const("relative_bias_table", table[mpnet_buckets(distances)])  # [2 * span - 1, heads]
    steps = g.op("Range", [g.const("zero_scalar", np.asarray(0, dtype=np.int64)), seq_len(g, input_ids),
                           g.const("one_scalar", np.asarray(1, dtype=np.int64))], "positions")
    relative = g.op("Sub", [g.op("Unsqueeze", [steps, g.const("axis0", i64(0))], "key_pos"),
                            g.op("Unsqueeze", [steps, g.const("axis1", i64(1))], "query_pos")], "relative")
    index = g.op("Add", [relative, g.const("distance_offset", np.asarray(span - 1, dtype=np.int64))], "distance")
    bias = g.op("Transpose", [g.op("Gather", [by_distance, index], "relative_bias_sqh")], "relative_bias_hsq",
                perm=[2, 0, 1])
    return g.op("Unsqueeze", [bias, g.const("axis0", i64(0))], "relative_bias")


def _mask_bias(g: Graph, attention_mask: str) -> str:
    # [B, S] -> [B, 1, 1, S] additive bias: 0 where attended, -10000 on padding.
    m = g.op("Unsqueeze", [attention_mask, g.const("axis1", i64(1))], "mask_u1")
    m = g.op("Unsqueeze", [m, g.const("axis2", i64(2))], "mask_u2")
    m = g.op("Cast", [m], "mask_f", to=TensorProto.FLOAT)
    inv = g.op("Sub", [g.const("one_f", f32(1.0)), m], "mask_inv")
    return g.op("Mul", [inv, g.const("mask_fill", f32(MASK_FILL))], "mask_bias")


def _encoder_layer(g: Graph, w: Weights, info: ModelInfo, x: str, mask_bias: str, i: int) -> str:
    h, heads, hs = info.hidden_size, info.num_heads, info.head_size
    names = _LAYER_NAMES[info.model_type]
    p = names.layer.format(i=i)
    split = g.const("split_heads", i64(0, 0, heads, hs))

    def heads_of(name: str, perm: list[int]) -> str:
        proj = linear(g, w, x, f"{p}.{name}", h, h)
        short = name.rsplit(".", 1)[-1]  # BERT's graph keeps the node names it always had
        return g.op("Transpose", [g.op("Reshape", [proj, split], f"{p}.{short}.reshape")], f"{p}.{short}.t", perm=perm)

    q = heads_of(names.query, [0, 2, 1, 3])        # [B, heads, S, hs]
    k = heads_of(names.key, [0, 2, 3, 1])          # [B, heads, hs, S]
    v = heads_of(names.value, [0, 2, 1, 3])        # [B, heads, S, hs]
    scores = g.op("Div", [g.op("MatMul", [q, k], f"{p}.qk"), g.const("sqrt_hs", f32(math.sqrt(hs)))], f"{p}.scaled")
    probs = g.op("Softmax", [g.op("Add", [scores, mask_bias], f"{p}.masked")], f"{p}.probs", axis=-1)
    ctx = g.op("Transpose", [g.op("MatMul", [probs, v], f"{p}.ctx")], f"{p}.ctx.t", perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, g.const("merge_heads", i64(0, 0, h))], f"{p}.ctx.merge")
    attn = linear(g, w, ctx, f"{p}.{names.attn_out}", h, h)
    x = layer_norm(g, w, g.op("Add", [attn, x], f"{p}.attn.residual"), f"{p}.{names.attn_norm}",
                   h, info.layer_norm_eps)
    inter = linear(g, w, x, f"{p}.{names.ffn_in}", h, info.intermediate_size)
    out = linear(g, w, gelu(g, inter, p), f"{p}.{names.ffn_out}", info.intermediate_size, h)
    return layer_norm(g, w, g.op("Add", [out, x], f"{p}.ffn.residual"), f"{p}.{names.ffn_norm}",
                      h, info.layer_norm_eps)


def encode(g: Graph, w: Weights, info: ModelInfo, input_ids: str, attention_mask: str) -> str:
    """The encoder's last hidden states [B, S, hidden] for the graph inputs."""
    x = _embeddings(g, w, info, input_ids, attention_mask)
    bias = _mask_bias(g, attention_mask)
    if info.relative_attention_buckets:
        # One [B, heads, S, S] bias (positions + padding) for every layer, as MPNet adds both.
        bias = g.op("Add", [_relative_bias(g, w, info, input_ids), bias], "attention_bias")
    for i in range(info.num_layers):
        x = _encoder_layer(g, w, info, x, bias, i)
    return x
