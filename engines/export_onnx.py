"""Export a sentence encoder to ONNX without torch.

The weights are read with safetensors into numpy and the graph is written node by node with the
`onnx` package: embeddings -> N encoder layers -> the model's sentence-transformers modules
(worker.core.st_pipeline: the pooling over the attention mask, any Dense layers, L2 normalisation
where a Normalize module is listed). Sizes come from config.json; the family from its model_type
(worker.core.model.FAMILIES), all post-LayerNorm encoders with exact-GELU feed-forward layers:

- bert: absolute positions 0..S-1, token type 0 added.
- roberta, xlm-roberta: BERT's layers; positions numbered from padding_idx + 1 over the real
  tokens (HF's create_position_ids_from_input_ids, computed here from the attention mask, so
  the pad id the batch uses does not matter); a one-row token type table.
- distilbert: BERT's layers under other names (q_lin, sa_layer_norm, ffn.lin1, ...); no token
  types.
- mpnet: RoBERTa's positions, no token types, and a relative position bias added to every
  layer's attention scores: T5-style buckets (32, max distance 128, as HF MPNetEncoder) of
  key - query, precomputed here as one [2 * max_pos - 1, heads] table indexed by the distance.

The node layout deliberately mirrors what `torch.onnx.export` produces for HF BertModel
(Reshape to [0, 0, heads, head_size], Transpose, MatMul, Div by sqrt(head_size), additive mask
built as (1 - mask) * -10000, Erf GELU, ...). That is the layout ONNX Runtime's transformer
optimizer pattern-matches, so `optimize=True` can fuse it into Attention,
SkipLayerNormalization, BiasGelu and EmbedLayerNormalization. The unfused graph uses only
standard opset-17 operators, which is what TensorRT needs.

Inputs `input_ids` and `attention_mask`: int64 [batch, seq], both dynamic.
Output `sentence_embedding`: float32 [batch, dim] (the pipeline's width), unit L2 norm where the
pipeline normalises (metadata "normalize": "l2", else "none").

Exports are cached under the user cache dir, keyed by the weights, the config and module files
(Dense weights included), the prompt tokens a pooling leaves out, the exporter version and the
optimize flag (plus the onnxruntime version for fused graphs, whose
contents depend on the optimizer), and written atomically.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from worker.core.model import FAMILIES, ModelError, ModelInfo, default_model_dir
from worker.core.st_pipeline import Dense
from worker.core.disk_cache import cache_dir, locked, write_atomic
from worker.core.errors import KeywordEmbedderError
from worker.core.fingerprint import file_sha256, hash_file_into

# Bump whenever the emitted graph changes: it is part of the cache key.
EXPORTER_VERSION = "2"
OPSET = 17  # LayerNormalization is a standard op from 17; ReduceL2 still takes axes as attribute
INPUT_NAMES = ("input_ids", "attention_mask")
OUTPUT_NAME = "sentence_embedding"
# The additive mask value HF BERT used when ORT's fusion patterns were written; exp(-10000) is 0
# in float32, so padded positions get exactly zero attention weight (padding invariance).
MASK_FILL = -10000.0
# A fused graph must match the plain graph within this on the self-check batch; float32
# reassociation stays around 1e-6, a broken fusion is off by far more.
FUSED_CHECK_TOL = 1e-4


class ExportError(KeywordEmbedderError, RuntimeError):
    """The model cannot be exported; the message names the model folder or file and the reason."""


# ---------------------------------------------------------------- families

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
assert set(_PREFIXES) == set(_LAYER_NAMES) == set(FAMILIES)

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


# ---------------------------------------------------------------- weights


def _load_weights(info: ModelInfo) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        raw = load_file(str(info.weights_path))
    except Exception as exc:  # safetensors raises SafetensorError / OSError variants
        raise ExportError(f"{info.weights_path}: cannot read safetensors weights ({exc})") from None
    weights: dict[str, np.ndarray] = {}
    prefix = f"{_PREFIXES[info.model_type]}."
    for key, value in raw.items():
        # XxxForYyy checkpoints prefix the encoder with "bert." ("roberta.", ...); old TF ports
        # call LayerNorm parameters gamma/beta.
        name = key.removeprefix(prefix).replace("LayerNorm.gamma", "LayerNorm.weight")
        name = name.replace("LayerNorm.beta", "LayerNorm.bias")
        weights[name] = value
    return weights


@dataclass
class _Weights:
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


# ---------------------------------------------------------------- graph builder


@dataclass
class _Graph:
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


def _i64(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _f32(value: float) -> np.ndarray:
    return np.asarray(value, dtype=np.float32)


def _linear(g: _Graph, w: _Weights, x: str, prefix: str, n_in: int, n_out: int) -> str:
    # HF Linear stores [out, in]; MatMul wants [in, out]. MatMul + Add (not Gemm) is what ORT's
    # fusions expect, and it works on [B, S, H] without reshaping to 2-D.
    weight = g.const(f"{prefix}.weight", w.get(f"{prefix}.weight", (n_out, n_in)).T.copy())
    bias = g.const(f"{prefix}.bias", w.get(f"{prefix}.bias", (n_out,)))
    return g.op("Add", [g.op("MatMul", [x, weight], f"{prefix}.matmul"), bias], f"{prefix}.add")


def _layer_norm(g: _Graph, w: _Weights, x: str, prefix: str, hidden: int, eps: float) -> str:
    scale = g.const(f"{prefix}.weight", w.get(f"{prefix}.weight", (hidden,)))
    bias = g.const(f"{prefix}.bias", w.get(f"{prefix}.bias", (hidden,)))
    return g.op("LayerNormalization", [x, scale, bias], f"{prefix}.ln", axis=-1, epsilon=eps)


def _embeddings(g: _Graph, w: _Weights, info: ModelInfo, input_ids: str, attention_mask: str) -> str:
    h = info.hidden_size
    word = g.const("word_embeddings", w.get("embeddings.word_embeddings.weight", (info.vocab_size, h)))
    pos_table = w.get("embeddings.position_embeddings.weight", (info.max_position_embeddings, h))
    pos = g.const("position_embeddings", pos_table)
    type_table = w.tensors.get("embeddings.token_type_embeddings.weight")
    if info.position_offset == 0:
        # Position ids: Slice of a [1, max_pos] constant up to seq_len, as HF exports BERT (the
        # layout ORT's EmbedLayerNormalization fusion recognises).
        end = g.op("Unsqueeze", [_seq_len(g, input_ids), g.const("axis0", _i64(0))], "seq_end")
        pos_ids = g.op("Slice", [g.const("position_ids", np.arange(info.max_position_embeddings, dtype=np.int64)[None]),
                                 g.const("zero", _i64(0)), end, g.const("axis1", _i64(1)), g.const("step", _i64(1))],
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
    return _layer_norm(g, w, summed, "embeddings.LayerNorm", h, info.layer_norm_eps)


def _seq_len(g: _Graph, input_ids: str) -> str:
    return g.op("Gather", [g.op("Shape", [input_ids]), g.const("one", np.asarray(1, dtype=np.int64))],
                "seq_len", axis=0)  # scalar index -> scalar


def _relative_bias(g: _Graph, w: _Weights, info: ModelInfo, input_ids: str) -> str:
    """MPNet: [1, heads, S, S] bias of bucket(key - query), the same for every layer and row."""
    table = w.get("encoder.relative_attention_bias.weight", (info.relative_attention_buckets, info.num_heads))
    if info.relative_attention_buckets < MPNET_BUCKETS:
        raise ExportError(f"{info.config_path}: relative_attention_num_buckets {info.relative_attention_buckets} "
                          f"is below the {MPNET_BUCKETS} buckets MPNet's position bias uses")
    span = info.max_position_embeddings
    distances = np.arange(-(span - 1), span, dtype=np.int64)
    by_distance = g.const("relative_bias_table", table[mpnet_buckets(distances)])  # [2 * span - 1, heads]
    steps = g.op("Range", [g.const("zero_scalar", np.asarray(0, dtype=np.int64)), _seq_len(g, input_ids),
                           g.const("one_scalar", np.asarray(1, dtype=np.int64))], "positions")
    relative = g.op("Sub", [g.op("Unsqueeze", [steps, g.const("axis0", _i64(0))], "key_pos"),
                            g.op("Unsqueeze", [steps, g.const("axis1", _i64(1))], "query_pos")], "relative")
    index = g.op("Add", [relative, g.const("distance_offset", np.asarray(span - 1, dtype=np.int64))], "distance")
    bias = g.op("Transpose", [g.op("Gather", [by_distance, index], "relative_bias_sqh")], "relative_bias_hsq",
                perm=[2, 0, 1])
    return g.op("Unsqueeze", [bias, g.const("axis0", _i64(0))], "relative_bias")


def _mask_bias(g: _Graph, attention_mask: str) -> str:
    # [B, S] -> [B, 1, 1, S] additive bias: 0 where attended, -10000 on padding.
    m = g.op("Unsqueeze", [attention_mask, g.const("axis1", _i64(1))], "mask_u1")
    m = g.op("Unsqueeze", [m, g.const("axis2", _i64(2))], "mask_u2")
    m = g.op("Cast", [m], "mask_f", to=TensorProto.FLOAT)
    inv = g.op("Sub", [g.const("one_f", _f32(1.0)), m], "mask_inv")
    return g.op("Mul", [inv, g.const("mask_fill", _f32(MASK_FILL))], "mask_bias")


def _encoder_layer(g: _Graph, w: _Weights, info: ModelInfo, x: str, mask_bias: str, i: int) -> str:
    h, heads, hs = info.hidden_size, info.num_heads, info.head_size
    names = _LAYER_NAMES[info.model_type]
    p = names.layer.format(i=i)
    split = g.const("split_heads", _i64(0, 0, heads, hs))

    def heads_of(name: str, perm: list[int]) -> str:
        proj = _linear(g, w, x, f"{p}.{name}", h, h)
        short = name.rsplit(".", 1)[-1]  # BERT's graph keeps the node names it always had
        return g.op("Transpose", [g.op("Reshape", [proj, split], f"{p}.{short}.reshape")], f"{p}.{short}.t", perm=perm)

    q = heads_of(names.query, [0, 2, 1, 3])        # [B, heads, S, hs]
    k = heads_of(names.key, [0, 2, 3, 1])          # [B, heads, hs, S]
    v = heads_of(names.value, [0, 2, 1, 3])        # [B, heads, S, hs]
    scores = g.op("Div", [g.op("MatMul", [q, k], f"{p}.qk"), g.const("sqrt_hs", _f32(math.sqrt(hs)))], f"{p}.scaled")
    probs = g.op("Softmax", [g.op("Add", [scores, mask_bias], f"{p}.masked")], f"{p}.probs", axis=-1)
    ctx = g.op("Transpose", [g.op("MatMul", [probs, v], f"{p}.ctx")], f"{p}.ctx.t", perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, g.const("merge_heads", _i64(0, 0, h))], f"{p}.ctx.merge")
    attn = _linear(g, w, ctx, f"{p}.{names.attn_out}", h, h)
    x = _layer_norm(g, w, g.op("Add", [attn, x], f"{p}.attn.residual"), f"{p}.{names.attn_norm}",
                    h, info.layer_norm_eps)
    inter = _linear(g, w, x, f"{p}.{names.ffn_in}", h, info.intermediate_size)
    # Exact GELU as torch's erf form: x * 0.5 * (1 + erf(x / sqrt(2))) (ORT fuses it to BiasGelu).
    erf = g.op("Erf", [g.op("Div", [inter, g.const("sqrt2", _f32(math.sqrt(2.0)))], f"{p}.gelu.div")], f"{p}.gelu.erf")
    gelu = g.op("Mul", [g.op("Mul", [inter, g.op("Add", [erf, g.const("one_f", _f32(1.0))], f"{p}.gelu.add")],
                             f"{p}.gelu.mul"), g.const("half", _f32(0.5))], f"{p}.gelu")
    out = _linear(g, w, gelu, f"{p}.{names.ffn_out}", info.intermediate_size, h)
    return _layer_norm(g, w, g.op("Add", [out, x], f"{p}.ffn.residual"), f"{p}.{names.ffn_norm}",
                       h, info.layer_norm_eps)


# Node-name prefixes of the float layers of the pooling and normalisation below (not the
# integer mask's Unsqueeze/Cast, nor the pool_index_* integer and boolean nodes): an FP16
# TensorRT build keeps these, and everything downstream of them (Dense layers included), in
# FP32 (engines.build_engine.keep_pooling_in_fp32), so keep them in step with the names below.
FP32_NODE_PREFIXES: tuple[str, ...] = ("masked_states", "pool_sum", "pool_count", "pooled", "norm_", OUTPUT_NAME)


def _head(g: _Graph, info: ModelInfo, dense_weights: list[tuple[np.ndarray, np.ndarray | None]],
          hidden_states: str, attention_mask: str) -> str:
    """sentence-transformers' modules after the encoder: Pooling, then Dense and Normalize in order."""
    pipeline = info.pipeline
    mask = attention_mask
    if pipeline.prompt_tokens_excluded:
        mask = _without_prompt(g, attention_mask, pipeline.prompt_tokens_excluded)
    x = _pool(g, pipeline.pooling.modes, hidden_states, mask, prompt_excluded=bool(pipeline.prompt_tokens_excluded))
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


