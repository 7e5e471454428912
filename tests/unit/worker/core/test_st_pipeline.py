"""sentence-transformers' module pipeline (modules.json): Pooling, Dense, Normalize, as encode runs them.

The fixtures in tests/data/pipelines/ (module files over the tiny family encoders, and the
vectors SentenceTransformer.encode gave for them) were made once by make_pipeline_fixtures.py
beside them, with the versions in its versions.json; nothing here imports torch. Each runs
through the export and ONNX Runtime (each text alone and all in one padded batch) and through
the Embedder, against the reference vectors and their norms: unit length only where the
pipeline ends in Normalize.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import orjson
import pytest

from engines.onnx_export.export import build_model
from engines.onnx_export.head import FP32_NODE_PREFIXES
from worker.core.errors import BackendError
from worker.core.model import ModelError, ModelInfo, Prompt, default_model_dir
from worker.core.st_pipeline import POOLING_MODES, Dense, ModulePipeline, Normalize, Pooling
from worker.families.parity import MIN_COS, NORM_TOL, cosines, norm_error
from worker.families.dense import pipeline_fixtures
from worker.families.dense import pipeline_folder as _pipeline_folder
from worker.families.dense import pipeline_parity as _pipeline_parity
from tests.conftest import DATA

PIPELINE_FIXTURES = DATA / "pipelines"
FAMILY_FIXTURES = DATA / "families"
FIXTURES = pipeline_fixtures(PIPELINE_FIXTURES)
NAMES = [f.name for f in FIXTURES]


def _fixture(name: str) -> Path:
    return PIPELINE_FIXTURES / name


def pipeline_folder(fixture: Path, into: Path) -> Path:
    return _pipeline_folder(fixture, into, families=FAMILY_FIXTURES)


def pipeline_parity(fixture: Path, **kwargs: Any) -> Any:
    return _pipeline_parity(fixture, families=FAMILY_FIXTURES, **kwargs)


def _info(tmp_path: Path, name: str) -> ModelInfo:
    return ModelInfo.from_dir(pipeline_folder(_fixture(name), tmp_path))


def _reference(name: str) -> tuple[list[str], np.ndarray]:
    with np.load(_fixture(name) / "reference.npz") as ref:
        return [str(t) for t in ref["texts"]], ref["vectors"]


def test_the_fixtures_cover_every_mode_dense_layers_unnormalised_and_excluded_prompts(tmp_path: Path) -> None:
    infos = {name: _info(tmp_path / name, name) for name in NAMES}
    modes = {m for i in infos.values() for m in i.pipeline.pooling.modes}
    assert modes == set(POOLING_MODES)
    assert {d.activation for i in infos.values() for d in i.pipeline.dense} == {
        "identity", "tanh", "relu", "gelu", "sigmoid", "silu"}
    assert {i.normalized for i in infos.values()} == {True, False}
    assert any(not i.pipeline.pooling.include_prompt for i in infos.values())
    assert any(len(i.pipeline.pooling.modes) > 1 for i in infos.values())
    assert {i.model_type for i in infos.values()} == {"bert", "roberta", "xlm-roberta", "distilbert", "mpnet"}
    # Both spellings of the files: the hub's (sentence_transformers.models.X) and what 6.x saves.
    types = {json.loads((_fixture(n) / "modules.json").read_text())[1]["type"] for n in NAMES}
    assert types == {"sentence_transformers.models.Pooling",
                     "sentence_transformers.sentence_transformer.modules.pooling.Pooling"}
    versions = json.loads((PIPELINE_FIXTURES / "versions.json").read_text())
    assert set(versions["fixtures"]) == set(NAMES) and versions["sentence_transformers"]


@pytest.mark.parametrize("name", NAMES)
def test_the_export_matches_sentence_transformers_encode(name: str) -> None:
    parity = pipeline_parity(_fixture(name))
    assert parity.ids_match, parity
    assert parity.single >= MIN_COS and parity.batched >= MIN_COS, parity
    assert parity.norm_error <= NORM_TOL, parity


@pytest.mark.parametrize("name", NAMES)
def test_the_embedder_gives_encodes_vectors_and_norms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      name: str) -> None:
    """End to end as a user calls it: the folder, its default prompt, batches of mixed lengths."""
    from worker.embedder import Embedder

    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "cache"))
    texts, expected = _reference(name)
    folder = pipeline_folder(_fixture(name), tmp_path)
    with Embedder(folder, cache_bytes=0, batch_size=4) as emb:
        got = emb.embed(texts)
        normalized = emb.normalized
    assert got.shape == expected.shape
    assert cosines(got, expected).min() >= MIN_COS
    assert norm_error(got, expected) <= NORM_TOL
    # The reference itself says which: unit length exactly where the pipeline normalises.
    assert np.allclose(np.linalg.norm(expected, axis=1), 1.0, atol=1e-5) == normalized


def _without(info: ModelInfo, kind: type) -> ModelInfo:
    steps = tuple(s for s in info.pipeline.steps if not isinstance(s, kind))
    return dataclasses.replace(info, pipeline=dataclasses.replace(info.pipeline, steps=steps))


@pytest.mark.parametrize(("name", "change"), [
    ("bert-cls-normalize", lambda i: _without(i, Normalize)),
    ("mpnet-cls-dot", lambda i: dataclasses.replace(i, pipeline=dataclasses.replace(i.pipeline, steps=(Normalize(),)))),
    ("bert-mean-prompt-excluded", lambda i: dataclasses.replace(
        i, pipeline=dataclasses.replace(i.pipeline, prompt_tokens_excluded=0))),
    ("mpnet-cls-weightedmean-prompt-excluded", lambda i: dataclasses.replace(
        i, pipeline=dataclasses.replace(i.pipeline, prompt_tokens_excluded=i.pipeline.prompt_tokens_excluded - 1))),
    ("roberta-max-dense-silu", lambda i: dataclasses.replace(
        i, pipeline=dataclasses.replace(i.pipeline, pooling=Pooling(("mean",))))),
])
def test_the_check_catches_a_step_left_out_or_added(name: str, change: object) -> None:
    parity = pipeline_parity(_fixture(name), change=change)  # type: ignore[arg-type]
    assert not parity.ok, parity


def test_a_dense_layer_left_out_fails_the_check(tmp_path: Path) -> None:
    parity = pipeline_parity(_fixture("distilbert-mean-dense-tanh"), change=lambda i: _without(i, Dense))
    assert not parity.ok and parity.single == -1.0  # 32-d vectors against 24-d ones


def test_the_excluded_prompt_is_sentence_transformers_prompt_length(tmp_path: Path) -> None:
    from worker.intake.tokenize import KeywordTokenizer

    info = _info(tmp_path, "bert-mean-prompt-excluded")
    tok = KeywordTokenizer.from_model(info, prompt=Prompt.resolve(info))
    # "query: " alone is [CLS] (its pieces) [SEP]: its length less the trailing special token.
    alone = tok.encode([""])[0].ids.tolist()  # the prompt and nothing after it
    assert alone[-1] == 3 and tok.prompt_tokens == len(alone) - 1 == tok.special_tokens - 1 > 2  # 3: [SEP]
    assert info.with_prompt(tok.prompt_tokens).pipeline.prompt_tokens_excluded == tok.prompt_tokens
    assert KeywordTokenizer.from_model(info, prompt=Prompt()).prompt_tokens == 0
    # A pooling that keeps the prompt (include_prompt true, the default) is not changed by one.
    plain = ModelInfo.from_dir(default_model_dir())
    assert plain.with_prompt(5) is plain


# ------------------------------------------------------------------ what the folder says


def test_a_folder_without_modules_json_keeps_the_defaults_and_says_so() -> None:
    info = ModelInfo.from_dir(FAMILY_FIXTURES / "bert")  # config, weights, tokenizer: nothing else
    assert info.pipeline == ModulePipeline(Pooling(("mean",)), (Normalize(),), None)
    assert info.normalized and info.dim == info.hidden_size
    assert info.pipeline.describe() == "Pooling mean -> Normalize (no modules.json: the defaults, L2-normalised)"


def test_the_default_model_reads_its_modules() -> None:
    info = ModelInfo.from_dir(default_model_dir())
    assert info.pipeline.modules_path == default_model_dir() / "modules.json"
    assert info.pipeline.describe() == "Pooling mean -> Normalize" and info.dim == 384


def _editable(tmp_path: Path, name: str) -> Path:
    """A real copy of a fixture's folder (module files copied, encoder files linked)."""
    folder = tmp_path / name
    shutil.copytree(_fixture(name), folder, ignore=shutil.ignore_patterns("reference.npz", "fixture.json"))
    family = json.loads((_fixture(name) / "fixture.json").read_text())["transformer"]
    for item in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / item).symlink_to(FAMILY_FIXTURES / family / item)
    return folder


