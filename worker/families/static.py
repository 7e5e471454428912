"""Static models as a family: what was verified for them, and the parity check `keyword-embedder
models --check` reruns (beside the encoder families of worker/families/dense.py).

The fixtures (tests/data/static/, made once by make_fixtures.py where model2vec and
sentence-transformers run) hold each folder's JSON files, which tokenizer it uses, and the
vectors the library's encode gave; the table comes from a formula (tests/data/static/tables.py),
so the repository holds no binary table. `static_fixture_folder` assembles the folder the library
saved, `static_parity` runs it as the worker does (its tokenizer, the static backend, padded
batches of mixed lengths) and compares row by row.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from worker.families.parity import MIN_COS, NORM_TOL

if TYPE_CHECKING:
    from worker.families import Checkout

STATIC_STATUS = (
    "static: a table of one vector per token, a text's vector the mean of its tokens' rows (no encoder)\n"
    "  formats:  model2vec folders (config.json model_type model2vec, normalize, max_length; the table under "
    "'embeddings', with 'weights' and 'mapping' where vocabulary quantization wrote them); sentence-transformers "
    "folders whose modules.json is StaticEmbedding, optionally then Normalize\n"
    "  e.g.      minishlab/potion-base-8M, potion-retrieval-32M (model2vec); static-retrieval-mrl-en-v1, "
    "static-similarity-mrl-multilingual-v1 (sentence-transformers)\n"
    "  runs:     the intake's token IDs (no special tokens), a numpy gather and mean per batch, Normalize as "
    "stated (worker/backends/static.py)\n"
    f"  fixtures: tests/data/static, vs model2vec's StaticModel.encode and sentence-transformers' encode, "
    f"cos >= {MIN_COS} and norm per row (tests/unit/worker/core/test_static.py)\n"
    "  real model: none: no PyPI package inspected ships one")


def _tables(data: Path) -> ModuleType:
    """tests/data/static/tables.py, the fixtures' table formula (a data file of the checkout)."""
    spec = importlib.util.spec_from_file_location("kwe_static_tables", data / "static" / "tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def static_fixtures(data: Path) -> list[Path]:
    """The static fixtures under `data` (a source checkout's tests/data)."""
    root = data / "static"
    return sorted(p for p in root.iterdir() if (p / "fixture.json").is_file()) if root.is_dir() else []


def tokenizer_source(name: str, data: Path) -> Path:
    """A fixture's tokenizer.json: the default model package's ("minilm") or a family fixture's."""
    if name == "minilm":
        from worker.core.model import default_model_dir

        return default_model_dir() / "tokenizer.json"
    return data / name / "tokenizer.json"


def static_fixture_folder(fixture: Path, into: Path, *, data: Path) -> Path:
    """The folder the library saved, under `into`: the fixture's JSON files, the tokenizer linked,
    the table written from the formula under the library's key."""
    from safetensors.numpy import save_file

    spec = json.loads((fixture / "fixture.json").read_text())
    tables = _tables(data)
    folder = into / fixture.name
    inner = folder / spec["module_path"]  # sentence-transformers 6.x: "" (the folder itself)
    inner.mkdir(parents=True)
    for item in fixture.iterdir():
        if item.suffix == ".json" and item.name != "fixture.json":
            os.symlink(item.resolve(), folder / item.name)
    os.symlink(tokenizer_source(spec["tokenizer"], data).resolve(), inner / "tokenizer.json")
    vectors = tables.table(spec["rows"], spec["dim"], spec["salt"])
    if spec["format"] == "sentence-transformers":
        save_file({"embedding.weight": vectors}, str(inner / "model.safetensors"))
    else:
        tensors = {"embeddings": vectors}
        if spec["weights"]:
            tensors["weights"] = tables.token_weights(spec["vocab"])
        if spec["mapping_rows"]:
            tensors["mapping"] = tables.token_mapping(spec["vocab"], spec["mapping_rows"])
        save_file(tensors, str(inner / "model.safetensors"))
    return folder


@dataclass(frozen=True)
class StaticParity:
    name: str
    pipeline: str
    rows: int
    single: float      # worst row's cosine, each text alone
    batched: float     # worst row's cosine, padded batches of mixed lengths
    norm_error: float  # worst row's |norm - reference norm| / max(reference norm, 1)
    zero_rows: int     # rows the library gives as zeros (a text of unknown tokens only), matched exactly

    @property
    def ok(self) -> bool:
        return min(self.single, self.batched) >= MIN_COS and self.norm_error <= NORM_TOL


def _cosines(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Row cosines; a reference row of zeros counts 1.0 where ours is zeros too, else -1."""
    ng, ne = np.linalg.norm(got, axis=1), np.linalg.norm(expected, axis=1)
    zero = ne == 0
    cos = np.sum(got * expected, axis=1) / np.where(zero, 1.0, ng * ne)
    return np.where(zero, np.where(ng == 0, 1.0, -1.0), cos)


def static_parity(folder: Path, reference: Path, *, name: str = "") -> StaticParity:
    """The folder as the worker runs it against the library's vectors in `reference`."""
    from worker.backends.static import StaticBackend
    from worker.batching.padding import length_batches, pad_batch
    from worker.core.model import ModelInfo
    from worker.intake.tokenize import KeywordTokenizer

    with np.load(reference) as ref:
        texts, expected = [str(t) for t in ref["texts"]], ref["vectors"].astype(np.float32)
    info = ModelInfo.from_dir(folder)
    ids = [e.ids for e in KeywordTokenizer.from_model(info).encode(texts)]
    ctx = StaticBackend(info).create_context(0)
    # A text with no token at all is dead-lettered by the intake (as for every model); the library
    # gives zeros, as the static backend gives for an empty row.
    single = np.concatenate([ctx.run(*pad_batch([row])) for row in ids])
    batched = np.zeros_like(single)
    for rows in length_batches([len(r) for r in ids], 16, 1 << 30):
        batched[rows] = ctx.run(*pad_batch([ids[i] for i in rows]))
    norms = np.linalg.norm(expected, axis=1)
    norm_error = max(float(np.max(np.abs(np.linalg.norm(x, axis=1) - norms) / np.maximum(norms, 1.0)))
                     for x in (single, batched))
    return StaticParity(name or folder.name, info.pipeline.describe(), len(texts),
                        float(_cosines(single, expected).min()), float(_cosines(batched, expected).min()),
                        norm_error, int(np.sum(norms == 0)))


def check(checkout: Checkout) -> int:
    """The static fixtures (tests/data/static) against model2vec's and sentence-transformers' vectors."""
    data = checkout.data
    found = static_fixtures(data)
    print(f"\nstatic fixtures (vs model2vec / sentence-transformers encode: worst cosine, worst norm error <= {NORM_TOL})")
    if not found:
        print(f"  skipped: no static fixtures at {data / 'static'}")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for fixture in found:
            p = static_parity(static_fixture_folder(fixture, Path(tmp), data=data), fixture / "reference.npz")
            failed += not p.ok
            print(f"  {p.name:<40} {min(p.single, p.batched):>10.7f} {p.norm_error:>9.1e}  {'ok' if p.ok else 'FAIL'}"
                  f"\n  {'':<40} {p.pipeline}")
    return failed