def _without_prompt(g: _Graph, attention_mask: str, n: int) -> str:
    """The mask with its first n positions off: the prompt's tokens (include_prompt false), which
    lead every row (rows are right-padded), are attended to but not pooled."""
    positions = g.op("Range", [g.const("zero_scalar", np.asarray(0, dtype=np.int64)), _seq_len(g, attention_mask),
                               g.const("one_scalar", np.asarray(1, dtype=np.int64))], "pool_index_positions")
    after = g.op("GreaterOrEqual", [positions, g.const("prompt_tokens", np.asarray(n, dtype=np.int64))],
                 "pool_index_after_prompt")
    keep = g.op("Cast", [after], "pool_index_keep", to=TensorProto.INT64)
    return g.op("Mul", [attention_mask, keep], "pool_index_mask")  # [B, S] int64


def _pool(g: _Graph, modes: tuple[str, ...], hidden_states: str, mask: str, *, prompt_excluded: bool) -> str:
    """sentence-transformers' Pooling over the mask, the modes concatenated in their order.

    Each mode is written as sentence-transformers 6.x computes it (Pooling._forward_padded), for
    right-padded rows: mean and mean_sqrt_len_tokens divide the masked sum by the count (clamped
    at 1e-9) or its root; max takes the maximum over masked positions (-inf elsewhere);
    weightedmean weighs position p (from 1) by p; lasttoken takes the last masked position (zeros
    for a row with none); cls takes the first masked position, which is position 0 unless the
    prompt is left out (position 0 for a row with none masked).
    """
    parts: list[str] = []
    cache: dict[str, str] = {}
    single = len(modes) == 1

    def name(mode: str) -> str:
        return "pooled" if single else f"pooled_{mode}"

    def float_mask() -> str:  # [B, S, 1] float32
        if "m" not in cache:
            cache["m"] = g.op("Cast", [g.op("Unsqueeze", [mask, g.const("axis2", _i64(2))], "pool_mask_u")],
                              "pool_mask", to=TensorProto.FLOAT)
        return cache["m"]

    def masked_sum_and_count() -> tuple[str, str]:
        if "sum" not in cache:
            m = float_mask()
            cache["sum"] = g.op("ReduceSum", [g.op("Mul", [hidden_states, m], "masked_states"),
                                              g.const("axis1", _i64(1))], "pool_sum", keepdims=0)  # [B, H]
            count = g.op("ReduceSum", [m, g.const("axis1", _i64(1))], "pool_count", keepdims=0)  # [B, 1]
            cache["count"] = g.op("Max", [count, g.const("count_min", _f32(1e-9))], "pool_count_c")
        return cache["sum"], cache["count"]

    def positions() -> tuple[str, str]:  # ([1, S, 1] float32 1..S, [1, S, 1] bool: position 1)
        if "pos" not in cache:
            one = np.asarray(1, dtype=np.int64)
            end = g.op("Add", [_seq_len(g, mask), g.const("one_scalar", one)], "pool_index_end")
            steps = g.op("Range", [g.const("one_scalar", one), end, g.const("one_scalar", one)], "pool_index_range")
            steps = g.op("Unsqueeze", [steps, g.const("axes02", _i64(0, 2))], "pool_index_range_u")
            cache["pos"] = g.op("Cast", [steps], "pooled_positions", to=TensorProto.FLOAT)
            cache["first"] = g.op("Equal", [steps, g.const("one_scalar", np.asarray(1, dtype=np.int64))],
                                  "pool_index_first")
        return cache["pos"], cache["first"]

    def pick(score: str, select: str | None, mode: str) -> str:
        # The row's one position of highest score, as a one-hot [B, S, 1] weighting (exact: the
        # other positions add zeros); `select` zeroes it where that position must not count.
        best = g.op("ReduceMax", [score], "pooled_best", axes=[1], keepdims=1)
        onehot = g.op("Cast", [g.op("Equal", [score, best], "pool_index_pick")], "pooled_pick", to=TensorProto.FLOAT)
        if select is not None:
            onehot = g.op("Mul", [onehot, select], "pooled_pick_masked")
        return g.op("ReduceSum", [g.op("Mul", [hidden_states, onehot], "pooled_pick_states"),
                                  g.const("axis1", _i64(1))], name(mode), keepdims=0)

    for mode in modes:
        if mode == "mean":
            summed, count = masked_sum_and_count()
            # sentence-transformers clamps the count at 1e-9 (an all-padding row gives zeros, not NaN).
            parts.append(g.op("Div", [summed, count], name(mode)))
        elif mode == "mean_sqrt_len_tokens":
            summed, count = masked_sum_and_count()
            parts.append(g.op("Div", [summed, g.op("Sqrt", [count], "pool_count_sqrt")], name(mode)))
        elif mode == "cls" and not prompt_excluded:
            parts.append(g.op("Gather", [hidden_states, g.const("zero_scalar", np.asarray(0, dtype=np.int64))],
                              name(mode), axis=1))
        elif mode == "cls":
            # The first masked position: score S + 1 - p there, 0 on the others, and 0.5 at
            # position 1, so a row with nothing masked takes position 0 as argmax does.
            pos, first = positions()
            span = g.op("Add", [g.op("ReduceMax", [pos], "pooled_span", axes=[1], keepdims=1),
                                g.const("one_f", _f32(1.0))], "pooled_span_1")
            score = g.op("Mul", [float_mask(), g.op("Sub", [span, pos], "pooled_from_end")], "pooled_cls_score")
            first_f = g.op("Cast", [first], "pooled_first", to=TensorProto.FLOAT)
            bonus = g.op("Mul", [first_f, g.const("half", _f32(0.5))], "pooled_first_half")
            parts.append(pick(g.op("Add", [score, bonus], "pooled_cls_scored"), None, mode))
        elif mode == "lasttoken":
            pos, _ = positions()
            parts.append(pick(g.op("Mul", [float_mask(), pos], "pooled_last_score"), float_mask(), mode))
        elif mode == "max":
            keep = g.op("Cast", [float_mask()], "pool_index_keep_bool", to=TensorProto.BOOL)
            filled = g.op("Where", [keep, hidden_states, g.const("minus_inf", _f32(-np.inf))], "pooled_max_fill")
            parts.append(g.op("ReduceMax", [filled], name(mode), axes=[1], keepdims=0))
        elif mode == "weightedmean":
            pos, _ = positions()
            weights = g.op("Mul", [float_mask(), pos], "pooled_weights")  # [B, S, 1]
            total = g.op("ReduceSum", [g.op("Mul", [hidden_states, weights], "pooled_weighted_states"),
                                       g.const("axis1", _i64(1))], "pooled_weighted_sum", keepdims=0)
            count = g.op("ReduceSum", [weights, g.const("axis1", _i64(1))], "pooled_weight_total", keepdims=0)
            count = g.op("Max", [count, g.const("count_min", _f32(1e-9))], "pooled_weight_total_c")
            parts.append(g.op("Div", [total, count], name(mode)))
        else:
            raise ExportError(f"pooling mode {mode!r} is not supported")
    return parts[0] if single else g.op("Concat", parts, "pooled", axis=-1)