def _edit(path: Path, fn: object) -> None:
    data = json.loads(path.read_text())
    data = fn(data)  # type: ignore[operator]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(("file", "edit", "message"), [
    ("modules.json", lambda m: [*m[:2], {"idx": 2, "name": "2", "path": "2_LSTM",
                                         "type": "sentence_transformers.models.LSTM"}, *m[2:]],
     r"modules.json: module 2 \(2_LSTM\) is sentence_transformers.models.LSTM, which keyword-embedder cannot run "
     r"\(it runs sentence-transformers' Transformer, Pooling, Dense, Normalize, MLMTransformer, SpladePooling\); "
     r"refused rather than skipped"),
    ("modules.json", lambda m: [*m, {"idx": 9, "name": "9", "path": "9_X", "type": "my_package.Whitening"}],
     r"module 9 \(9_X\) is my_package.Whitening, which keyword-embedder cannot run"),
    ("modules.json", lambda m: [{**m[1], "idx": 0}, {**m[0], "idx": 1}, *m[2:]], "modules Pooling -> Transformer"),
    ("modules.json", lambda m: [{**m[0], "path": "0_Transformer"}, *m[1:]],
     "the Transformer module is in '0_Transformer'"),
    ("modules.json", lambda m: [m[0], {**m[1], "path": "../elsewhere"}, *m[2:]], "outside the model folder"),
    ("1_Pooling/config.json", lambda c: {**c, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                                         "pooling_mode_cls_token": False, "pooling_mode": "median"},
     "pooling mode 'median' is not supported"),
    ("1_Pooling/config.json", lambda c: {**c, "word_embedding_dimension": 64}, "for 64-d token embeddings"),
    ("2_Dense/config.json", lambda c: {**c, "activation_function": "torch.nn.modules.activation.Softplus"},
     "activation_function 'torch.nn.modules.activation.Softplus' is not supported"),
    ("2_Dense/config.json", lambda c: {**c, "activation_function": "my_package.Swish"}, "'my_package.Swish' is not"),
    ("2_Dense/config.json", lambda c: {**c, "in_features": 48}, "in_features 48, but the module before it gives 32"),
    ("2_Dense/config.json", lambda c: {**c, "use_residual": True}, "use_residual is not supported"),
    ("2_Dense/config.json", lambda c: {**c, "module_input_name": "token_embeddings"},
     "module_input_name 'token_embeddings' is not supported"),
])
def test_what_cannot_run_is_refused_in_one_line_naming_it(tmp_path: Path, file: str, edit: object,
                                                           message: str) -> None:
    folder = _editable(tmp_path, "roberta-max-dense-silu")
    _edit(folder / file, edit)
    with pytest.raises(ModelError, match=message) as err:
        ModelInfo.from_dir(folder)
    assert "\n" not in str(err.value)


