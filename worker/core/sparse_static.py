"""The inference-free sparse model (OpenSearch's neural-sparse doc-v2/v3 shape): a SparseEncoder
whose only module is a Router (router_config.json) sending queries to a SparseStaticEmbedding and
documents to an MLM Transformer + SpladePooling.

The query route runs no encoder. sentence-transformers 6.3 (sparse_static_embedding.py):

- `preprocess`: the HF tokenizer with padding=True, truncation=True (at its model_max_length, from
  tokenizer_config.json; none stated: no cut) and add_special_tokens=False;
- `forward`: the attention mask scattered into a [B, vocab] presence matrix (a token repeated in a
  text counts once), times `weight` (model.safetensors, one float per token). Nothing follows it:
  no pooling, no activation; SparseEncoder keeps the non-zero entries.

So a query's vector is {token: weight[token]} over its distinct tokens, and the worker writes it
as any sparse model's ({"indices", "values"}, worker/core/sparse.py). The `sparse_route` setting
picks the route: "query" (the default: keywords are queries) runs this lookup, through the static
model machinery (worker/core/static.py: a StaticSpec of format "sparse-static", the intake's
tokens without special tokens, the static backend); "document" runs the document route's MLM and
SpladePooling as any SPLADE model (the Transformer's sub-folder is the encoder).

Nothing here imports torch or tokenizers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import numpy as np

from worker.core.errors import ModelError
from worker.core.st_pipeline import read_json

if TYPE_CHECKING:
    from worker.core.static import StaticSpec

__all__ = ["ROUTES", "Route", "RouterSpec", "document_info", "presence_weights", "query_spec", "read_router"]

Route = Literal["query", "document"]
ROUTES: tuple[str, ...] = ("query", "document")
_ROUTER = "Router"
_QUERY_MODULE = "SparseStaticEmbedding"
# transformers' VERY_LARGE_INTEGER and anything like it: the tokenizer states no cut.
_NO_CUT = 10**9


@dataclass(frozen=True)
class RouterSpec:
    """A Router folder's two routes: each a list of (module folder, module class name)."""

    model_dir: Path
    config_path: Path  # router_config.json
    query: tuple[tuple[Path, str], ...]
    document: tuple[tuple[Path, str], ...]


def read_router(model_dir: Path) -> RouterSpec | None:
    """The folder's Router, or None where modules.json does not list one (ModelError where it is
    one this worker cannot run: more modules beside it, a route missing)."""
    modules = model_dir / "modules.json"
    if not modules.is_file():
        return None
    raw = read_json(modules)
    if not isinstance(raw, list) or not any(isinstance(m, dict) and _name(m.get("type")) == _ROUTER for m in raw):
        return None
    if len(raw) != 1:
        kinds = ", ".join(_name(m.get("type")) for m in raw if isinstance(m, dict))
        raise ModelError(f"{modules}: a Router runs here as the model's only module (the inference-free sparse "
                         f"model); this one lists {kinds}")
    folder = model_dir / str(raw[0].get("path", ""))
    config_path = folder / "router_config.json"
    cfg = read_json(config_path)
    types, structure = cfg.get("types") if isinstance(cfg, dict) else None, cfg.get("structure") if isinstance(cfg, dict) else None
    if not isinstance(types, dict) or not isinstance(structure, dict):
        raise ModelError(f"{config_path}: expected 'types' and 'structure' (sentence-transformers' Router.save)")
    routes: dict[str, tuple[tuple[Path, str], ...]] = {}
    for route in ROUTES:
        ids = structure.get(route)
        if not isinstance(ids, list) or not ids:
            raise ModelError(f"{config_path}: no {route!r} route (routes: {', '.join(map(str, structure)) or 'none'}); "
                             f"the inference-free sparse model has a query and a document route")
        entries = []
        for module_id in ids:
            sub = (folder / str(module_id)).resolve()
            if not sub.is_relative_to(model_dir.resolve()):
                raise ModelError(f"{config_path}: module {module_id!r} leaves the model folder")
            entries.append((sub, _name(types.get(module_id))))
        routes[route] = tuple(entries)
    return RouterSpec(model_dir, config_path, routes["query"], routes["document"])