def _dense(g: _Graph, layer: Dense, weight: np.ndarray, bias: np.ndarray | None, x: str, i: int) -> str:
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
        erf = g.op("Erf", [g.op("Div", [y, g.const("sqrt2", _f32(math.sqrt(2.0)))], f"{p}.gelu.div")], f"{p}.gelu.erf")
        return g.op("Mul", [g.op("Mul", [y, g.op("Add", [erf, g.const("one_f", _f32(1.0))], f"{p}.gelu.add")],
                                 f"{p}.gelu.mul"), g.const("half", _f32(0.5))], f"{p}.gelu")
    if act == "identity":
        return y
    raise ExportError(f"{layer.config_path}: activation {act!r} is not supported")


def _normalise(g: _Graph, x: str, *, output: str | None) -> str:
    # torch.nn.functional.normalize: x / max(||x||, 1e-12).
    norm = g.op("ReduceL2", [x], "norm", axes=[1], keepdims=1)
    norm = g.op("Max", [norm, g.const("norm_min", _f32(1e-12))], "norm_c")
    return g.op("Div", [x, norm], "norm_div", output=output)


def _load_dense(info: ModelInfo) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """The (weight [out, in], bias [out] or None) of each Dense layer, float32."""
    from safetensors.numpy import load_file

    out = []
    for layer in info.pipeline.dense:
        try:
            raw = load_file(str(layer.weights_path))
        except Exception as exc:  # safetensors raises SafetensorError / OSError variants
            raise ExportError(f"{layer.weights_path}: cannot read safetensors weights ({exc})") from None
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


