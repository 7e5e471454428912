"""The rotary families' fixtures (tests/data/families-st/): whole sentence-transformers folders,
each with the vectors sentence-transformers' `encode` gave (made once by make_fixtures.py there),
and the check that reruns them through the worker's own path on a CPU backend.

Each fixture's reference.npz holds, per prompt case ("default" and each named prompt), the token
IDs encode fed the model, its vectors one text at a time (`{case}_single`) and in one padded
batch (`{case}_vectors`). The single vectors are the reference: a text's vector here must not
depend on its batch, and with left padding (Qwen3-Embedding's tokenizer pads left) transformers'
own batched vectors move a little, since its positions count the padding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from worker.families.parity import MIN_COS, cosines, norm_error

if TYPE_CHECKING:
    from worker.families import Checkout

# Norms where the pipeline does not normalise: float32 sums in another order, well inside this.
ST_NORM_TOL = 1e-3


@dataclass(frozen=True)
class StParity:
    name: str
    backend: str      # "onnxruntime" or "openvino/f32", "openvino/bf16"
    case: str         # "default" or a prompt name
    ids_match: bool   # our token IDs (prompt, truncation, end-of-text token) are encode's
    alone: float      # worst row's cosine to encode's single vectors, each text alone
    batched: float    # the same, every text in one right-padded batch of mixed lengths
    bucketed: float   # the same, through the Embedder's length batches
    norm_error: float  # worst |norm / reference norm - 1| (0 where the pipeline normalises: not checked)
    st_batched: float  # encode's own batched vectors against its single ones (its padding error)

    @property
    def worst(self) -> float:
        return min(self.alone, self.batched, self.bucketed)

    @property
    def ok(self) -> bool:
        return self.ids_match and self.worst >= MIN_COS and self.norm_error <= ST_NORM_TOL

    def line(self) -> str:
        return (f"{self.name:<28} {self.backend:<14} {self.case:<10} {self.worst:>10.7f} {self.norm_error:>9.1e}  "
                f"{'ok' if self.ok else 'FAIL' + ('' if self.ids_match else ' (token IDs differ)')}")


def st_fixtures(root: Path) -> list[Path]:
    """The fixtures under `root` (a source checkout's tests/data/families-st)."""
    return sorted(p for p in root.iterdir() if (p / "fixture.json").is_file()) if root.is_dir() else []


def cases(fixture: Path) -> list[str]:
    return list(json.loads((fixture / "fixture.json").read_text())["cases"])


def st_parity(fixture: Path, case: str = "default", *, backend: str = "onnxruntime",
              openvino_precision: str = "f32") -> StParity:
    """The fixture's folder through the Embedder (tokenizer, prompt, export, `backend`) against
    encode's vectors for `case`: each text alone, all in one padded batch, in length batches."""
    from worker.batching.padding import pad_batch
    from worker.core.model import PROMPT_AUTO
    from worker.embedder import Embedder

    with np.load(fixture / "reference.npz") as ref:
        offsets = ref[f"{case}_offsets"]
        ids = [ref[f"{case}_ids"][offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
        texts = [str(t) for t in ref["texts"]]
        single, st_batched = ref[f"{case}_single"], ref[f"{case}_vectors"]
    label = backend if backend == "onnxruntime" else f"{backend}/{openvino_precision}"
    with Embedder(fixture, backend=backend, openvino_precision=openvino_precision, cache_bytes=0,  # type: ignore[arg-type]
                  prompt_name=PROMPT_AUTO if case == "default" else case) as emb:
        encoded = emb.tokenizer.encode(texts)
        ours = [e.ids for e in encoded]
        ids_match = len(ours) == len(ids) and all(map(np.array_equal, ours, ids))
        run = emb._context.run  # noqa: SLF001 - the Embedder's own backend context, unbatched
        alone = np.concatenate([run(*pad_batch([row])) for row in ours])
        batched = run(*pad_batch(ours))
        bucketed = emb.embed_encoded(encoded)
        normalized = emb.normalized
    got = (alone, batched, bucketed)
    norms = 0.0 if normalized else max(norm_error(v, single) for v in got)
    return StParity(fixture.name, label, case, ids_match, *(float(cosines(v, single).min()) for v in got),
                    norms, float(cosines(st_batched, single).min()))


def check(checkout: Checkout) -> int:
    """The rotary families' fixtures (whole sentence-transformers folders) on ONNX Runtime: failures."""
    root = checkout.data / "families-st"
    found = st_fixtures(root)
    print(f"\nrotary family fixtures (vs sentence-transformers' encode: worst cosine of alone, batched and "
          f"bucketed runs, worst |norm ratio - 1| <= {ST_NORM_TOL} where not normalised)")
    if not found:
        print(f"  skipped: no fixtures at {root}")
    failed = 0
    for fixture in found:  # each export is cached like the worker's
        for case in cases(fixture):
            p = st_parity(fixture, case)
            failed += not p.ok
            print(f"  {p.line()}")
    return failed
