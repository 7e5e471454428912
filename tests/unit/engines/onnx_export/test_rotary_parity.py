"""The rotary families against sentence-transformers: every row of every fixture in
tests/data/families-st/ (whole sentence-transformers folders and the vectors `encode` gave,
made once by make_fixtures.py there), on ONNX Runtime and OpenVINO, each text alone, all in one
right-padded batch of mixed lengths, and in the Embedder's length batches; every prompt case;
texts several times the sliding windows. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from worker.core.model import ModelInfo
from worker.families.parity import MIN_COS, cosines
from worker.families.rotary import ST_NORM_TOL, cases, st_fixtures, st_parity
from tests.conftest import ROOT

FIXTURES = ROOT / "tests" / "data" / "families-st"
FOUND = st_fixtures(FIXTURES)
CASES = [(f, c) for f in FOUND for c in cases(f)]


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "cache"))


def test_every_rotary_family_has_fixtures_in_both_spellings() -> None:
    made = {(json.loads((f / "fixture.json").read_text())["family"], json.loads((f / "fixture.json").read_text())["style"])
            for f in FOUND}
    assert made == {(fam, style) for fam in ("qwen3", "gemma3_text", "modernbert") for style in ("st6", "hub")}
    versions = json.loads((FIXTURES / "versions.json").read_text())
    assert {"torch", "transformers", "sentence_transformers"} <= set(versions)


@pytest.mark.parametrize(("fixture", "case"), CASES, ids=[f"{f.name}-{c}" for f, c in CASES])
@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_every_row_matches_sentence_transformers(fixture: Path, case: str, backend: str) -> None:
    p = st_parity(fixture, case, backend=backend, openvino_precision="f32")
    assert p.ids_match, p
    assert p.alone >= MIN_COS and p.batched >= MIN_COS and p.bucketed >= MIN_COS, p
    assert p.norm_error <= ST_NORM_TOL, p


def test_the_fixtures_hold_texts_longer_than_every_sliding_window() -> None:
    for fixture in FOUND:
        info = ModelInfo.from_dir(fixture)
        radius = info.rotary.window_radius
        with np.load(fixture / "reference.npz") as ref:
            longest = int(np.diff(ref["default_offsets"]).max())
        if radius:
            assert longest > 3 * (2 * radius + 1), (fixture.name, longest, radius)


@pytest.mark.parametrize("name", ["gemma3-mean-dense", "modernbert-cls"])
def test_the_check_fails_with_the_window_off_by_one(name: str) -> None:
    """The window as transformers reads it, one wider, misses the reference: the fixtures can tell."""
    fixture = FIXTURES / name
    info = ModelInfo.from_dir(fixture)
    wider = dataclasses.replace(info, rotary=dataclasses.replace(info.rotary, window_radius=info.rotary.window_radius + 1))
    assert _worst_alone(fixture, wider) < MIN_COS


def test_matryoshka_truncation_keeps_sentence_transformers_direction() -> None:
    from worker.embedder import Embedder

    fixture = FIXTURES / "qwen3-lasttoken-right-hub"
    with np.load(fixture / "reference.npz") as ref:
        texts, dim, expected = [str(t) for t in ref["texts"]], int(ref["truncate_dim"]), ref["default_truncated"]
    with Embedder(fixture, backend="onnxruntime", truncate_dim=dim, cache_bytes=0) as emb:
        got = emb.embed(texts)
    assert got.shape == expected.shape
    # sentence-transformers truncates after Normalize; the worker renormalises (docs/models.md).
    assert cosines(got, expected).min() >= MIN_COS
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def _worst_alone(fixture: Path, info: ModelInfo) -> float:
    import onnxruntime as ort

    from engines.onnx_export.export import build_model
    from engines.onnx_export.graph import INPUT_NAMES
    from worker.batching.padding import pad_batch

    with np.load(fixture / "reference.npz") as ref:
        offsets = ref["default_offsets"]
        ids = [ref["default_ids"][offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
        single = ref["default_single"]
    sess = ort.InferenceSession(build_model(info).SerializeToString(), providers=["CPUExecutionProvider"])
    got = np.concatenate([sess.run(None, dict(zip(INPUT_NAMES, pad_batch([r]))))[0] for r in ids])
    return float(cosines(got, single).min())