def build_model(model_dir: str | Path | ModelInfo | None = None) -> onnx.ModelProto:
    """The unfused ONNX graph of the model folder, with metadata_props (in memory, not cached)."""
    info = _model_info(model_dir)
    if info.model_type not in FAMILIES:  # ModelInfo refuses these already; a hand-made one may not
        raise ExportError(f"{info.config_path}: model_type {info.model_type!r} is not supported; supported "
                          f"encoder families: {', '.join(FAMILIES)}")
    w = _Weights(info, _load_weights(info))
    dense = _load_dense(info)
    g = _Graph()
    ids, mask = INPUT_NAMES
    x = _embeddings(g, w, info, ids, mask)
    bias = _mask_bias(g, mask)
    if info.relative_attention_buckets:
        # One [B, heads, S, S] bias (positions + padding) for every layer, as MPNet adds both.
        bias = g.op("Add", [_relative_bias(g, w, info, ids), bias], "attention_bias")
    for i in range(info.num_layers):
        x = _encoder_layer(g, w, info, x, bias, i)
    _head(g, info, dense, x, mask)
    graph = helper.make_graph(
        g.nodes, f"{info.name}-sentence-encoder",
        inputs=[helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in INPUT_NAMES],
        outputs=[helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", info.dim])],
        initializer=g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="keyword-embedder", producer_version=EXPORTER_VERSION)
    # ir_version 8 keeps the file loadable by older runtimes (TensorRT's parser included).
    model.ir_version = 8
    _set_metadata(model, info, optimize=False)
    try:
        onnx.checker.check_model(model, full_check=False)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"{info.model_dir}: exported graph is invalid ({exc})") from None
    return model


