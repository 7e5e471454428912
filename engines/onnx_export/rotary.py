"""The rotary-position encoders: qwen3 (Qwen3Model), gemma3_text (Gemma3TextModel, EmbeddingGemma)
and modernbert (ModernBertModel) -> hidden states [B, S, hidden], as transformers computes them.

One layer function serves the three through `_FamilyLayout` (where each keeps its tensors, which
norm, which feed-forward); the settings come from worker.core.rotary_config.RotaryConfig:

- qwen3: pre-RMSNorm layers (w * x / rms), per-head q/k RMSNorm, rotary positions, grouped-query
  attention, causal mask, SwiGLU (down(silu(gate) * up)), a final RMSNorm.
- gemma3_text: embeddings times sqrt(hidden) (a float32 constant, as transformers casts it to the
  weights' dtype), RMSNorm with (1 + w), norms before and after attention and the feed-forward,
  q/k norms, scores scaled by query_pre_attn_scalar ** -0.5, GeGLU with tanh GELU, sliding and
  full layers (layer_types) each with its own rotary base, bidirectional.
- modernbert: LayerNorm (bias optional) on the embeddings and before attention (not in layer 0)
  and the feed-forward, fused Wqkv, GeGLU from Wi's two halves (exact GELU on the first),
  global and local layers each with its own rotary base, a final LayerNorm.

Positions are 0..S-1 for every row: the worker pads on the right (worker/batching/padding.py),
so a row's real tokens sit where they sit unpadded, and transformers numbers them the same way
(position_ids default to arange). Padding is masked everywhere: keys outside a row's mask get
-10000 (exp gives exactly 0 in float32), so a text's vector does not depend on its batch.
A sliding layer's query sees keys at |q - k| <= window_radius (gemma3's bidirectional window
(w // 2) + 1 exclusive, modernbert's local_attention // 2 each side); qwen3's causal layers see
k <= q.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from engines.onnx_export.graph import ExportError, Graph, Weights, f32, gelu, i64, read_safetensors, seq_len
from engines.onnx_export.pooling import row_pick
from worker.core.model import ModelInfo
from worker.core.rotary_config import FULL, RotaryConfig

MASK_FILL = -10000.0  # as encoder.py: exp(-10000) is 0 in float32, and fp16 can hold it
# In the name of every float node an fp16 graph keeps in float32 (engines/fp16_onnx.py): each
# RMSNorm's (x^2 overflows fp16 from |x| > 256; transformers upcasts it) and the rotary tables'
# (positions above 2048 are not integers in fp16, and transformers computes cos/sin in float32).
KEEP_FP32_MARK = ".keep32_"


@dataclass(frozen=True)
class _FamilyLayout:
    embed: str
    layer: str
    final_norm: str
    norm: str                # "rms" (x * w), "rms1p" (x * (1 + w)), "layer" (LayerNorm)
    post_norms: bool         # gemma3: post_attention / pre_feedforward / post_feedforward norms
    prefixes: tuple[str, ...]  # checkpoint prefixes to strip (XxxForYyy checkpoints)


_LAYOUTS = {
    "qwen3": _FamilyLayout("embed_tokens.weight", "layers.{i}", "norm", "rms", False, ("model.",)),
    "gemma3_text": _FamilyLayout("embed_tokens.weight", "layers.{i}", "norm", "rms1p", True,
                                 ("model.language_model.", "model.")),
    "modernbert": _FamilyLayout("embeddings.tok_embeddings.weight", "layers.{i}", "final_norm", "layer", False,
                                ("model.",)),
}


@dataclass(frozen=True)
class _Pick:
    """The one row per text the last layer computes (single-row poolings): the [B, 1, S] one-hot
    and, picked by it, each layer type's rotary tables and mask bias at that row's position.
    A MatMul by a one-hot adds zeros to the one value it takes, so the picked values are exact."""

    g: Graph
    rows3: str  # [B, 1, S] (cls: [1, 1, S])
    rows4: str  # [B, 1, 1, S]
    cos: dict[str, str]
    sin: dict[str, str]
    bias: dict[str, str]

    @staticmethod
    def make(g: Graph, picked: str, ropes: dict[str, tuple[str, str]], biases: dict[str, str]) -> _Pick:
        rows4 = g.op("Unsqueeze", [picked, g.const("axis1", i64(1))], "row_pick4")
        m = KEEP_FP32_MARK
        cos = {c: g.op("MatMul", [rows4, c], f"{m}rope_cos_picked") for c, _ in ropes.values()}
        sin = {s: g.op("MatMul", [rows4, s], f"{m}rope_sin_picked") for _, s in ropes.values()}
        # A bias is [B, 1, S, S], or [B, 1, 1, S] where every query sees the same keys: its
        # picked row is the sum over queries weighted by the one-hot, for either shape.
        column = g.op("Transpose", [rows4], "row_pick_column", perm=[0, 1, 3, 2])  # [B, 1, S, 1]
        bias = {b: g.op("ReduceSum", [g.op("Mul", [b, column], "mask_bias_pick"), g.const("axis2", i64(2))],
                        "mask_bias_picked", keepdims=1) for b in biases.values()}
        return _Pick(g, picked, rows4, cos, sin, bias)

    def rows(self, x: str, hint: str) -> str:
        """[B, S, n] -> the picked row, [B, 1, n]."""
        return self.g.op("MatMul", [self.rows3, x], f"{hint}.picked")


def load_rotary_weights(info: ModelInfo) -> Weights:
    raw = read_safetensors(info.weights_path)
    layout = _LAYOUTS[info.model_type]
    weights: dict[str, np.ndarray] = {}
    for key, value in raw.items():
        for prefix in layout.prefixes:
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        weights[key] = value
    return Weights(info, weights)


def _rotary(info: ModelInfo) -> RotaryConfig:
    if info.rotary is None:
        raise ExportError(f"{info.config_path}: model_type {info.model_type!r} has no rotary settings")
    return info.rotary


class _Builder:
    def __init__(self, g: Graph, w: Weights, info: ModelInfo) -> None:
        self.g, self.w, self.info, self.rc = g, w, info, _rotary(info)
        self.layout = _LAYOUTS[info.model_type]

    # ------------------------------------------------------------ small ops

    def linear(self, x: str, name: str, n_in: int, n_out: int, *, bias: bool) -> str:
        g = self.g
        weight = g.const(f"{name}.weight", self.w.get(f"{name}.weight", (n_out, n_in)).T.copy())
        y = g.op("MatMul", [x, weight], f"{name}.matmul")
        if bias:
            y = g.op("Add", [y, g.const(f"{name}.bias", self.w.get(f"{name}.bias", (n_out,)))], f"{name}.add")
        return y

    def norm(self, x: str, name: str, size: int) -> str:
        g, rc, kind = self.g, self.rc, self.layout.norm
        if kind == "layer":
            scale = g.const(f"{name}.weight", self.w.get(f"{name}.weight", (size,)))
            bias = (self.w.get(f"{name}.bias", (size,)) if self.rc.norm_bias else np.zeros(size, dtype=np.float32))
            return g.op("LayerNormalization", [x, scale, g.const(f"{name}.bias", bias)], f"{name}.ln",
                        axis=-1, epsilon=rc.eps)
        weight = self.w.get(f"{name}.weight", (size,))
        if kind == "rms1p":
            weight = (np.float32(1.0) + weight).astype(np.float32)  # Gemma: output * (1 + weight), in float32
        # x / sqrt(mean(x^2) + eps) * w: the Pow/ReduceMean/Add/Sqrt/Div/Mul layout ORT fuses.
        m = f"{KEEP_FP32_MARK}rms_"
        ms = g.op("ReduceMean", [g.op("Pow", [x, g.const("two_f", f32(2.0))], f"{name}{m}pow")], f"{name}{m}mean",
                  axes=[-1], keepdims=1)
        rms = g.op("Sqrt", [g.op("Add", [ms, g.const(f"{name}.eps", f32(rc.eps))], f"{name}{m}add_eps")],
                   f"{name}{m}rms")
        return g.op("Mul", [g.op("Div", [x, rms], f"{name}{m}div"), g.const(f"{name}.weight", weight)],
                    f"{name}{m}scale")

    # ------------------------------------------------------------ positions and masks

    def rope_tables(self, ids: str) -> dict[str, tuple[str, str]]:
        """cos and sin [1, 1, S, head_dim] per layer type: freqs = pos * inv_freq, duplicated."""
        g, rc = self.g, self.rc
        hd = rc.head_dim
        m = KEEP_FP32_MARK
        pos = g.op("Cast", [g.op("Range", [g.const("zero_scalar", np.asarray(0, dtype=np.int64)), seq_len(g, ids),
                                           g.const("one_scalar", np.asarray(1, dtype=np.int64))], "rope_pos_i")],
                   f"{m}rope_pos", to=TensorProto.FLOAT)
        pos = g.op("Unsqueeze", [pos, g.const("axis1", i64(1))], f"{m}rope_pos_col")  # [S, 1]
        tables = {}
        for layer_type in sorted(set(rc.layer_types)):
            rope = rc.rope_for(layer_type)
            # As transformers: float32 exponents, base ** exponent, then 1 / (...) in float32.
            exponents = np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / np.float32(hd)
            inv_freq = (np.float32(1.0) / np.power(np.float32(rope.theta), exponents, dtype=np.float32))
            inv_freq = (inv_freq / np.float32(rope.linear_factor)).astype(np.float32)
            freqs = g.op("Mul", [pos, g.const(f"rope_inv_freq_{layer_type}", inv_freq[None, :])],
                         f"{m}rope_freqs_{layer_type}")
            emb = g.op("Concat", [freqs, freqs], f"{m}rope_emb_{layer_type}", axis=-1)
            emb = g.op("Unsqueeze", [emb, g.const("axes01", i64(0, 1))], f"{m}rope_emb4_{layer_type}")
            tables[layer_type] = (g.op("Cos", [emb], f"{m}rope_cos_{layer_type}"),
                                  g.op("Sin", [emb], f"{m}rope_sin_{layer_type}"))
        return tables

    def mask_biases(self, ids: str, mask: str) -> dict[str, str]:
        """The additive [B, 1, S, S] bias per layer type: 0 where attended, -10000 elsewhere."""
        g, rc = self.g, self.rc
        steps = g.op("Range", [g.const("zero_scalar", np.asarray(0, dtype=np.int64)), seq_len(g, ids),
                               g.const("one_scalar", np.asarray(1, dtype=np.int64))], "mask_positions")
        q = g.op("Unsqueeze", [steps, g.const("axis1", i64(1))], "mask_q")   # [S, 1]
        k = g.op("Unsqueeze", [steps, g.const("axis0", i64(0))], "mask_k")   # [1, S]
        diff = g.op("Sub", [q, k], "mask_q_minus_k")
        keys = g.op("Cast", [g.op("Unsqueeze", [mask, g.const("axes12", i64(1, 2))], "mask_keys_i")],
                    "mask_keys", to=TensorProto.BOOL)  # [B, 1, 1, S]
        base = keys
        if rc.causal:
            zero = g.const("zero_scalar", np.asarray(0, dtype=np.int64))
            causal = g.op("GreaterOrEqual", [diff, zero], "mask_causal")
            base = g.op("And", [keys, causal], "mask_causal_keys")
        out = {}
        for layer_type in sorted(set(rc.layer_types)):
            allowed = base
            if layer_type != FULL:
                near = g.op("LessOrEqual", [g.op("Abs", [diff], "mask_distance"),
                                            g.const("window_radius", np.asarray(rc.window_radius, dtype=np.int64))],
                            "mask_window")
                allowed = g.op("And", [base, near], "mask_window_keys")
            off = g.op("Not", [allowed], f"mask_off_{layer_type}")
            out[layer_type] = g.op("Mul", [g.op("Cast", [off], f"mask_off_f_{layer_type}", to=TensorProto.FLOAT),
                                           g.const("mask_fill", f32(MASK_FILL))], f"mask_bias_{layer_type}")
        return out

    def rotate(self, x: str, cos: str, sin: str, name: str) -> str:
        """x * cos + rotate_half(x) * sin, rotate_half(x) = concat(-x2, x1) (transformers' convention)."""
        g, half = self.g, self.rc.head_dim // 2
        x1 = g.op("Slice", [x, g.const("zero", i64(0)), g.const("half", i64(half)), g.const("axis_last", i64(-1))],
                  f"{name}.x1")
        x2 = g.op("Slice", [x, g.const("half", i64(half)), g.const("dim", i64(self.rc.head_dim)),
                            g.const("axis_last", i64(-1))], f"{name}.x2")
        rotated = g.op("Concat", [g.op("Neg", [x2], f"{name}.neg"), x1], f"{name}.rot_half", axis=-1)
        return g.op("Add", [g.op("Mul", [x, cos], f"{name}.cos"), g.op("Mul", [rotated, sin], f"{name}.sin")],
                    f"{name}.rope")

    # ------------------------------------------------------------ layers

    def attention(self, x: str, p: str, cos: str, sin: str, bias: str, pick: _Pick | None = None) -> str:
        """Self-attention of x's rows; with `pick`, for the picked row's query only (keys and
        values from every row), so the output is [B, 1, hidden]."""
        g, rc, info = self.g, self.rc, self.info
        h, heads, kv, hd = info.hidden_size, info.num_heads, rc.kv_heads, rc.head_dim
        if info.model_type == "modernbert":
            qkv = self.linear(x, f"{p}.attn.Wqkv", h, 3 * h, bias=rc.attention_bias)
            qkv = g.op("Reshape", [qkv, g.const("split_qkv", i64(0, 0, 3, heads, hd))], f"{p}.qkv.reshape")
            parts = [g.op("Gather", [qkv, g.const(f"index_{j}", np.asarray(j, dtype=np.int64))], f"{p}.{n}", axis=2)
                     for j, n in enumerate("qkv")]
            q, k, v = (g.op("Transpose", [t], f"{t}.t", perm=[0, 2, 1, 3]) for t in parts)
            if pick is not None:  # Wqkv is one product: its query rows are picked after it
                q = g.op("MatMul", [pick.rows4, q], f"{p}.q.picked")
            out_name = f"{p}.attn.Wo"
        else:
            def heads_of(name: str, n: int, norm: str | None) -> str:
                src = pick.rows(x, f"{p}.q_in") if pick is not None and name == "q_proj" else x
                proj = self.linear(src, f"{p}.self_attn.{name}", h, n * hd, bias=rc.attention_bias)
                proj = g.op("Reshape", [proj, g.const(f"split_{n}_heads", i64(0, 0, n, hd))], f"{p}.{name}.reshape")
                if norm is not None:
                    proj = self.norm(proj, f"{p}.self_attn.{norm}", hd)
                return g.op("Transpose", [proj], f"{p}.{name}.t", perm=[0, 2, 1, 3])  # [B, n, S, hd]

            q, k = heads_of("q_proj", heads, "q_norm"), heads_of("k_proj", kv, "k_norm")
            v = heads_of("v_proj", kv, None)
            out_name = f"{p}.self_attn.o_proj"
        if pick is not None:
            q = self.rotate(q, pick.cos[cos], pick.sin[sin], f"{p}.q")
            bias = pick.bias[bias]
        else:
            q = self.rotate(q, cos, sin, f"{p}.q")
        k = self.rotate(k, cos, sin, f"{p}.k")
        if kv != heads:  # grouped-query attention: query head i reads key/value head i // (heads / kv)
            rep = heads // kv
            expand = g.const(f"repeat_kv_{rep}", i64(1, 1, rep, 1, 1))
            merge = g.const(f"merge_kv_{heads}", i64(0, heads, -1, hd))

            def repeat(t: str, n: str) -> str:
                t = g.op("Unsqueeze", [t, g.const("axis2", i64(2))], f"{p}.{n}.u")
                t = g.op("Expand", [t, expand], f"{p}.{n}.rep")
                return g.op("Reshape", [t, merge], f"{p}.{n}.grouped")
            k, v = repeat(k, "k"), repeat(v, "v")
        kt = g.op("Transpose", [k], f"{p}.k.tt", perm=[0, 1, 3, 2])
        scores = g.op("Mul", [g.op("MatMul", [q, kt], f"{p}.qk"), g.const(f"query_scale", f32(rc.query_scale))],
                      f"{p}.scaled")
        probs = g.op("Softmax", [g.op("Add", [scores, bias], f"{p}.masked")], f"{p}.probs", axis=-1)
        ctx = g.op("Transpose", [g.op("MatMul", [probs, v], f"{p}.ctx")], f"{p}.ctx.t", perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, g.const("merge_heads", i64(0, 0, heads * hd))], f"{p}.ctx.merge")
        return self.linear(ctx, out_name, heads * hd, h, bias=rc.attention_bias)

    def feed_forward(self, x: str, p: str) -> str:
        g, rc, info = self.g, self.rc, self.info
        h, inter = info.hidden_size, info.intermediate_size
        if info.model_type == "modernbert":
            # Wi holds [input; gate]: two MatMuls of its halves are the chunk(2) exactly.
            wi = self.w.get(f"{p}.mlp.Wi.weight", (2 * inter, h))
            up_in = g.op("MatMul", [x, g.const(f"{p}.mlp.Wi.input", wi[:inter].T.copy())], f"{p}.mlp.input")
            gate = g.op("MatMul", [x, g.const(f"{p}.mlp.Wi.gate", wi[inter:].T.copy())], f"{p}.mlp.gate")
            if rc.mlp_bias:
                bi = self.w.get(f"{p}.mlp.Wi.bias", (2 * inter,))
                up_in = g.op("Add", [up_in, g.const(f"{p}.mlp.Wi.input_bias", bi[:inter].copy())], f"{p}.mlp.input_b")
                gate = g.op("Add", [gate, g.const(f"{p}.mlp.Wi.gate_bias", bi[inter:].copy())], f"{p}.mlp.gate_b")
            act = g.op("Mul", [gelu(g, up_in, f"{p}.mlp"), gate], f"{p}.mlp.glu")
            return self.linear(act, f"{p}.mlp.Wo", inter, h, bias=rc.mlp_bias)
        gate = self.linear(x, f"{p}.mlp.gate_proj", h, inter, bias=False)
        up = self.linear(x, f"{p}.mlp.up_proj", h, inter, bias=False)
        if rc.activation == "silu":
            act = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.mlp.sigmoid")], f"{p}.mlp.silu")
        else:
            act = _gelu_tanh(g, gate, f"{p}.mlp")
        return self.linear(g.op("Mul", [act, up], f"{p}.mlp.glu"), f"{p}.mlp.down_proj", inter, h, bias=False)

    def layer(self, x: str, i: int, ropes: dict[str, tuple[str, str]], biases: dict[str, str],
              pick: _Pick | None = None) -> str:
        """Layer i over every row of x, or (with `pick`) only the picked row's output [B, 1, hidden]."""
        g, h = self.g, self.info.hidden_size
        p = self.layout.layer.format(i=i)
        layer_type = self.rc.layer_types[i]
        cos, sin = ropes[layer_type]
        if self.info.model_type == "modernbert":
            normed = x if i == 0 else self.norm(x, f"{p}.attn_norm", h)  # layer 0's attn_norm is Identity
            attn = self.attention(normed, p, cos, sin, biases[layer_type], pick)
            x = pick.rows(x, f"{p}.residual_in") if pick is not None else x
            x = g.op("Add", [x, attn], f"{p}.attn.residual")
            mlp = self.feed_forward(self.norm(x, f"{p}.mlp_norm", h), p)
            return g.op("Add", [x, mlp], f"{p}.mlp.residual")
        attn = self.attention(self.norm(x, f"{p}.input_layernorm", h), p, cos, sin, biases[layer_type], pick)
        x = pick.rows(x, f"{p}.residual_in") if pick is not None else x
        if self.layout.post_norms:
            attn = self.norm(attn, f"{p}.post_attention_layernorm", h)
            x = g.op("Add", [x, attn], f"{p}.attn.residual")
            mlp = self.feed_forward(self.norm(x, f"{p}.pre_feedforward_layernorm", h), p)
            mlp = self.norm(mlp, f"{p}.post_feedforward_layernorm", h)
        else:
            x = g.op("Add", [x, attn], f"{p}.attn.residual")
            mlp = self.feed_forward(self.norm(x, f"{p}.post_attention_layernorm", h), p)
        return g.op("Add", [x, mlp], f"{p}.mlp.residual")


