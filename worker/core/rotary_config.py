"""config.json of the rotary-position families (qwen3, gemma3_text, modernbert), read into one
`RotaryConfig` that the exporter (engines/onnx_export/rotary.py) builds from.

These families keep their settings under names that differ by family and by transformers
version: transformers 5 moved `rope_theta` (and gemma3's `rope_local_base_freq`, modernbert's
`global_rope_theta`/`local_rope_theta`) into `rope_parameters`, one entry per layer type for
gemma3 and modernbert. Both spellings are read. Whatever the exporter does not build is refused
here by name (rope scaling types, a causal EmbeddingGemma, attention logit soft-capping, ...),
so a model either runs as transformers runs it or does not start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.core.errors import ModelError

ROTARY_FAMILIES: tuple[str, ...] = ("qwen3", "gemma3_text", "modernbert")
FULL, SLIDING = "full_attention", "sliding_attention"

# The activation each family's feed-forward uses, as transformers names it.
_ACTIVATIONS = {"qwen3": ("silu", "swish"), "gemma3_text": ("gelu_pytorch_tanh",), "modernbert": ("gelu",)}


@dataclass(frozen=True)
class Rope:
    """One rotary table: inv_freq = 1 / (theta ** (2i / head_dim)) / factor ("linear" scaling)."""

    theta: float
    linear_factor: float = 1.0


@dataclass(frozen=True)
class RotaryConfig:
    kv_heads: int
    head_dim: int
    eps: float
    # One entry per layer: FULL or SLIDING.
    layer_types: tuple[str, ...]
    rope: tuple[tuple[str, Rope], ...]   # layer type -> its rotary table
    # A sliding layer's query attends to keys at |q - k| <= window_radius (0: no sliding layer).
    window_radius: int
    causal: bool
    # Attention scores are q.k * query_scale (head_dim ** -0.5, gemma3: query_pre_attn_scalar ** -0.5).
    query_scale: float
    activation: str
    # modernbert: LayerNorm bias, attention (Wqkv/Wo) bias, feed-forward bias; qwen3: attention bias.
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Gemma 3's activations overflow float16 (transformers runs it in float32 or bfloat16 only):
    # no fp16 graph or plan is made of it.
    fp16_overflows: bool = False

    def rope_for(self, layer_type: str) -> Rope:
        return dict(self.rope)[layer_type]

    def describe(self, heads: int) -> str:
        """One line for `models --model`: the attention as the graph builds it."""
        sliding = [i for i, t in enumerate(self.layer_types) if t == SLIDING]
        window = (f"; sliding layers {', '.join(map(str, sliding))}: keys at |q - k| <= {self.window_radius}"
                  if sliding else "")
        bases = ", ".join(f"{t.split('_')[0]} {r.theta:g}" for t, r in self.rope)
        return (f"{'causal' if self.causal else 'bidirectional'}, {heads} query / {self.kv_heads} key-value heads "
                f"of {self.head_dim}{window}; rotary base {bases}"
                + ("; fp16 refused (overflows)" if self.fp16_overflows else ""))


def read_rotary_config(model_type: str, cfg: dict[str, Any], path: Path, *, hidden: int, heads: int,
                       layers: int) -> RotaryConfig:
    """The rotary family's settings of config.json `cfg` (model_type one of ROTARY_FAMILIES)."""
    reader = _Reader(cfg, path)
    act_key = "hidden_act" if model_type == "qwen3" else "hidden_activation"
    act = cfg.get(act_key, _ACTIVATIONS[model_type][0])
    if model_type == "gemma3_text" and act_key not in cfg and "hidden_act" in cfg:
        act = cfg["hidden_act"]
    if act not in _ACTIVATIONS[model_type]:
        raise ModelError(f"{path}: {act_key} {act!r} is not supported for {model_type} "
                         f"(only {', '.join(map(repr, _ACTIVATIONS[model_type]))})")
    act = "silu" if act == "swish" else act
    if model_type == "modernbert":
        return _modernbert(reader, hidden=hidden, heads=heads, layers=layers, act=act)
    head_dim = reader.positive_int("head_dim", hidden // heads if hidden % heads == 0 else None)
    kv_heads = reader.positive_int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ModelError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    eps = reader.number("rms_norm_eps", 1e-6)
    if model_type == "qwen3":
        types = reader.layer_types(layers, default=(FULL,) * layers)
        if cfg.get("use_sliding_window") or SLIDING in types:
            raise ModelError(f"{path}: qwen3 with sliding-window layers (use_sliding_window) is not supported")
        rope = reader.rope_single(default_theta=10_000.0)
        return RotaryConfig(kv_heads, head_dim, eps, types, ((FULL, rope),), 0, causal=True,
                            query_scale=head_dim ** -0.5, activation=act,
                            attention_bias=reader.flag("attention_bias", False))
    # gemma3_text: EmbeddingGemma, bidirectional.
    if not cfg.get("use_bidirectional_attention"):
        raise ModelError(f"{path}: gemma3_text without use_bidirectional_attention (a causal Gemma 3 language "
                         "model) is not supported; EmbeddingGemma sets it true")
    for key in ("attn_logit_softcapping",):
        if cfg.get(key) is not None:
            raise ModelError(f"{path}: gemma3_text with {key} is not supported")
    pattern = reader.positive_int("sliding_window_pattern", 6)
    types = reader.layer_types(layers, default=tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers)))
    # transformers halves the configured window for bidirectional attention, (w // 2) + 1 with
    # an exclusive bound: a key at |q - k| <= w // 2 is attended.
    window = reader.positive_int("sliding_window", 4096)
    rope = reader.rope_by_type({FULL: ("rope_theta", 1_000_000.0), SLIDING: ("rope_local_base_freq", 10_000.0)},
                               scaling_applies_to=FULL)
    scalar = reader.number("query_pre_attn_scalar", 256)
    return RotaryConfig(kv_heads, head_dim, eps, types, rope, window // 2, causal=False,
                        query_scale=scalar ** -0.5, activation=act,
                        attention_bias=reader.flag("attention_bias", False), fp16_overflows=True)