# ---------------------------------------------------------------- metadata, hashing, cache


def _model_info(model_dir: str | Path | ModelInfo | None) -> ModelInfo:
    if isinstance(model_dir, ModelInfo):
        return model_dir  # already read: a start reads the model folder once
    try:
        return ModelInfo.from_dir(default_model_dir() if model_dir is None else model_dir)
    except ModelError as exc:
        raise ExportError(str(exc)) from exc


def weights_hash(info: ModelInfo) -> str:
    # The one file hash (worker/core/fingerprint.py): the fingerprint, this cache key and the
    # metadata share it, so a start hashes the weights once.
    return file_sha256(info.weights_path)


def cache_key(info: ModelInfo, *, optimize: bool) -> str:
    """Hash of everything the exported file depends on."""
    digest = hashlib.sha256()
    digest.update(f"exporter={EXPORTER_VERSION};opset={OPSET};optimize={optimize};".encode())
    if optimize:
        # The fused graph is written by onnxruntime's optimizer: a new version may fuse differently.
        import onnxruntime

        digest.update(f"onnxruntime={onnxruntime.__version__};".encode())
    digest.update(weights_hash(info).encode())
    for extra in (info.config_path, info.model_dir / "sentence_bert_config.json",
                  info.model_dir / "1_Pooling" / "config.json", info.model_dir / "tokenizer_config.json",
                  *info.pipeline.files()):
        digest.update(extra.name.encode())
        if extra.is_file():
            hash_file_into(extra, digest)
    # What the folder alone does not say: the prompt tokens a pooling leaves out (a setting).
    digest.update(f"prompt_tokens_excluded={info.pipeline.prompt_tokens_excluded};".encode())
    return digest.hexdigest()


