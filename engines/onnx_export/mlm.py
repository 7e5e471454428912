"""The masked-language-model head of a sparse (SPLADE) model: the encoder's hidden states ->
transform (dense H->H, GELU, LayerNorm), then the decoder onto the vocabulary.

As transformers writes each family's `XxxForMaskedLM` (5.x):

- bert: `cls.predictions.transform.{dense, LayerNorm}` (config's layer_norm_eps), decoder bias
  `cls.predictions.bias`;
- distilbert: `vocab_transform`, `vocab_layer_norm` (its eps is fixed at 1e-12, not read from the
  config), decoder bias `vocab_projector.bias`;
- roberta, xlm-roberta, mpnet: `lm_head.{dense, layer_norm}` (config's eps), bias `lm_head.bias`.

The decoder's weight is the word embedding matrix where config.json's tie_word_embeddings holds
(transformers' default, and what checkpoints then store once: no decoder tensor in the file);
otherwise the stored decoder weight. The bias falls back to the decoder's own `bias` tensor,
which some files hold instead.

The head stops before the decoder: `transform` gives [B, S, H], and splade.py projects it onto
the vocabulary where it pools, because where the projection happens decides what the graph holds
in memory. The nodes are named mlm_*: an FP16 TensorRT build keeps them, and everything after
them, in FP32 (head.FP32_NODE_PREFIXES), since a logit of a few units in half precision is off
by far more than the 1e-4 the parity check allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engines.onnx_export.graph import ExportError, Graph, Weights, gelu, layer_norm, linear
from worker.core.model import ModelInfo


@dataclass(frozen=True)
class _HeadNames:
    dense: str
    norm: str
    bias: str
    decoder: str  # the untied decoder's prefix: {decoder}.weight, {decoder}.bias
    fixed_eps: float | None = None  # DistilBERT's vocab_layer_norm ignores the config's eps


_LM_HEAD = _HeadNames("lm_head.dense", "lm_head.layer_norm", "lm_head.bias", "lm_head.decoder")
HEAD_NAMES: dict[str, _HeadNames] = {
    "bert": _HeadNames("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
                       "cls.predictions.bias", "cls.predictions.decoder"),
    "distilbert": _HeadNames("vocab_transform", "vocab_layer_norm", "vocab_projector.bias", "vocab_projector",
                             fixed_eps=1e-12),
    "roberta": _LM_HEAD, "xlm-roberta": _LM_HEAD, "mpnet": _LM_HEAD,
}


@dataclass(frozen=True)
class Decoder:
    """The projection onto the vocabulary: logits = x @ weight.T + bias."""

    weight: np.ndarray  # [V, H] float32
    bias: np.ndarray    # [V] float32


def transform(g: Graph, w: Weights, info: ModelInfo, hidden_states: str) -> str:
    """The head's transform of the encoder's [B, S, H] hidden states (dense, GELU, LayerNorm)."""
    names = _names(info)
    h = info.hidden_size
    # An Identity named mlm_* leads the head, so an FP16 TensorRT build finds where it starts.
    x = g.op("Identity", [hidden_states], "mlm_input")
    x = gelu(g, linear(g, w, x, names.dense, h, h), "mlm_transform")
    eps = names.fixed_eps if names.fixed_eps is not None else info.layer_norm_eps
    return layer_norm(g, w, x, names.norm, h, eps)


def decoder(w: Weights, info: ModelInfo) -> Decoder:
    """The decoder's weight (tied to the word embeddings, or stored) and bias, checked against config.json."""
    names = _names(info)
    shape = (info.vocab_size, info.hidden_size)
    if info.tied_embeddings:
        weight = w.get("embeddings.word_embeddings.weight", shape)
    elif f"{names.decoder}.weight" in w.tensors:
        weight = w.get(f"{names.decoder}.weight", shape)
    else:
        raise ExportError(f"{info.weights_path}: config.json sets tie_word_embeddings false, but the file holds no "
                          f"decoder weight {names.decoder}.weight")
    bias_name = names.bias if names.bias in w.tensors else f"{names.decoder}.bias"
    if bias_name not in w.tensors:
        raise ExportError(f"{info.weights_path}: missing tensor {names.bias!r} (the MLM head's decoder bias); a "
                          f"sparse model needs the masked-language-model head ({info.model_type} "
                          f"{_mlm_class(info)}), not the bare encoder")
    return Decoder(weight, w.get(bias_name, (info.vocab_size,)))


def check_head(w: Weights, info: ModelInfo) -> None:
    """A clear refusal for a folder that holds the encoder without its MLM head."""
    names = _names(info)
    if f"{names.dense}.weight" not in w.tensors:
        raise ExportError(f"{info.weights_path}: no MLM head ({names.dense}.weight is missing): a sparse model "
                          f"(SpladePooling) needs the checkpoint of {_mlm_class(info)}, with its head")


def _names(info: ModelInfo) -> _HeadNames:
    try:
        return HEAD_NAMES[info.model_type]
    except KeyError:
        raise ExportError(f"{info.config_path}: no MLM head for model_type {info.model_type!r}") from None


def _mlm_class(info: ModelInfo) -> str:
    return {"bert": "BertForMaskedLM", "distilbert": "DistilBertForMaskedLM", "roberta": "RobertaForMaskedLM",
            "xlm-roberta": "XLMRobertaForMaskedLM", "mpnet": "MPNetForMaskedLM"}.get(info.model_type, "XxxForMaskedLM")
