"""The sentence-transformers module pipeline of a model folder: what runs after the encoder.

sentence-transformers runs a model as the modules listed in modules.json, in order: a
Transformer (the encoder), a Pooling, then any Dense layers and a Normalize where the model has
them. This reads that list and each module's config, so the export (engines/onnx_export/head.py)
can build the same steps into the graph:

- Pooling (1_Pooling/config.json): cls, max, mean, mean_sqrt_len_tokens, weightedmean,
  lasttoken, several concatenated in sentence-transformers' order, and include_prompt (false:
  the prompt's tokens are left out of the pooling). Both spellings are read: the hub's
  `pooling_mode_*_token` flags and sentence-transformers 5+'s `pooling_mode`.
- Dense (N_Dense/config.json and model.safetensors): y = activation(W x + b), with the
  activations torch.nn Identity, Tanh, ReLU, GELU (exact), Sigmoid and SiLU.
- Normalize: L2 normalisation, only where the module is listed. A pipeline without it gives
  vectors that are not unit length (a dot-product model), and the output says so.

Sparse (SPLADE) models are the other pipeline shape sentence-transformers' SparseEncoder saves: the
encoder with its masked-language-model head (a Transformer with `"transformer_task": "fill-mask"`
in sentence_bert_config.json, or 5.0-5.3's MLMTransformer), then SpladePooling
(1_SpladePooling/config.json: pooling_strategy max or sum, activation_function relu or
log1p_relu; `embedding_dimension`, 5.x's `word_embedding_dimension`, is the vocabulary size).
The result is one weight per vocabulary entry, nearly all zero (`ModulePipeline.sparse`).
The inference-free variant (a Router sending queries to a SparseStaticEmbedding) is read before
this (worker/core/sparse_static.py); a SparseStaticEmbedding anywhere else is refused by name.

A module of any other type (LSTM, WordEmbeddings, a custom class...) is refused with a one-line
ModelError naming it, never skipped. A folder without modules.json keeps the behaviour from
before this reader: pooling from 1_Pooling/config.json (mean without it), then L2 normalisation.
Nothing here imports torch: every value comes from the JSON files; the Dense weights are read
by the exporter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any, Literal, get_args

from worker.core.errors import ModelError

PoolingMode = Literal["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"]
POOLING_MODES: tuple[str, ...] = get_args(PoolingMode)
# sentence-transformers' legacy flags, in the order it concatenates the modes they switch on.
_LEGACY_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
Activation = Literal["identity", "tanh", "relu", "gelu", "sigmoid", "silu"]
# torch.nn class names (Dense saves the class's full name, e.g. torch.nn.modules.activation.Tanh).
_ACTIVATIONS: dict[str, Activation] = {"Identity": "identity", "Tanh": "tanh", "ReLU": "relu", "GELU": "gelu",
                                       "Sigmoid": "sigmoid", "SiLU": "silu"}
ModuleKind = Literal["Transformer", "Pooling", "Dense", "Normalize", "MLMTransformer", "SpladePooling"]
MODULE_KINDS: tuple[str, ...] = get_args(ModuleKind)
# SpladePooling's options (sentence_transformers.sparse_encoder SpladePooling): max or sum over the
# tokens of log(1 + relu(logits)), once more log1p'd for log1p_relu (OpenSearch's v3 models).
SpladeStrategy = Literal["max", "sum"]
SPLADE_STRATEGIES: tuple[str, ...] = get_args(SpladeStrategy)
SpladeActivation = Literal["relu", "log1p_relu"]
SPLADE_ACTIVATIONS: tuple[str, ...] = get_args(SpladeActivation)
# Modules of SparseEncoder's other variants, refused with the reason rather than as unknown.
_SPARSE_REFUSED = {
    "SparseStaticEmbedding": "SparseStaticEmbedding (an inference-free query encoder: a weight per token, no "
                             "encoder) is not supported",
    "SparseAutoEncoder": "SparseAutoEncoder (CSR: a sparse code of a dense embedding) is not supported; "
                         "keyword-embedder runs SPLADE (an MLM Transformer and SpladePooling)",
}
_EMBEDDING = "sentence_embedding"  # the feature Pooling writes and Dense/Normalize read


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"{path}: file not found") from None
    except OSError as exc:
        raise ModelError(f"{path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: not valid JSON ({exc})") from None


def read_json_object(path: Path) -> dict[str, Any]:
    data = read_json(path)
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return data


@dataclass(frozen=True)
class Pooling:
    modes: tuple[PoolingMode, ...] = ("mean",)
    include_prompt: bool = True
    config_path: Path | None = None

    def __str__(self) -> str:
        return "+".join(self.modes) + ("" if self.include_prompt else " (prompt tokens left out)")


@dataclass(frozen=True)
class Dense:
    in_features: int
    out_features: int
    bias: bool
    activation: Activation
    config_path: Path
    weights_path: Path

    def __str__(self) -> str:
        return f"Dense {self.in_features}->{self.out_features} {self.activation}" + ("" if self.bias else " (no bias)")


@dataclass(frozen=True)
class Normalize:
    def __str__(self) -> str:
        return "Normalize"


@dataclass(frozen=True)
class SpladePooling:
    """SparseEncoder's SPLADE pooling of the MLM logits, under the attention mask."""

    strategy: SpladeStrategy = "max"
    activation: SpladeActivation = "relu"
    config_path: Path | None = None

    def __str__(self) -> str:
        return f"SpladePooling {self.strategy} {self.activation}"


