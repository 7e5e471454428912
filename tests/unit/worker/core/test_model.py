"""ModelInfo: what the model folder says, and clear errors when it says something wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from worker.core.model import ModelError, ModelInfo, ModelNotFoundError, default_model_dir


@pytest.fixture()
def model_copy(tmp_path: Path) -> Path:
    """A copy of the default folder's small files (the weights are a symlink: only their presence matters)."""
    src = default_model_dir()
    dst = tmp_path / "model"
    dst.mkdir()
    for name in ("config.json", "sentence_bert_config.json", "tokenizer.json", "README.md"):
        shutil.copy(src / name, dst / name)
    (dst / "1_Pooling").mkdir()
    shutil.copy(src / "1_Pooling" / "config.json", dst / "1_Pooling" / "config.json")
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    return dst


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_default_model_folder_describes_minilm() -> None:
    info = ModelInfo.from_dir(default_model_dir())
    assert info.name == "all-MiniLM-L6-v2"
    assert (info.model_type, info.hidden_size, info.num_layers, info.num_heads) == ("bert", 384, 6, 12)
    assert info.dim == 384 and info.head_size == 32 and info.intermediate_size == 1536
    # 256 from sentence_bert_config.json, not config.json's 512 nor tokenizer.json's 128.
    assert info.max_seq_length == 256 and info.max_position_embeddings == 512
    assert info.pooling_mode == "mean"
    assert info.weights_path.is_file() and info.tokenizer_path.is_file()


def test_missing_folder_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="nowhere"):
        ModelInfo.from_dir(tmp_path / "nowhere")


def test_missing_weights_names_the_file(model_copy: Path) -> None:
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="model.safetensors"):
        ModelInfo.from_dir(model_copy)


def test_invalid_json_names_the_file(model_copy: Path) -> None:
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"config\.json: not valid JSON"):
        ModelInfo.from_dir(model_copy)


@pytest.mark.parametrize(("changes", "message"), [
    ({"hidden_size": 100}, "not a multiple of num_attention_heads"),
    ({"num_hidden_layers": 0}, "'num_hidden_layers' must be a positive integer"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
    ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
])
def test_unsupported_config_is_rejected(model_copy: Path, changes: dict[str, object], message: str) -> None:
    _edit_json(model_copy / "config.json", **changes)
    with pytest.raises(ModelError, match=message):
        ModelInfo.from_dir(model_copy)


def test_max_seq_length_beyond_positions_is_rejected(model_copy: Path) -> None:
    _edit_json(model_copy / "sentence_bert_config.json", max_seq_length=1024)
    with pytest.raises(ModelError, match="max_seq_length must be an integer in"):
        ModelInfo.from_dir(model_copy)


def test_without_sentence_config_the_limit_is_the_position_table(model_copy: Path) -> None:
    (model_copy / "sentence_bert_config.json").unlink()
    assert ModelInfo.from_dir(model_copy).max_seq_length == 512


def test_pooling_modes(model_copy: Path) -> None:
    """Without modules.json (this copy has none) the pooling config is still read, as before."""
    pooling = model_copy / "1_Pooling" / "config.json"
    _edit_json(pooling, pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    assert ModelInfo.from_dir(model_copy).pooling_mode == "cls"
    _edit_json(pooling, pooling_mode_mean_tokens=True)
    # Two modes: concatenated, cls first, as sentence-transformers does (the vectors are twice as wide).
    info = ModelInfo.from_dir(model_copy)
    assert info.pooling_mode == "cls+mean" and info.dim == 768 and info.normalized
    _edit_json(pooling, pooling_mode_mean_tokens=False, pooling_mode_cls_token=False, pooling_mode_max_tokens=False)
    assert ModelInfo.from_dir(model_copy).pooling_mode == "mean"  # none on: mean, as sentence-transformers reads it
    _edit_json(pooling, pooling_mode="median")
    with pytest.raises(ModelError, match="pooling mode 'median' is not supported"):
        ModelInfo.from_dir(model_copy)
    pooling.unlink()
    assert ModelInfo.from_dir(model_copy).pooling_mode == "mean"
