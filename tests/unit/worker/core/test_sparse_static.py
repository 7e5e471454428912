"""The inference-free sparse model (worker/core/sparse_static.py): a Router saved by sentence-
transformers 6.3 (tests/data/sparse/router-bert, made by make_router_fixture.py) against what its
SparseEncoder.encode_query and encode_document gave, and what such a folder cannot be."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from worker.core.errors import ModelError
from worker.core.model import ModelInfo
from worker.core.sparse import SparseRows, compare
from worker.core.sparse_static import presence_weights
from tests.conftest import DATA

SPARSE = DATA / "sparse"
ROUTER = SPARSE / "router-bert"
REF = SPARSE / "router-bert-reference.npz"
WEIGHTS = ROUTER / "query_0_SparseStaticEmbedding" / "model.safetensors"


def _reference(route: str) -> tuple[list[str], SparseRows]:
    ref = np.load(REF)
    rows = SparseRows(ref[f"{route}_indices"], ref[f"{route}_values"], ref[f"{route}_offsets"], 320)
    return [str(t) for t in ref["texts"]], rows


def _query_rows(folder: Path, texts: list[str]) -> SparseRows:
    from worker import Embedder

    with Embedder(folder, batch_size=8) as emb:
        assert emb.sparse and emb.info.dim == 320 and emb.backend.name == "static"
        return emb.embed_sparse(texts)


def _same(got: SparseRows, want: SparseRows) -> tuple[bool, float]:
    """The goal: the same indices, each weight within 1e-4 relative."""
    same_indices = np.array_equal(got.offsets, want.offsets) and np.array_equal(got.indices, want.indices)
    rel = float(np.max(np.abs(got.values - want.values) / np.abs(want.values))) if same_indices else np.inf
    return same_indices and rel <= 1e-4, rel


def test_the_query_route_gives_encode_querys_indices_and_weights(tmp_path: Path) -> None:
    texts, want = _reference("query")
    got = _query_rows(ROUTER, texts)
    ok, rel = _same(got, want)
    assert ok and rel == 0.0  # float32 weights looked up: bit for bit
    # The check can fail: one token's weight off by 2e-4 relative.
    folder = tmp_path / "m"
    shutil.copytree(ROUTER, folder)
    weight = load_file(str(WEIGHTS))["weight"]
    token = int(want.indices[0])
    weight[token] *= np.float32(1 + 2e-4)
    save_file({"weight": weight}, str(folder / WEIGHTS.relative_to(ROUTER)))
    ok, rel = _same(_query_rows(folder, texts), want)
    assert not ok and 1.5e-4 < rel < 3e-4


def test_a_repeated_token_counts_once_and_the_cut_is_model_max_length() -> None:
    weight = load_file(str(WEIGHTS))["weight"]
    info = ModelInfo.from_dir(ROUTER)
    assert info.sparse and info.static is not None and info.max_seq_length == 12  # tokenizer_config.json
    from worker.intake.tokenize import KeywordTokenizer

    tok = KeywordTokenizer.from_model(info)
    ids = tok.encode(["a a a the the"])[0].ids
    assert len(ids) == 5 and len(set(ids.tolist())) == 2
    rows = _query_rows(ROUTER, ["a a a the the", "a the"])
    assert np.array_equal(rows[0].values, rows[1].values)
    assert np.array_equal(rows[0].values, weight[np.sort(np.unique(ids))][weight[np.sort(np.unique(ids))] != 0])
    # The scatter itself: padding points at the extra zero entry; weights of absent tokens stay 0.
    w = np.array([0.5, 2.0, 0.0, 3.0, 0.0], dtype=np.float32)  # 4 tokens, then the pad entry
    out = presence_weights(w, np.array([[1, 1, 3], [2, 0, 0]]), np.array([[1, 1, 1], [1, 0, 0]]))
    assert out.tolist() == [[0.0, 2.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0]]


def test_the_document_route_is_the_mlm_and_splade_pooling() -> None:
    from worker import Embedder

    texts, want = _reference("document")
    with Embedder(ROUTER, sparse_route="document", backend="onnxruntime") as emb:
        assert emb.info.pipeline.sparse is not None and emb.info.static is None
        got = emb.embed_sparse(texts)
    match = compare(got, want)
    assert match.ok and match.support_differs == 0, match.line()
    # The query route's rows are not the document route's: the setting does pick the route.
    assert not compare(_query_rows(ROUTER, texts), want).ok


def test_the_setting_picks_the_route_and_the_fingerprint_differs() -> None:
    from worker.backend_choice.select import model_info
    from worker.settings.schema import Settings

    query = model_info(Settings(model_dir=str(ROUTER)))
    document = model_info(Settings(model_dir=str(ROUTER), sparse_route="document"))
    assert query.static is not None and query.pipeline.describe().startswith("Router query route")
    assert document.static is None and document.weights_path.parent.name == "document_0_Transformer"
    with pytest.raises(Exception, match="sparse_route"):
        Settings(model_dir=str(ROUTER), sparse_route="both")


def _router(tmp_path: Path) -> Path:
    folder = tmp_path / "m"
    shutil.copytree(ROUTER, folder)
    return folder


def _edit_config(folder: Path, change) -> None:  # type: ignore[no-untyped-def]
    path = folder / "router_config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda f: _edit_config(f, lambda c: c["structure"].pop("query")), "no 'query' route"),
    (lambda f: _edit_config(f, lambda c: c["structure"].update(query=["document_0_Transformer"])),
     "the query route is Transformer; the worker runs a query route of one SparseStaticEmbedding"),
    (lambda f: _edit_config(f, lambda c: c["structure"].update(query=["../x"])), "leaves the model folder"),
    (lambda f: save_file({"weight": np.ones(100, np.float32)}, str(f / WEIGHTS.relative_to(ROUTER))),
     "100 weights for a tokenizer of 320 tokens"),
    (lambda f: (f / "modules.json").write_text(json.dumps(json.loads((f / "modules.json").read_text()) * 2)),
     "a Router runs here as the model's only module"),
])
def test_what_a_router_folder_cannot_run_is_refused_by_name(tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    folder = _router(tmp_path)
    edit(folder)
    with pytest.raises(ModelError, match=message):
        ModelInfo.from_dir(folder)