def _set_metadata(model: onnx.ModelProto, info: ModelInfo, *, optimize: bool) -> None:
    props = {
        "model_name": info.name,
        "dim": str(info.dim),
        "max_seq_length": str(info.max_seq_length),
        "pooling": info.pooling_mode,
        "normalize": "l2" if info.normalized else "none",
        "pipeline": info.pipeline.describe(),
        "exporter_version": EXPORTER_VERSION,
        "weights_sha256": weights_hash(info),
        "optimized": str(optimize).lower(),
    }
    del model.metadata_props[:]
    for key, value in props.items():
        model.metadata_props.add(key=key, value=value)


def default_cache_dir() -> Path:
    return cache_dir("onnx")


# ---------------------------------------------------------------- optimisation


def _fuse(model: onnx.ModelProto, info: ModelInfo) -> onnx.ModelProto:
    """ORT's transformer optimizer (offline, opt_level 0: pattern fusions only, no session)."""
    import logging

    from onnxruntime.transformers.optimizer import optimize_model

    if info.relative_attention_buckets:
        raise ExportError(f"{info.model_dir}: no offline-fused graph for model_type {info.model_type!r} (ONNX "
                          "Runtime's attention fusion has no relative position bias); use the plain graph, "
                          "the default, which ONNX Runtime optimises at load")
    # The optimizer logs each fusion at INFO/WARNING; the counts are checked below instead.
    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    try:
        optimized = optimize_model(model, model_type="bert", num_heads=info.num_heads,
                                   hidden_size=info.hidden_size, opt_level=0)
    except Exception as exc:  # the optimizer raises whatever its passes raise
        raise ExportError(f"{info.model_dir}: onnxruntime transformer optimizer failed ({exc})") from exc
    fused = optimized.model
    counts = _op_counts(fused)
    if counts.get("Attention", 0) != info.num_layers:
        raise ExportError(f"{info.model_dir}: attention fusion applied to {counts.get('Attention', 0)} "
                          f"of {info.num_layers} layers; the graph layout no longer matches ORT's patterns")
    _set_metadata(fused, info, optimize=True)
    return fused