def _gelu_tanh(g: Graph, x: str, prefix: str) -> str:
    """torch's gelu(approximate='tanh'): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    cube = g.op("Mul", [g.op("Mul", [x, x], f"{prefix}.gelu_sq"), x], f"{prefix}.gelu_cube")
    inner = g.op("Add", [x, g.op("Mul", [cube, g.const("gelu_c", f32(0.044715))], f"{prefix}.gelu_c3")],
                 f"{prefix}.gelu_inner")
    t = g.op("Tanh", [g.op("Mul", [inner, g.const("gelu_k", f32(math.sqrt(2.0 / math.pi)))], f"{prefix}.gelu_k")],
             f"{prefix}.gelu_tanh")
    half = g.op("Mul", [x, g.const("half", f32(0.5))], f"{prefix}.gelu_half")
    return g.op("Mul", [half, g.op("Add", [t, g.const("one_f", f32(1.0))], f"{prefix}.gelu_1p")], f"{prefix}.gelu")


def single_row_pooling(info: ModelInfo) -> str | None:
    """The pooling mode when the pipeline pools one row of the last layer (cls, lasttoken), else None."""
    modes = info.pipeline.pooling.modes
    if modes == ("lasttoken",) or (modes == ("cls",) and not info.pipeline.prompt_tokens_excluded):
        return modes[0]
    return None


def encode_rotary(g: Graph, w: Weights, info: ModelInfo, input_ids: str, attention_mask: str,
                  pooling_mask: str | None = None) -> str:
    """The rotary family's last hidden states [B, S, hidden] for the graph inputs; or, with
    `pooling_mask` (the mask the pooling reads) where single_row_pooling(info) is a mode, the pooled
    [B, hidden] itself: the last layer then computes the pooled row alone (its query, attention
    output and feed-forward; keys and values from every row), which is all that reaches the
    pooling, and a row with no pooled position gives zeros as sentence-transformers does."""
    b = _Builder(g, w, info)
    h = info.hidden_size
    table = g.const("embed_tokens", w.get(b.layout.embed, (info.vocab_size, h)))
    x = g.op("Gather", [table, input_ids], "embeddings")
    if info.model_type == "gemma3_text":
        # Gemma3TextScaledWordEmbedding: sqrt(hidden) as a tensor cast to the weights' dtype (float32).
        x = g.op("Mul", [x, g.const("embed_scale", f32(np.float32(h ** 0.5)))], "embeddings_scaled")
    if info.model_type == "modernbert":
        x = b.norm(x, "embeddings.norm", h)
    ropes = b.rope_tables(input_ids)
    biases = b.mask_biases(input_ids, attention_mask)
    mode = single_row_pooling(info) if pooling_mask is not None else None
    last = info.num_layers - 1
    for i in range(last):
        x = b.layer(x, i, ropes, biases)
    if mode is None:
        return b.norm(b.layer(x, last, ropes, biases), b.layout.final_norm, h)
    assert pooling_mask is not None
    picked = row_pick(g, mode, pooling_mask)
    pick = _Pick.make(g, picked, ropes, biases)
    x = b.norm(b.layer(x, last, ropes, biases, pick), b.layout.final_norm, h)  # [B, 1, hidden]
    x = g.op("Squeeze", [x, g.const("axis1", i64(1))], "pooled_row")
    if mode == "cls":
        return x
    # A row with no position to pool ran its zero row through the layer: sentence-transformers gives zeros.
    found = g.op("ReduceMax", [picked], "pooled_row_found", axes=[2], keepdims=0)  # [B, 1]
    return g.op("Mul", [x, found], "pooled")