@dataclass(frozen=True)
class ModulePipeline:
    """What runs after the encoder: a pooling, then Dense and Normalize steps in modules.json's order;
    or, for a sparse model, the MLM head and SpladePooling (`sparse`)."""

    pooling: Pooling = Pooling()
    steps: tuple[Dense | Normalize, ...] = (Normalize(),)
    modules_path: Path | None = None  # modules.json; None: the folder has none (the defaults)
    # Set for one prompt (with_prompt): how many leading tokens include_prompt=false leaves out.
    prompt_tokens_excluded: int = 0
    # A SPLADE model: the encoder's MLM head, then this pooling; `pooling` and `steps` are unused.
    sparse: SpladePooling | None = None
    # A static model (worker/core/static.py): its one-line description and the files it is read
    # from; it has no encoder, and the pooling (mean) and steps (Normalize or none) say the rest.
    static: str = ""
    static_files: tuple[Path, ...] = ()

    @property
    def normalized(self) -> bool:
        """Whether the vectors come out unit length: the last step is a Normalize."""
        return bool(self.steps) and isinstance(self.steps[-1], Normalize)

    @property
    def dense(self) -> tuple[Dense, ...]:
        return tuple(s for s in self.steps if isinstance(s, Dense))

    def output_dim(self, hidden_size: int, vocab_size: int = 0) -> int:
        if self.sparse is not None:
            return vocab_size  # one weight per vocabulary entry
        dense = self.dense
        return dense[-1].out_features if dense else hidden_size * len(self.pooling.modes)

    def files(self) -> tuple[Path, ...]:
        """Every file the pipeline was read from (part of the export's cache key)."""
        sparse_config = self.sparse.config_path if self.sparse is not None else None
        out = [p for p in (self.modules_path, self.pooling.config_path, sparse_config) if p is not None]
        out += self.static_files
        for d in self.dense:
            out += [d.config_path, d.weights_path]
        return tuple(out)

    def with_prompt(self, prompt_tokens: int) -> ModulePipeline:
        """The pipeline for inputs that start with a prompt of `prompt_tokens` tokens (sentence-
        transformers' prompt_length: the prompt's tokens with the leading special token, not the
        trailing one); only an include_prompt=false pooling changes."""
        excluded = 0 if self.pooling.include_prompt else max(0, prompt_tokens)
        return replace(self, prompt_tokens_excluded=excluded)

    def describe(self) -> str:
        """One line: 'Pooling mean -> Dense 768->512 tanh -> not normalised'."""
        if self.sparse is not None:
            return f"MLM head -> {self.sparse} -> sparse (the non-zero vocabulary weights)"
        if self.static:
            return self.static
        pooling = f"Pooling {self.pooling}"
        if self.prompt_tokens_excluded:
            pooling += f" [{self.prompt_tokens_excluded} tokens]"
        parts = [pooling, *map(str, self.steps)]
        if not self.normalized:
            parts.append("not normalised")
        source = "" if self.modules_path is not None else " (no modules.json: the defaults, L2-normalised)"
        return " -> ".join(parts) + source


