"""Encoder families: the torch-free export of each against vectors transformers computed.

The fixtures in tests/data/families/ (tiny random models, 2 layers, hidden 32, each with its own
tokenizer.json, and their reference vectors) were made once by make_fixtures.py beside them,
with the versions in versions.json; nothing here imports torch. Each family runs in both
poolings, each text on its own and in one padded batch of mixed lengths.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer

from engines.export_onnx import ExportError, build_model, mpnet_buckets
from kwe_core.model import FAMILIES, ModelError, ModelInfo
from worker.padding import pad_batch
from worker.tokenize import KeywordTokenizer

FIXTURES = Path(__file__).parent / "data" / "families"
MIN_COS = 0.9999


def _reference(family: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / family / "reference.npz") as ref:
        return {k: ref[k] for k in ref.files}


def _ids(ref: dict[str, np.ndarray]) -> list[np.ndarray]:
    offsets = ref["offsets"]
    return [ref["ids"][offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def _folder(tmp_path: Path, family: str, pooling: str) -> Path:
    """The fixture's files plus a sentence-transformers 1_Pooling/config.json for `pooling`."""
    folder = tmp_path / f"{family}-{pooling}"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        os.symlink(FIXTURES / family / name, folder / name)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
         "pooling_mode_mean_tokens": pooling == "mean"}))
    return folder


def _cos_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_every_family_has_a_fixture() -> None:
    assert sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) == sorted(FAMILIES)
    versions = json.loads((FIXTURES / "versions.json").read_text())
    assert {"torch", "transformers", "sentence_transformers"} <= set(versions)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("family", FAMILIES)
def test_export_matches_transformers(tmp_path: Path, family: str, pooling: str) -> None:
    ref = _reference(family)
    info = ModelInfo.from_dir(_folder(tmp_path, family, pooling))
    assert info.model_type == family and info.pooling_mode == pooling
    sess = ort.InferenceSession(build_model(info).SerializeToString(), providers=["CPUExecutionProvider"])
    rows = _ids(ref)
    # The tokenizer.json gives the ids the reference was computed on (same file, same library).
    tok = KeywordTokenizer.from_model(info)
    assert [e.ids.tolist() for e in tok.encode(list(ref["texts"]))] == [r.tolist() for r in rows]
    one_by_one = np.concatenate([sess.run(None, dict(zip(("input_ids", "attention_mask"), pad_batch([r]))))[0]
                                 for r in rows])
    batched = sess.run(None, dict(zip(("input_ids", "attention_mask"), pad_batch(rows))))[0]
    assert len({len(r) for r in rows}) > 3  # a batch of mixed lengths: most rows are padded
    for got in (one_by_one, batched):
        cos = _cos_rows(got, ref[pooling])
        assert cos.min() >= MIN_COS, f"{family}/{pooling}: worst row {int(cos.argmin())} cos {cos.min():.6f}"


def test_roberta_positions_start_after_padding_idx(tmp_path: Path) -> None:
    info = ModelInfo.from_dir(FIXTURES / "roberta")
    assert (info.position_offset, info.max_tokens, info.max_seq_length) == (2, 128, 128)
    assert ModelInfo.from_dir(FIXTURES / "bert").position_offset == 0


def test_mpnet_buckets_match_hf() -> None:
    # Values of HF MPNetEncoder.relative_position_bucket (transformers 5.24) at these distances.
    rel = np.array([-200, -128, -64, -17, -16, -9, -8, -7, -1, 0, 1, 7, 8, 9, 16, 17, 64, 128, 200])
    assert mpnet_buckets(rel).tolist() == [15, 15, 14, 10, 10, 8, 8, 7, 1, 0, 17, 23, 24, 24, 26, 26, 30, 31, 31]


def test_distilbert_config_names_are_read(tmp_path: Path) -> None:
    info = ModelInfo.from_dir(FIXTURES / "distilbert")
    assert (info.hidden_size, info.num_layers, info.num_heads, info.intermediate_size) == (32, 2, 4, 64)


def test_an_unsupported_family_is_refused_naming_model_type_and_the_supported(tmp_path: Path) -> None:
    folder = tmp_path / "gpt"
    shutil.copytree(FIXTURES / "bert", folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ModelError, match="model_type 'gpt2' is not supported; supported encoder families: "
                                         "bert, roberta, xlm-roberta, distilbert, mpnet"):
        ModelInfo.from_dir(folder)


def test_a_wrong_family_in_config_is_a_clear_export_error(tmp_path: Path) -> None:
    folder = tmp_path / "mislabelled"
    shutil.copytree(FIXTURES / "distilbert", folder)
    cfg = json.loads((FIXTURES / "bert" / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg))  # says bert, holds DistilBERT's tensors
    with pytest.raises(ExportError, match="missing tensor 'encoder.layer.0.*model_type 'bert'"):
        build_model(folder)


def test_fixture_tokenizers_are_the_families_kinds() -> None:
    kinds = {f: json.loads((FIXTURES / f / "tokenizer.json").read_text())["model"]["type"] for f in FAMILIES}
    assert kinds == {"bert": "WordPiece", "roberta": "BPE", "xlm-roberta": "Unigram", "distilbert": "WordPiece",
                     "mpnet": "WordPiece"}
    assert Tokenizer.from_file(str(FIXTURES / "roberta" / "tokenizer.json")).encode("a").ids[0] == 0  # <s>


@pytest.mark.parametrize(("family", "change"), [("mpnet", {"relative_attention_buckets": 0}),
                                                 ("roberta", {"position_offset": 0}),
                                                 ("xlm-roberta", {"position_offset": 1})])
def test_the_fixtures_catch_a_graph_without_the_familys_positions(tmp_path: Path, family: str,
                                                                   change: dict[str, int]) -> None:
    import dataclasses

    ref = _reference(family)
    info = dataclasses.replace(ModelInfo.from_dir(_folder(tmp_path, family, "mean")), **change)
    sess = ort.InferenceSession(build_model(info).SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, dict(zip(("input_ids", "attention_mask"), pad_batch(_ids(ref)))))[0]
    assert _cos_rows(got, ref["mean"]).min() < 0.99


def test_int8_precision_refuses_families_without_berts_tensor_names(tmp_path: Path) -> None:
    from kwe_core.errors import BackendError
    from worker.backends.select import open_backend

    info = ModelInfo.from_dir(_folder(tmp_path, "mpnet", "mean"))
    with pytest.raises(BackendError, match="precision int8 supports the encoder families bert, roberta, "
                                           "xlm-roberta, not model_type 'mpnet'"):
        open_backend("onnxruntime", info, precision="int8")


@pytest.mark.parametrize("family", ["roberta", "mpnet"])
def test_embedder_runs_a_family_folder_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  family: str) -> None:
    from worker.embedder import Embedder

    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "cache"))
    ref = _reference(family)
    with Embedder(_folder(tmp_path, family, "mean"), cache_bytes=0, batch_size=5) as emb:
        got = emb.embed(list(ref["texts"]))
    assert _cos_rows(got, ref["mean"]).min() >= MIN_COS
