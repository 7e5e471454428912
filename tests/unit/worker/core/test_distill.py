"""`keyword-embedder distill-static` (worker/commands/distill_static.py, worker/core/distill.py) on
the tiny BERT family fixture, against model2vec 0.10's own distill of it (tests/data/static/
distill-bert-model2vec.npz, made by make_distill_reference.py). A second or two."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import worker.commands.distill_static as distill_static
from worker.core.distill import neighbour_recall, pca, zipf_weights
from worker.core.errors import ModelError
from tests.conftest import DATA

TEACHER = DATA / "families" / "bert"
REFERENCE = DATA / "static" / "distill-bert-model2vec.npz"


def _against_model2vec(folder: Path) -> tuple[float, float, list[str]]:
    """(min cos, max |norm ratio - 1|) of our rows against model2vec's, token by token, and the
    tokens whose rows are not zero here."""
    ref = np.load(REFERENCE)
    tokens = [str(t) for t in ref["tokens"]]
    table = load_file(str(folder / "model.safetensors"))["embeddings"].astype(np.float64)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    ours = table[[vocab[t] for t in tokens]]
    theirs = ref["table"].astype(np.float64)
    norms = np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    cos = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    nonzero = [t for t, i in vocab.items() if np.any(table[i])]
    return float(cos.min()), float(np.abs(norms - 1).max()), nonzero


def test_the_table_is_model2vecs_and_the_worker_runs_it(tmp_path: Path) -> None:
    from worker import Embedder

    stats = distill_static.distill(TEACHER, tmp_path / "m", dim=16, dtype="float32")
    assert stats["tokens"] == 317 and stats["removed"] == 3 and stats["shape"] == (320, 16)
    cos, norm, nonzero = _against_model2vec(tmp_path / "m")
    # The teacher's rows from ONNX Runtime and from torch differ by ~1e-3 relative on this tiny
    # random fixture; the PCA, the signs and the Zipf weights must then agree to that.
    assert cos >= 0.9999 and norm <= 0.01, (cos, norm)
    assert sorted(nonzero) == sorted(str(t) for t in np.load(REFERENCE)["tokens"])  # [CLS] [SEP] [MASK] out
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "model2vec" and config["normalize"] is True and config["hidden_dim"] == 16
    with Embedder(tmp_path / "m") as emb:
        assert emb.backend.name == "static" and emb.dim == 16 and emb.normalized
        rows = emb.embed(["running shoes", "a"])
    assert np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-6)


def test_the_check_fails_without_the_special_tokens_around_each_token(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Each token alone with no [CLS]/[SEP] around it (not what model2vec feeds the teacher).
    monkeypatch.setattr(distill_static, "_special_ids", lambda tokenizer: ([], []))
    distill_static.distill(TEACHER, tmp_path / "m", dim=16, dtype="float32")
    cos, norm, _ = _against_model2vec(tmp_path / "m")
    assert cos < 0.9999 or norm > 0.01


def test_zipf_weights_pca_and_the_recall() -> None:
    w = zipf_weights(4, 1e-4)
    p = (1 / np.arange(2, 6)) / (1 / np.arange(2, 6)).sum()
    assert np.allclose(w, 1e-4 / (1e-4 + p)) and np.all(np.diff(w) > 0)  # rarer (later) tokens weigh more
    assert np.array_equal(zipf_weights(3, None), np.ones(3))
    x = np.random.default_rng(0).normal(size=(200, 6)) * np.array([5, 4, 3, 2, 1, 0.5])
    scores = pca(x, 3)
    assert np.all(np.diff(scores.var(axis=0)) < 0)  # largest variance first
    assert np.all(scores[np.argmax(np.abs(scores), axis=0), range(3)] > 0)  # model2vec's sign rule
    assert np.allclose(scores.T @ scores, np.diag(np.diag(scores.T @ scores)), atol=1e-8)
    assert neighbour_recall(x, x * 3) == 1.0
    assert neighbour_recall(x, np.random.default_rng(1).normal(size=x.shape)) < 0.2


def test_what_the_command_refuses(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    run = [sys.executable, "-m", "worker.cli", "distill-static", "--model-dir", str(TEACHER)]
    out = subprocess.run([*run, "--output", str(tmp_path / "full")], capture_output=True, text=True)
    assert out.returncode == 2 and "exists and is not an empty folder" in out.stderr
    with pytest.raises(ModelError, match="needs a dense encoder as its teacher; this is a sparse model"):
        distill_static.distill(DATA / "sparse" / "router-bert", tmp_path / "s")
    with pytest.raises(ModelError, match="leaves no token"):
        distill_static.distill(TEACHER, tmp_path / "e", pattern=re.compile(".*"))


def test_the_command_writes_the_folder_and_evaluates_it(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "worker.cli", "distill-static", "--model-dir", str(TEACHER),
                          "--output", str(tmp_path / "m"), "--dim", "8", "--evaluate",
                          str(DATA / "terabyte05-300.tsv")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "distilled 317 tokens (3 removed) into 320 x 8 (float16)" in out.stdout
    recall = float(re.search(r"on 29\d distinct texts: ([0-9.]+)", out.stdout).group(1))  # type: ignore[union-attr]
    assert 0 < recall <= 1


def test_a_tokenizer_that_pads_to_a_fixed_length_gives_the_same_table(tmp_path: Path) -> None:
    # all-MiniLM-L6-v2's tokenizer.json pads every text to 128: its pads must not join each token.
    import shutil

    teacher = tmp_path / "teacher"
    shutil.copytree(TEACHER, teacher)
    tok = json.loads((teacher / "tokenizer.json").read_text())
    tok["padding"] = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                      "pad_type_id": 0, "pad_token": "[PAD]"}
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    distill_static.distill(teacher, tmp_path / "m", dim=16, dtype="float32")
    cos, norm, _ = _against_model2vec(tmp_path / "m")
    assert cos >= 0.9999 and norm <= 0.01, (cos, norm)