def read_pipeline(model_dir: Path, hidden_size: int, vocab_size: int = 0) -> ModulePipeline:
    """The module pipeline of a model folder (ModelError naming the file for anything it cannot run)."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        pooling_path = model_dir / "1_Pooling" / "config.json"
        pooling = _pooling(pooling_path, hidden_size) if pooling_path.is_file() else Pooling()
        return ModulePipeline(pooling, (Normalize(),), None)
    raw = read_json(modules_path)
    if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) for m in raw):
        raise ModelError(f"{modules_path}: expected a non-empty JSON list of modules")
    entries = sorted(raw, key=lambda m: m.get("idx", 0) if isinstance(m.get("idx", 0), int) else 0)
    kinds = [_kind(modules_path, i, m) for i, m in enumerate(entries)]
    # 6.x spells the MLM encoder as a plain Transformer whose sentence_bert_config.json says fill-mask.
    if kinds[0] == "Transformer" and _transformer_task(model_dir) == "fill-mask":
        kinds[0] = "MLMTransformer"
    if "SpladePooling" in kinds or "MLMTransformer" in kinds:
        return _sparse_pipeline(model_dir, modules_path, entries, kinds, vocab_size)
    if kinds[:2] != ["Transformer", "Pooling"] or "Transformer" in kinds[1:] or "Pooling" in kinds[2:]:
        raise ModelError(f"{modules_path}: modules {' -> '.join(kinds)}; keyword-embedder runs a Transformer, then "
                         f"one Pooling, then Dense and Normalize modules")
    if str(entries[0].get("path", "")).strip("./"):
        raise ModelError(f"{modules_path}: the Transformer module is in {entries[0]['path']!r}; keyword-embedder "
                         f"reads the encoder from the folder itself (path \"\")")
    pooling = _pooling(_module_dir(model_dir, entries[1]) / "config.json", hidden_size)
    width = hidden_size * len(pooling.modes)
    steps: list[Dense | Normalize] = []
    for entry, kind in zip(entries[2:], kinds[2:]):
        folder = _module_dir(model_dir, entry)
        if kind == "Dense":
            dense = _dense(folder, width)
            steps.append(dense)
            width = dense.out_features
        else:
            config = folder / "config.json"
            if config.is_file():
                _check_feature(config, read_json_object(config))
            steps.append(Normalize())
    return ModulePipeline(pooling, tuple(steps), modules_path)


def check_layout(model_dir: Path) -> None:
    """Refuses, before anything else is read, a folder whose modules.json names a module this
    worker never runs in place of the encoder (an inference-free Router keeps its encoder in a
    sub-folder, so the folder itself has no config.json to complain about first)."""
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return
    raw = read_json(modules_path)
    if isinstance(raw, list):
        for i, entry in enumerate(raw):
            if isinstance(entry, dict) and str(entry.get("type", "")).rsplit(".", 1)[-1] in _SPARSE_REFUSED:
                _kind(modules_path, i, entry)


def _sparse_pipeline(model_dir: Path, modules_path: Path, entries: list[dict[str, Any]], kinds: list[str],
                     vocab_size: int) -> ModulePipeline:
    """SparseEncoder's SPLADE pipeline: an MLM encoder at the folder itself, then SpladePooling, nothing after."""
    if kinds != ["MLMTransformer", "SpladePooling"]:
        raise ModelError(f"{modules_path}: modules {' -> '.join(kinds)}; a sparse model runs here as sentence-"
                         f"transformers' SPLADE: an MLM Transformer (transformer_task fill-mask, or MLMTransformer), "
                         f"then SpladePooling, and nothing after it")
    if str(entries[0].get("path", "")).strip("./"):
        raise ModelError(f"{modules_path}: the MLM Transformer module is in {entries[0]['path']!r}; keyword-embedder "
                         f"reads the encoder from the folder itself (path \"\")")
    config = _module_dir(model_dir, entries[1]) / "config.json"
    cfg = read_json_object(config)
    strategy = cfg.get("pooling_strategy", "max")
    if strategy not in SPLADE_STRATEGIES:
        raise ModelError(f"{config}: pooling_strategy {strategy!r} is not supported ({', '.join(SPLADE_STRATEGIES)})")
    activation = cfg.get("activation_function", "relu")
    if activation not in SPLADE_ACTIVATIONS:
        raise ModelError(f"{config}: activation_function {activation!r} is not supported "
                         f"({', '.join(SPLADE_ACTIVATIONS)})")
    # Informational in sentence-transformers (set from the logits at the first forward); a
    # folder that states it must state the vocabulary the encoder's head projects onto.
    dim = cfg.get("embedding_dimension", cfg.get("word_embedding_dimension"))
    if dim is not None and dim != vocab_size:
        raise ModelError(f"{config}: the pooling is for {dim} vocabulary entries, config.json's vocab_size is "
                         f"{vocab_size}")
    return ModulePipeline(steps=(), modules_path=modules_path,
                          sparse=SpladePooling(strategy, activation, config))  # type: ignore[arg-type]


def _transformer_task(model_dir: Path) -> str | None:
    path = model_dir / "sentence_bert_config.json"
    task = read_json_object(path).get("transformer_task") if path.is_file() else None
    return task if isinstance(task, str) else None