def _op_counts(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _check_fused(plain: onnx.ModelProto, fused: onnx.ModelProto, info: ModelInfo) -> None:
    """Runs both graphs on a small padded batch; a fusion that changed the maths is an error."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    lengths = [3, 7, 12]
    ids = np.zeros((len(lengths), max(lengths)), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(1, info.vocab_size, n)
        mask[row, :n] = 1
    outs = []
    for model in (plain, fused):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        outs.append(sess.run([OUTPUT_NAME], {"input_ids": ids, "attention_mask": mask})[0])
    diff = float(np.abs(outs[0] - outs[1]).max())
    if not diff <= FUSED_CHECK_TOL:
        raise ExportError(f"{info.model_dir}: fused graph differs from the plain graph by {diff:.3g} "
                          f"(> {FUSED_CHECK_TOL}); not using it")


# ---------------------------------------------------------------- public API


def export_onnx(model_dir: str | Path | ModelInfo | None, output: str | Path, *, optimize: bool = True) -> Path:
    """Export the model folder to `output` (atomically) and return the path."""
    info = _model_info(model_dir)
    model = build_model(info)
    if optimize:
        fused = _fuse(model, info)
        _check_fused(model, fused, info)
        model = fused
    if model.ByteSize() >= 2**31:
        # One protobuf cannot exceed 2 GiB; external-data export is not implemented (BERT-large is 1.3 GB).
        raise ExportError(f"{info.model_dir}: the graph is {model.ByteSize() / 2**30:.1f} GiB, over the 2 GiB "
                          "protobuf limit (external-data export is not supported)")
    output = Path(output).expanduser()
    try:
        write_atomic(output, lambda tmp: onnx.save_model(model, str(tmp)))
    except OSError as exc:
        raise ExportError(f"{output}: cannot write the ONNX file ({exc.strerror or exc})") from None
    return output


def cached_path(model_dir: str | Path | ModelInfo | None = None, *, optimize: bool = True,
                cache_dir: str | Path | None = None) -> Path:
    """Where ensure_onnx keeps (or would keep) the export of this model folder."""
    info = _model_info(model_dir)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    variant = "fused" if optimize else "plain"
    safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in info.name)
    return root / f"{safe_name}-{variant}-{cache_key(info, optimize=optimize)[:20]}.onnx"


def ensure_onnx(model_dir: str | Path | ModelInfo | None = None, *, optimize: bool = False,
                cache_dir: str | Path | None = None) -> Path:
    """The cached ONNX export of the model folder, exported first if missing or stale.

    optimize=False (the default) is the plain graph that ONNX Runtime optimises at load and
    TensorRT parses; the offline-fused variant measured slower on our CPUs
    (benchmarks/results/ort_grid.md).
    """
    path = cached_path(model_dir, optimize=optimize, cache_dir=cache_dir)
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"{path.parent}: cannot create the ONNX cache dir ({exc.strerror or exc})") from None
    # Two workers starting together: the second waits, then finds the first one's export.
    with locked(path.parent / f".{path.name}.lock"):
        if not path.is_file():  # another process may have finished it while we waited
            export_onnx(_model_info(model_dir), path, optimize=optimize)
    return path