def _modernbert(reader: _Reader, *, hidden: int, heads: int, layers: int, act: str) -> RotaryConfig:
    path = reader.path
    if hidden % heads:
        raise ModelError(f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    if reader.cfg.get("rope_scaling"):
        # transformers applies it to both layer types; no scaled table is built here.
        raise ModelError(f"{path}: modernbert with rope_scaling {reader.cfg['rope_scaling']!r} is not supported")
    every = reader.positive_int("global_attn_every_n_layers", 3)
    types = reader.layer_types(layers, default=tuple(FULL if i % every == 0 else SLIDING for i in range(layers)))
    local = reader.positive_int("local_attention", 128)
    rope = reader.rope_by_type({FULL: ("global_rope_theta", 160_000.0), SLIDING: ("local_rope_theta", 10_000.0)},
                               scaling_applies_to=None)
    head_dim = hidden // heads
    return RotaryConfig(heads, head_dim, reader.number("norm_eps", 1e-5), types, rope, local // 2, causal=False,
                        query_scale=head_dim ** -0.5, activation=act, norm_bias=reader.flag("norm_bias", False),
                        attention_bias=reader.flag("attention_bias", False), mlp_bias=reader.flag("mlp_bias", False))


@dataclass(frozen=True)
class _Reader:
    cfg: dict[str, Any]
    path: Path

    def positive_int(self, key: str, default: int | None) -> int:
        value = self.cfg.get(key, default)
        if value is None:
            value = default
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelError(f"{self.path}: {key!r} must be a positive integer, got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.cfg.get(key, default)
        if value is None:
            value = default
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ModelError(f"{self.path}: {key!r} must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key, default)
        if not isinstance(value, bool):
            raise ModelError(f"{self.path}: {key!r} must be true or false, got {value!r}")
        return value

    def layer_types(self, layers: int, *, default: tuple[str, ...]) -> tuple[str, ...]:
        raw = self.cfg.get("layer_types")
        if raw is None:
            return default
        if (not isinstance(raw, list) or len(raw) != layers or not all(t in (FULL, SLIDING) for t in raw)):
            raise ModelError(f"{self.path}: layer_types must list {layers} entries, each {FULL!r} or {SLIDING!r}")
        return tuple(raw)

    def _rope(self, params: dict[str, Any], theta_default: float, where: str, *, scaling: bool) -> Rope:
        kind = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", theta_default)
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
            raise ModelError(f"{self.path}: {where} rope_theta must be a positive number, got {theta!r}")
        if kind == "default":
            return Rope(float(theta))
        if kind == "linear" and scaling:
            factor = params.get("factor")
            if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
                raise ModelError(f"{self.path}: {where} linear rope scaling needs a positive factor, got {factor!r}")
            return Rope(float(theta), float(factor))
        raise ModelError(f"{self.path}: {where} rope type {kind!r} is not supported (only 'default'"
                         f"{' and linear' if scaling else ''})")

    def rope_single(self, *, default_theta: float) -> Rope:
        """qwen3: one table, from rope_parameters (transformers 5) or rope_theta + rope_scaling."""
        params = self.cfg.get("rope_parameters")
        if params is None:
            params = dict(self.cfg.get("rope_scaling") or {})
            if "rope_theta" in self.cfg:
                params["rope_theta"] = self.cfg["rope_theta"]
        if not isinstance(params, dict):
            raise ModelError(f"{self.path}: rope_parameters must be an object, got {params!r}")
        return self._rope(params, default_theta, "rope_parameters", scaling=False)

    def rope_by_type(self, legacy: dict[str, tuple[str, float]], *,
                     scaling_applies_to: str | None) -> tuple[tuple[str, Rope], ...]:
        """gemma3/modernbert: a table per layer type, from rope_parameters[type] (transformers 5)
        or the older keys (`legacy`: type -> (key, default)); gemma3's rope_scaling applies to the
        full layers only, as transformers applies it."""
        params = self.cfg.get("rope_parameters")
        out = []
        for layer_type, (key, default) in legacy.items():
            if isinstance(params, dict) and layer_type in params:
                entry = params[layer_type]
                if not isinstance(entry, dict):
                    raise ModelError(f"{self.path}: rope_parameters[{layer_type!r}] must be an object")
                entry = dict(entry)
            elif isinstance(params, dict) and params and "rope_theta" in params and layer_type == FULL:
                entry = dict(params)  # a single (non per-type) table names the full layers' base
            else:
                entry = {"rope_theta": self.cfg.get(key, default)}
                if layer_type == scaling_applies_to and self.cfg.get("rope_scaling"):
                    entry.update(self.cfg["rope_scaling"])
            scaling = layer_type == scaling_applies_to
            out.append((layer_type, self._rope(entry, default, layer_type, scaling=scaling)))
        return tuple(out)