def test_dense_weights_only_in_torch_pickle_format_are_refused(tmp_path: Path) -> None:
    folder = _editable(tmp_path, "distilbert-mean-dense-tanh")
    (folder / "2_Dense" / "model.safetensors").rename(folder / "2_Dense" / "pytorch_model.bin")
    with pytest.raises(ModelError, match=r"pytorch_model.bin: Dense weights in torch's pickle format are not read"):
        ModelInfo.from_dir(folder)


def test_legacy_pooling_flags_read_as_sentence_transformers_reads_them(tmp_path: Path) -> None:
    folder = _editable(tmp_path, "bert-cls-normalize")
    pooling = folder / "1_Pooling" / "config.json"
    _edit(pooling, lambda c: {**c, "pooling_mode_cls_token": False})  # none on: mean, as 5.x and 6.x read it
    assert ModelInfo.from_dir(folder).pooling_mode == "mean"
    _edit(pooling, lambda c: {**c, "pooling_mode_lasttoken": True, "pooling_mode_cls_token": True})
    info = ModelInfo.from_dir(folder)  # several: concatenated in sentence-transformers' order
    assert info.pooling_mode == "cls+lasttoken" and info.dim == 64


def test_max_seq_length_from_tokenizer_config_as_sentence_transformers_6_saves_it(tmp_path: Path) -> None:
    info = _info(tmp_path, "mpnet-cls-weightedmean-prompt-excluded")
    assert info.max_seq_length == 28  # tokenizer_config.json's model_max_length; sentence_bert_config has none
    folder = _editable(tmp_path / "copy", "mpnet-cls-weightedmean-prompt-excluded")
    _edit(folder / "tokenizer_config.json", lambda c: {**c, "model_max_length": 1000000000000000019884624838656})
    assert ModelInfo.from_dir(folder).max_seq_length == 128  # transformers' placeholder: the position table


