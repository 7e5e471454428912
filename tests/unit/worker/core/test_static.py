"""Static models (worker/core/static.py): both folder formats read, tokenised and pooled as their
libraries do (parity against model2vec's StaticModel.encode and sentence-transformers' encode on
tests/data/static), through the Embedder with the options every model has, and refused where a
setting or a folder cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from worker.core.errors import BackendError, ModelError
from worker.core.model import ModelInfo
from worker.core.static import STATIC_MAX_TOKENS, load_table, pool
from worker.intake.tokenize import KeywordTokenizer
from worker.families.static import MIN_COS, static_fixture_folder, static_fixtures, static_parity
from tests.conftest import DATA

FIXTURES = {p.name: p for p in static_fixtures(DATA)}


def folder_of(name: str, tmp_path: Path) -> Path:
    return static_fixture_folder(FIXTURES[name], tmp_path, data=DATA)


def test_every_fixture_is_there() -> None:
    assert set(FIXTURES) == {"m2v-minilm", "m2v-minilm-quantized", "m2v-xlmr-tiny", "st-minilm", "st-bert-tiny"}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_the_worker_gives_the_librarys_vectors(name: str, tmp_path: Path) -> None:
    parity = static_parity(folder_of(name, tmp_path), FIXTURES[name] / "reference.npz")
    assert parity.ok, parity
    assert min(parity.single, parity.batched) >= MIN_COS


def test_parity_fails_when_the_unknown_token_is_kept_for_model2vec(tmp_path: Path) -> None:
    """The check can fail: model2vec drops its unknown token from the mean; keeping it (as
    sentence-transformers does) moves every row with an unknown character."""
    info = ModelInfo.from_dir(folder_of("m2v-minilm", tmp_path))
    assert info.static is not None and info.static.unk_id == 100  # BERT's [UNK]
    with np.load(FIXTURES["m2v-minilm"] / "reference.npz") as ref:
        texts, expected = [str(t) for t in ref["texts"]], ref["vectors"]
    import dataclasses

    kept = dataclasses.replace(info.static, unk_id=None)
    table = load_table(kept, info.vocab_size)
    from worker.batching.padding import pad_batch

    ids = [e.ids for e in KeywordTokenizer.from_model(info).encode(texts)]
    got = np.concatenate([pool(table, *pad_batch([row])) for row in ids])
    unk_rows = [i for i, row in enumerate(ids) if (row == 100).any()]
    assert unk_rows
    cos = np.sum(got * expected, axis=1) / np.maximum(np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1),
                                                      1e-30)
    assert cos[unk_rows].min() < MIN_COS


def test_both_formats_read_as_static_models(tmp_path: Path) -> None:
    m2v = ModelInfo.from_dir(folder_of("m2v-minilm-quantized", tmp_path))
    st = ModelInfo.from_dir(folder_of("st-minilm", tmp_path))
    assert (m2v.model_type, m2v.dim, m2v.normalized, m2v.max_seq_length) == ("static", 32, False, 8)
    assert m2v.static is not None and m2v.static.weighted and m2v.static.mapped and m2v.static.rows == 1000
    assert (st.model_type, st.dim, st.normalized) == ("static", 48, True)
    # StaticEmbedding cuts nothing; MiniLM's tokenizer.json truncates at 128, which its tokenizer keeps.
    assert st.static is not None and st.static.unk_id is None and st.max_seq_length == 128
    assert "Static sentence-transformers" in st.pipeline.describe()
    assert ModelInfo.from_dir(folder_of("st-bert-tiny", tmp_path)).max_seq_length == STATIC_MAX_TOKENS


def test_a_module_after_staticembedding_other_than_normalize_is_refused(tmp_path: Path) -> None:
    folder = folder_of("st-bert-tiny", tmp_path)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": len(modules), "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").unlink()
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelError, match="followed by Normalize only; this pipeline has Dense"):
        ModelInfo.from_dir(folder)


def test_a_table_under_another_name_is_refused(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    folder = folder_of("m2v-xlmr-tiny", tmp_path)
    config = {**json.loads((folder / "config.json").read_text()), "model_type": "model2vec"}  # as distill writes it
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    assert ModelInfo.from_dir(folder).model_type == "static"
    save_file({"vectors": np.zeros((320, 4), dtype=np.float32)}, str(folder / "model.safetensors"))
    with pytest.raises(ModelError, match="no embedding table .*'embeddings'.*found vectors"):
        ModelInfo.from_dir(folder)


def test_the_fast_path_gives_the_full_tokenizers_ids(tmp_path: Path) -> None:
    """BERT's WordPiece fast path with [CLS] and [SEP] sliced off: add_special_tokens=False's IDs."""
    from tokenizers import Tokenizer

    from worker.intake.tokenize import StaticTokenizer

    info = ModelInfo.from_dir(folder_of("st-minilm", tmp_path))
    assert info.static is not None
    with np.load(FIXTURES["st-minilm"] / "reference.npz") as ref:
        texts = [str(t) for t in ref["texts"]]
    fast = StaticTokenizer(Tokenizer.from_file(str(info.tokenizer_path)), info.static, info.max_seq_length)
    slow = StaticTokenizer(Tokenizer.from_file(str(info.tokenizer_path)), info.static, info.max_seq_length,
                           fast=False)
    assert fast.fast_path != "none" and slow.fast_path == "none"
    plain = Tokenizer.from_file(str(info.tokenizer_path))
    plain.no_padding()
    plain.enable_truncation(info.max_seq_length)
    want = [e.ids for e in plain.encode_batch(texts, add_special_tokens=False)]
    for a, b, w in zip(fast.encode(texts), slow.encode(texts), want):
        assert list(a.ids) == list(b.ids) == w
        assert (a.length, a.truncated) == (b.length, b.truncated)
    assert fast.special_tokens == 0 and fast.prompt_tokens == 0


def test_model2vec_cuts_characters_then_tokens(tmp_path: Path) -> None:
    info = ModelInfo.from_dir(folder_of("m2v-minilm-quantized", tmp_path))  # max_length 8
    tok = KeywordTokenizer.from_model(info)
    long = "abcdefghij " * 20
    enc = tok.encode([long, "running shoes"])
    assert len(enc[0].ids) == 8 and enc[0].truncated
    assert len(enc[1].ids) == 2 and not enc[1].truncated


def test_the_embedder_runs_a_static_model_with_every_model_option(tmp_path: Path) -> None:
    from worker import Embedder

    folder = folder_of("m2v-minilm", tmp_path)
    with np.load(FIXTURES["m2v-minilm"] / "reference.npz") as ref:
        texts, expected = [str(t) for t in ref["texts"]], ref["vectors"]
    with Embedder(folder) as emb:
        assert emb.backend.name == "static" and emb.dim == 48 and emb.normalized
        got = emb.embed(texts)
        again = emb.embed(texts[:5])  # from the cache, bit for bit
        full = emb.fingerprint()
    ok = np.linalg.norm(expected, axis=1) > 0
    cos = np.sum(got[ok] * expected[ok], axis=1) / (np.linalg.norm(got[ok], axis=1) * np.linalg.norm(expected[ok], axis=1))
    assert cos.min() >= MIN_COS
    assert np.array_equal(again, got[:5])
    with Embedder(folder, truncate_dim=16, cache_bytes=0) as emb:
        short = emb.embed(texts[:50])
        assert short.shape == (50, 16) and emb.fingerprint() != full
    assert np.allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)
    head = got[:50, :16] / np.linalg.norm(got[:50, :16], axis=1, keepdims=True)
    assert np.allclose(short, head, atol=1e-6)


def test_the_fingerprint_follows_the_table(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    from worker import Embedder

    folder = folder_of("st-bert-tiny", tmp_path)
    with Embedder(folder, cache_bytes=0) as emb:
        before = emb.fingerprint()
    save_file({"embedding.weight": np.ones((320, 24), dtype=np.float32)},
              str(folder / "model.safetensors"))  # sentence-transformers 6.x: the StaticEmbedding at the root
    with Embedder(folder, cache_bytes=0) as emb:
        assert emb.fingerprint() != before


@pytest.mark.parametrize("option, match", [
    ({"onnx_path": "model.onnx"}, "onnx_path is set: .*static model"),
    ({"precision": "int8"}, "precision 'int8'.*static model"),
])
def test_what_a_static_model_cannot_take_is_refused(tmp_path: Path, option: dict, match: str) -> None:  # type: ignore[type-arg]
    from worker import Embedder
    from worker.embedder import EmbedderError

    with pytest.raises((BackendError, EmbedderError), match=match):
        Embedder(folder_of("st-bert-tiny", tmp_path), **option)


def test_the_worker_loads_the_static_backend_and_refuses_a_gpu_one(tmp_path: Path) -> None:
    from worker.backend_choice.select import load_backend
    from worker.settings.schema import Settings

    folder = folder_of("st-bert-tiny", tmp_path)
    loaded = load_backend(Settings(model_dir=str(folder), backend="auto"))
    assert loaded.backend.name == "static" and loaded.profile.name == "cpu" and loaded.settings.backend == "onnxruntime"
    with pytest.raises(BackendError, match="backend 'torch'.*static model"):
        load_backend(Settings(model_dir=str(folder), backend="torch"))
    with pytest.raises(BackendError, match="precision 'int8'"):
        load_backend(Settings(model_dir=str(folder), precision="int8"))


def test_a_token_id_outside_the_table_is_a_backend_error(tmp_path: Path) -> None:
    from worker.backends.static import StaticBackend

    ctx = StaticBackend(ModelInfo.from_dir(folder_of("st-bert-tiny", tmp_path))).create_context(0)
    with pytest.raises(BackendError, match=r"token IDs must be in \[0, 320\)"):
        ctx.run(np.array([[5, 320]]), np.ones((1, 2), dtype=np.int64))


def test_padding_and_unknown_tokens_do_not_move_the_mean(tmp_path: Path) -> None:
    """The gather points padding at a zero row the mean does not count; model2vec's unknown token
    is a zero row not counted either (a text of nothing else: zeros, as model2vec gives)."""
    info = ModelInfo.from_dir(folder_of("m2v-minilm", tmp_path))
    assert info.static is not None
    table = load_table(info.static, info.vocab_size)
    ids = np.array([[2000, 3000, 0, 0], [2000, 100, 3000, 100], [100, 100, 0, 0]])
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    out = pool(table, ids, mask)
    assert np.allclose(out[0], out[1], atol=1e-7)
    assert not out[2].any()


def test_models_lists_the_static_family_and_check_runs_its_fixtures(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from worker.cli import main
    from worker.families import Checkout
    from worker.families.static import check

    assert main(["models"]) == 0
    assert "\nStatic models (a table lookup, no encoder" in capsys.readouterr().out
    assert check(Checkout(DATA / "families", tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.count(" ok\n") == len(FIXTURES) == 5 and "Static model2vec (1,000 rows x 32, token weights" in out
    assert main(["models", "--model", str(folder_of("st-minilm", tmp_path))]) == 0
    assert "family:     static" in capsys.readouterr().out
    # A reference that no longer matches its folder fails the check.
    broken = tmp_path / "data"
    (broken / "static").mkdir(parents=True)
    for item in (DATA / "static").iterdir():
        (broken / "static" / item.name).symlink_to(item)
    (broken / "static" / "st-bert-tiny").unlink()
    (broken / "static" / "st-bert-tiny").mkdir()
    for item in FIXTURES["st-bert-tiny"].iterdir():
        (broken / "static" / "st-bert-tiny" / item.name).symlink_to(item)
    (broken / "static" / "st-bert-tiny" / "reference.npz").unlink()
    with np.load(FIXTURES["st-bert-tiny"] / "reference.npz") as ref:
        np.savez(broken / "static" / "st-bert-tiny" / "reference.npz", texts=ref["texts"], vectors=ref["vectors"][::-1])
    (broken / "families").symlink_to(DATA / "families")
    assert check(Checkout(broken / "families", tmp_path)) == 1
    assert "FAIL" in capsys.readouterr().out


def test_a_static_model_has_no_graph_to_export(tmp_path: Path) -> None:
    from engines.onnx_export.export import build_model
    from engines.onnx_export.graph import ExportError

    with pytest.raises(ExportError, match="a static model .* has no graph to export"):
        build_model(folder_of("st-bert-tiny", tmp_path))