def _kind(modules_path: Path, i: int, entry: dict[str, Any]) -> ModuleKind:
    type_name = str(entry.get("type", ""))
    # sentence_transformers.models.Dense (the hub's models) and
    # sentence_transformers.base.modules.dense.Dense (what 5.x and later save) are one class;
    # so are 5.0's sentence_transformers.sparse_encoder.models.SpladePooling and 6.x's
    # sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling.
    name = type_name.rsplit(".", 1)[-1]
    if type_name.startswith("sentence_transformers.") and name in MODULE_KINDS:
        return name  # type: ignore[return-value]
    where = entry.get("path") or "the folder itself"
    if type_name.startswith("sentence_transformers.") and name in _SPARSE_REFUSED:
        raise ModelError(f"{modules_path}: module {entry.get('idx', i)} ({where}) is {type_name}: "
                         f"{_SPARSE_REFUSED[name]}")
    raise ModelError(f"{modules_path}: module {entry.get('idx', i)} ({where}) is {type_name or 'untyped'}, which "
                     f"keyword-embedder cannot run (it runs sentence-transformers' {', '.join(MODULE_KINDS)}); "
                     f"refused rather than skipped")


def _module_dir(model_dir: Path, entry: dict[str, Any]) -> Path:
    path = str(entry.get("path", ""))
    parts = PurePosixPath(path)
    if parts.is_absolute() or ".." in parts.parts:  # read lexically: a module folder may be a symlink
        raise ModelError(f"{model_dir / 'modules.json'}: module path {path!r} is outside the model folder")
    return model_dir / path


def _check_feature(path: Path, cfg: dict[str, Any]) -> None:
    # Dense and Normalize can be pointed at other features (token_embeddings, for multi-vector
    # models); the pipeline here has one: the pooled sentence embedding.
    for key in ("module_input_name", "module_output_name"):
        value = cfg.get(key)
        if value is not None and value != _EMBEDDING:
            raise ModelError(f"{path}: {key} {value!r} is not supported (only {_EMBEDDING!r})")


def _pooling(path: Path, hidden_size: int) -> Pooling:
    cfg = read_json_object(path)
    dim = cfg.get("embedding_dimension", cfg.get("word_embedding_dimension", hidden_size))
    if dim != hidden_size:
        raise ModelError(f"{path}: the pooling is for {dim}-d token embeddings, the encoder gives {hidden_size}")
    mode = cfg.get("pooling_mode")
    if mode is not None:
        modes = (mode,) if isinstance(mode, str) else tuple(mode) if isinstance(mode, list) else ()
        if not modes or not all(isinstance(m, str) for m in modes):
            raise ModelError(f"{path}: pooling_mode must be a mode or a list of modes, got {mode!r}")
    else:
        # As sentence-transformers reads the flags: the modes switched on, mean when none is.
        modes = tuple(m for flag, m in _LEGACY_FLAGS.items() if cfg.get(flag)) or ("mean",)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown:
        raise ModelError(f"{path}: pooling mode {unknown[0]!r} is not supported ({', '.join(POOLING_MODES)})")
    include_prompt = cfg.get("include_prompt", True)
    if not isinstance(include_prompt, bool):
        raise ModelError(f"{path}: include_prompt must be true or false, got {include_prompt!r}")
    return Pooling(modes, include_prompt, path)  # type: ignore[arg-type]


def _dense(folder: Path, width: int) -> Dense:
    config = folder / "config.json"
    cfg = read_json_object(config)
    _check_feature(config, cfg)
    n_in, n_out = cfg.get("in_features"), cfg.get("out_features")
    for key, value in (("in_features", n_in), ("out_features", n_out)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelError(f"{config}: {key!r} must be a positive integer, got {value!r}")
    if n_in != width:
        raise ModelError(f"{config}: in_features {n_in}, but the module before it gives {width}-d vectors")
    if cfg.get("use_residual"):
        raise ModelError(f"{config}: use_residual is not supported")
    bias = cfg.get("bias", True)
    if not isinstance(bias, bool):
        raise ModelError(f"{config}: bias must be true or false, got {bias!r}")
    # sentence-transformers' default activation is Tanh, and it only loads torch.nn classes
    # without trust_remote_code.
    act_name = str(cfg.get("activation_function", "torch.nn.modules.activation.Tanh"))
    activation = _ACTIVATIONS.get(act_name.rsplit(".", 1)[-1]) if act_name.startswith("torch.nn.") else None
    if activation is None:
        raise ModelError(f"{config}: activation_function {act_name!r} is not supported (torch.nn "
                         f"{', '.join(_ACTIVATIONS)})")
    weights = folder / "model.safetensors"
    if not weights.is_file():
        legacy = folder / "pytorch_model.bin"
        if legacy.is_file():
            raise ModelError(f"{legacy}: Dense weights in torch's pickle format are not read (no torch here); "
                             f"save them as {weights.name} (safetensors)")
        raise ModelError(f"{weights}: file not found (the Dense layer's weights)")
    return Dense(n_in, n_out, bias, activation, config, weights)  # type: ignore[arg-type]