def query_spec(router: RouterSpec) -> StaticSpec:
    """The query route as a static spec of format "sparse-static": one weight per token, no mean."""
    from worker.core.static import StaticSpec, _tensor_shapes, _vocab_size

    kinds = [kind for _, kind in router.query]
    if kinds != [_QUERY_MODULE]:
        raise ModelError(f"{router.config_path}: the query route is {' -> '.join(kinds)}; the worker runs a query "
                         f"route of one SparseStaticEmbedding (set sparse_route = \"document\" for the other)")
    folder = router.query[0][0]
    weights, tokenizer = folder / "model.safetensors", folder / "tokenizer.json"
    for required in (weights, tokenizer):
        if not required.is_file():
            raise ModelError(f"{required}: file not found (needed by the SparseStaticEmbedding query route)")
    config = folder / "config.json"
    if config.is_file() and isinstance(path := read_json(config).get("path"), str) and path.endswith(".json"):
        raise ModelError(f"{config}: weights from an IDF JSON file ({path}) are not read here; save the module "
                         f"with sentence-transformers (model.safetensors) first")
    shape = _tensor_shapes(weights).get("weight")
    if shape is None or len(shape) != 1 or shape[0] < 1:
        raise ModelError(f"{weights}: expected a 'weight' vector (one float per token), got {shape!r}")
    vocab = _vocab_size(read_json(tokenizer))
    if shape[0] < vocab:
        raise ModelError(f"{weights}: {shape[0]:,} weights for a tokenizer of {vocab:,} tokens")
    cut = _model_max_length(folder / "tokenizer_config.json")
    from worker.core.static import STATIC_MAX_TOKENS

    return StaticSpec("sparse-static", weights, tokenizer, router.config_path, "weight", int(shape[0]),
                      int(shape[0]), vocab, False, cut or STATIC_MAX_TOKENS, cut is not None, None, False, False)


class EncoderInfo(Protocol):
    """A ModelInfo (worker/core/model.py) as far as the document route reads it: no import of that
    module here, not even for the type, since it imports this one."""

    vocab_size: int


Info = TypeVar("Info", bound=EncoderInfo)


def document_info(router: RouterSpec, read_encoder: Callable[[Path], Info]) -> Info:
    """The document route as a SPLADE ModelInfo: the Transformer's sub-folder is the encoder, read by
    `read_encoder` (ModelInfo.from_dir, which dispatches here: passed in so this module stays below
    worker/core/model.py), the SpladePooling's config its pooling (worker/core/st_pipeline.py's reading of both)."""
    from worker.core.st_pipeline import _sparse_pipeline

    kinds = [kind for _, kind in router.document]
    if kinds not in (["Transformer", "SpladePooling"], ["MLMTransformer", "SpladePooling"]):
        raise ModelError(f"{router.config_path}: the document route is {' -> '.join(kinds)}; the worker runs an MLM "
                         f"Transformer and SpladePooling there")
    encoder, pooling = router.document[0][0], router.document[1][0]
    info = read_encoder(encoder)
    entries: list[dict[str, Any]] = [{"path": ""}, {"path": str(pooling.relative_to(encoder.parent.resolve()))}]
    pipeline = _sparse_pipeline(encoder.parent.resolve(), router.config_path, entries,
                                ["MLMTransformer", "SpladePooling"], info.vocab_size)
    return dataclasses.replace(info, name=router.model_dir.name, pipeline=pipeline)  # type: ignore[type-var]


def presence_weights(weight: np.ndarray, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """[B, L] ids and mask in, [B, V] float32 out: weight[t] where token t is in the row (once,
    however often it is), else 0. `weight` has V + 1 entries, the last 0 (where padding points)."""
    pad = len(weight) - 1
    ids = np.where(attention_mask != 0, input_ids, pad)
    out = np.zeros((ids.shape[0], len(weight)), dtype=np.float32)
    out[np.arange(ids.shape[0])[:, None], ids] = weight.take(ids)
    return out[:, :pad]


def _model_max_length(path: Path) -> int | None:
    if not path.is_file():
        return None
    value = read_json(path).get("model_max_length")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < _NO_CUT:
        return int(value)
    return None


def _name(type_name: object) -> str:
    return str(type_name or "").rsplit(".", 1)[-1]