# ------------------------------------------------------------------ the graph


def _float_values(model: onnx.ModelProto) -> dict[str, bool]:
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.graph.value_info, *inferred.graph.output]}
    return {n: t == onnx.TensorProto.FLOAT for n, t in types.items()}


@pytest.mark.parametrize("name", NAMES)
def test_the_fp16_anchors_are_float_nodes_of_the_head_only(tmp_path: Path, name: str) -> None:
    """An FP16 TensorRT build pins the nodes named with FP32_NODE_PREFIXES (and what follows them)
    to FP32 and only constrains float layers: every anchor is a float node of the pooling, and
    the pipeline's integer and boolean nodes (pool_index_*) are not anchors."""
    info = _info(tmp_path, name)
    from worker.intake.tokenize import KeywordTokenizer

    info = info.with_prompt(KeywordTokenizer.from_model(info, prompt=Prompt.resolve(info)).prompt_tokens)
    model = build_model(info)
    floats = _float_values(model)
    anchors = [n for n in model.graph.node if n.name.startswith(FP32_NODE_PREFIXES)]
    assert anchors and all(floats.get(n.output[0], False) for n in anchors)
    assert all(not floats.get(n.output[0], True) for n in model.graph.node if n.name.startswith("pool_index_"))
    first = next(i for i, n in enumerate(model.graph.node) if n.name.startswith(FP32_NODE_PREFIXES))
    assert all(not n.name.startswith(("encoder.", "transformer.")) for n in model.graph.node[first:])
    assert all(onnx.defs.has(n.op_type) for n in model.graph.node)  # standard operators only
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["normalize"] == ("l2" if info.normalized else "none") and meta["dim"] == str(info.dim)
    assert meta["pipeline"] == info.pipeline.describe()


def test_an_excluded_prompt_is_part_of_the_export_cache_key(tmp_path: Path) -> None:
    from engines.onnx_export.export import cache_key

    info = _info(tmp_path, "bert-mean-prompt-excluded")
    assert cache_key(info, optimize=False) != cache_key(info.with_prompt(3), optimize=False)
    assert cache_key(info.with_prompt(3), optimize=False) != cache_key(info.with_prompt(4), optimize=False)


def test_a_plan_or_a_given_onnx_file_is_refused_for_an_excluded_prompt(tmp_path: Path) -> None:
    from worker.backend_choice.select import open_backend

    info = _info(tmp_path, "bert-mean-prompt-excluded").with_prompt(3)
    with pytest.raises(BackendError, match="leaves the prompt's 3 tokens out .*which a TensorRT plan cannot"):
        open_backend("tensorrt", info)
    with pytest.raises(BackendError, match="which onnx_path /m/x.onnx cannot be checked for"):
        open_backend("onnxruntime", info, onnx_path="/m/x.onnx")


# ------------------------------------------------------------------ output of a model that does not normalise


