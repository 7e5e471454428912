"""`keyword-embedder models`: the encoder families, what was verified for each, and the checks.

Without flags it prints what is on record (worker/families.py). `--check` reruns the checks
that need no GPU: each family's fixture export against its transformers vectors (from a source
checkout: the fixtures live in tests/data/families/) and the real models whose PyPI packages
are installed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="Rerun the checks here: fixture parity per family and pooling, and installed real models.")
    parser.add_argument("--fixtures", type=Path, default=None,
                        help="Folder of the family fixtures (default: tests/data/families in this checkout).")


def main(args: argparse.Namespace) -> int:
    from kwe_core.model import FAMILIES
    from worker.families import FAMILY_STATUS, MIN_COS, REPO_FIXTURES

    print(f"Encoder families (config.json model_type): {', '.join(FAMILIES)}; pooling mean or cls; "
          f"ONNX Runtime on CPU, TensorRT from the same ONNX graph.\n")
    for s in FAMILY_STATUS:
        print(f"{s.family}\n  e.g.        {s.examples}\n  exporter:   {s.specifics}\n"
              f"  fixture:    tiny random model vs transformers, cos >= {MIN_COS} per row, mean and cls, "
              f"padded batches (tests/test_families.py)\n  real model: {s.real_model}\n  TensorRT:   {s.tensorrt}")
    if not args.check:
        print("\nRerun the checks: keyword-embedder models --check")
        return 0
    return _check(args.fixtures or REPO_FIXTURES)


def _check(fixtures: Path) -> int:
    import numpy as np

    from kwe_core.model import FAMILIES, ModelNotFoundError
    from worker.families import MIN_COS, assemble_split_model, cosines, fixture_parity

    failed = 0
    print("\nfixture parity (worst row's cosine vs transformers)")
    if not (fixtures / "versions.json").is_file():
        print(f"  skipped: no fixtures at {fixtures} (they ship with a source checkout; pass --fixtures DIR)")
    else:
        print(f"  {'family':<12} {'pooling':<8} {'alone':>10} {'batched':>10}")
        for family in FAMILIES:
            for pooling in ("mean", "cls"):
                p = fixture_parity(fixtures / family, pooling)
                failed += not p.ok
                print(f"  {family:<12} {pooling:<8} {p.single:>10.7f} {p.batched:>10.7f}  {'ok' if p.ok else 'FAIL'}")
    print("\nreal models")
    cache = Path(os.environ.get("KWE_CACHE_DIR") or Path.home() / ".cache" / "keyword-embedder") / "models"
    try:
        folder = assemble_split_model(cache)
    except ModelNotFoundError as exc:
        print(f"  all-mpnet-base-v2: skipped ({exc})")
    else:
        from worker.embedder import Embedder

        ref_file = fixtures / "real-all-mpnet-base-v2.npz"
        if not ref_file.is_file():
            print(f"  all-mpnet-base-v2: skipped (no reference vectors at {ref_file})")
        else:
            with np.load(ref_file) as ref:
                texts, expected = [str(t) for t in ref["texts"]], ref["vectors"].astype(np.float32)
            with Embedder(folder, cache_bytes=0) as emb:
                worst = float(cosines(emb.embed(texts), expected).min())
            failed += worst < MIN_COS
            print(f"  all-mpnet-base-v2 ({folder}): worst of {len(texts)} rows {worst:.7f} vs sentence-transformers  "
                  f"{'ok' if worst >= MIN_COS else 'FAIL'}")
    print(f"  all-MiniLM-L6-v2: tests/test_parity.py (golden vectors)")
    if failed:
        print(f"\n{failed} check(s) below cos {MIN_COS}", file=sys.stderr)
    return 1 if failed else 0
