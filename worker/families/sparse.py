"""Sparse (SPLADE) models as a family: each fixture (tests/data/sparse/, made once by SparseEncoder)
assembled in each pooling variant and run as the worker runs it, against its non-zero entries."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from worker.core.model import ModelInfo
from worker.core.sparse import SparseMatch, SparseRows

if TYPE_CHECKING:
    from worker.families import Checkout


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


def check(checkout: Checkout) -> int:
    """Each sparse fixture in every SPLADE variant against SparseEncoder's entries: failures."""
    root = checkout.data / "sparse"
    found = sparse_fixtures(root) if checkout.has_fixtures else []
    print("\nsparse fixtures (vs SparseEncoder's encode: worst entry, as a share of its tolerance <= 1)")
    if not found:
        print(f"  skipped: no sparse fixtures at {root}")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for fixture in found:
            for variant in SPARSE_VARIANTS:
                folder = sparse_fixture_folder(fixture, Path(tmp), families=checkout.fixtures, variant=variant)
                sp = sparse_parity(folder, fixture / f"reference-{variant}.npz", name=f"{fixture.name} {variant}")
                failed += not sp.ok
                print(f"  {sp.name:<40} {max(sp.single.worst, sp.batched.worst):>10.3f}  "
                      f"{'ok' if sp.ok else 'FAIL' + ('' if sp.ids_match else ' (token IDs differ)')}")
    return failed