def test_an_unnormalised_model_says_so_in_the_record_and_a_header(tmp_path: Path) -> None:
    from tests.unit.worker.formats.test_messages import schema
    from worker.formats.codec_choice import output_codec
    from worker.formats.messages import H_NORMALIZED
    from worker.settings.schema import Settings

    info = _info(tmp_path, "mpnet-cls-dot")
    assert not info.normalized and info.similarity == "dot"
    codec = output_codec(Settings(), info, Prompt())
    row = np.arange(1, 33, dtype=np.float32)
    obj = orjson.loads(codec.value("q", row, 3, False))
    schema("output").validate(obj)
    assert obj["normalized"] is False and obj["embedding"] == row.tolist()  # as computed: not rescaled
    assert codec.headers[-1] == (H_NORMALIZED, b"false")
    # output_fields can rename or drop it like any field.
    dropped = output_codec(Settings(output_fields=("-normalized",)), info, Prompt())
    assert "normalized" not in orjson.loads(dropped.value("q", row, 3, False))
    # The registry formats' records (their schemas are registered as they are) do not carry it.
    assert "normalized" not in codec.record("q", row, 3, False)


def test_truncation_keeps_the_scale_of_an_unnormalised_model(tmp_path: Path) -> None:
    from worker.formats.codec_choice import output_codec
    from worker.settings.schema import Settings

    row = np.arange(1, 33, dtype=np.float32)
    dot = output_codec(Settings(truncate_dim=8), _info(tmp_path / "a", "mpnet-cls-dot"), Prompt())
    assert orjson.loads(dot.value("q", row, 3, False))["embedding"] == row[:8].tolist()
    unit = output_codec(Settings(truncate_dim=8), _info(tmp_path / "b", "bert-cls-normalize"), Prompt())
    got = np.asarray(orjson.loads(unit.value("q", row / np.linalg.norm(row), 3, False))["embedding"])
    assert abs(np.linalg.norm(got) - 1.0) < 1e-6  # renormalised, as before


def test_int8_without_a_range_is_refused_for_an_unnormalised_model(tmp_path: Path) -> None:
    from worker.formats.codec_choice import output_codec
    from worker.settings.schema import Settings, SettingsError

    info = _info(tmp_path, "distilbert-mean-dense-tanh")
    with pytest.raises(SettingsError, match="gives vectors that are not normalised .*set int8_range"):
        output_codec(Settings(output_encoding="int8"), info, Prompt())
    codec = output_codec(Settings(output_encoding="int8", int8_range=2.0), info, Prompt())
    assert codec.int8_range == (-2.0, 2.0)
    assert output_codec(Settings(output_encoding="binary"), info, Prompt()).encoding == "binary"  # sign bits: any scale


def test_the_embedder_asks_for_an_int8_range_for_an_unnormalised_model(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.embedder import Embedder

    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "cache"))
    texts, _ = _reference("distilbert-mean-dense-tanh")
    with Embedder(pipeline_folder(_fixture("distilbert-mean-dense-tanh"), tmp_path), cache_bytes=0,
                  truncate_dim=8) as emb:
        vecs = emb.embed(texts[:3])
        full = emb.embed_encoded(emb.tokenizer.encode(texts[:3]))
        np.testing.assert_array_equal(vecs, full[:, :8])  # truncated, not renormalised
        with pytest.raises(ValueError, match="not normalised .*pass quantize"):
            emb.quantize(vecs, "int8")
        assert emb.quantize(vecs, "int8", int8_range=(-1.0, 1.0)).dtype == np.int8


def test_openvino_runs_a_pipeline_without_normalize(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph of a pipeline without Normalize ends in an Identity, which OpenVINO folds: its
    output keeps both names, and the backend found it by either (it refused every such model)."""
    pytest.importorskip("openvino")
    from worker.embedder import Embedder

    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "cache"))
    folder = _pipeline_folder(DATA / "pipelines" / "mpnet-cls-dot", tmp_path, families=DATA / "families")
    with np.load(DATA / "pipelines" / "mpnet-cls-dot" / "reference.npz") as ref:
        texts, expected = [str(t) for t in ref["texts"]], ref["vectors"]
    with Embedder(folder, backend="openvino", openvino_precision="f32", cache_bytes=0) as emb:
        got = emb.embed(texts)
    assert cosines(got, expected).min() >= MIN_COS and norm_error(got, expected) <= NORM_TOL
