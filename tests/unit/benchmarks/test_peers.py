"""benchmarks/peers.py's pieces that need no FastEmbed, and the peers extra staying optional."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import numpy as np

from worker.batching.padding import pad_batch
from tests.conftest import ROOT



def test_peers_extra_is_optional_and_never_imported_by_the_worker() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("fastembed") for d in meta["optional-dependencies"]["peers"])
    core = " ".join(meta["dependencies"] + meta["optional-dependencies"]["dev"]).lower()
    assert "fastembed" not in core
    for folder in ("worker", "engines"):
        for path in (ROOT / folder).rglob("*.py"):
            assert not re.search(r"^\s*(from|import) fastembed", path.read_text(encoding="utf-8"), re.M), path
    for dockerfile in (ROOT / "deploy" / "docker").glob("Dockerfile*"):
        assert "peers" not in dockerfile.read_text(encoding="utf-8"), dockerfile


def test_graph_cut_before_pooling_returns_the_last_hidden_state(tmp_path: Path) -> None:
    import onnxruntime as ort

    from benchmarks.peers import cut_before_pooling, fastembed_folder
    from engines.onnx_export.export import ensure_onnx
    from worker.core.model import default_model_dir
    from worker import Embedder

    texts = ["cheap flights", "how to treat a headache without medication", "a"]
    # The graph cut is of the ONNX Runtime export: compared with ONNX Runtime's vectors, not auto's choice.
    with Embedder(cache_bytes=0, backend="onnxruntime") as emb:
        ref = emb.embed(texts)
        ids, mask = pad_batch([e.ids for e in emb.tokenizer.encode(texts)], 12)
    cut = cut_before_pooling(ensure_onnx(), tmp_path / "cut.onnx")
    sess = ort.InferenceSession(str(cut), providers=["CPUExecutionProvider"])
    assert [o.name for o in sess.get_outputs()] == ["last_hidden_state"]
    (hidden,) = sess.run(None, {"input_ids": ids, "attention_mask": mask})
    assert hidden.shape == (3, 12, 384)
    # FastEmbed's mean pooling and normalisation on top give our vectors back.
    m = mask[..., None].astype(np.float32)
    pooled = (hidden * m).sum(1) / m.sum(1)
    pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
    assert ((pooled * ref).sum(1) >= 0.99999).all()
    folder = fastembed_folder(default_model_dir(), ensure_onnx(), tmp_path / "fe", 256)
    assert {"model.onnx", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {
        p.name for p in folder.iterdir()}
    assert '"model_max_length": 256' in (folder / "tokenizer_config.json").read_text()
