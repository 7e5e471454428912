"""Did prompts and the new encodings slow the default path? main's vs this tree's hot code, paired.

The default model's ONNX graph is byte-identical to main's (same sha256), so the two pieces of
per-keyword code this change touched are what can differ: the tokenizer's encode (the prompt
prefix) and the output codec's value (truncate_dim, the optional fields). Both versions are
loaded into one process and timed alternately; the minimum of N interleaved repeats is the
figure least moved by other load on a shared box.

    git worktree add /tmp/kwe-main main   # or: git archive main | tar -x -C /tmp/kwe-main
    .venv/bin/python -m benchmarks.archive.outputs_ab --baseline-root /tmp/kwe-main \
        ../shared/data/queries/terabyte05-efficiency.tsv
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import timeit
from pathlib import Path
from types import ModuleType

import numpy as np

from worker.core.model import ModelInfo, default_model_dir
from worker.formats import messages as new_messages
from worker.formats.keyword_files import read_keywords
from worker.intake import tokenize as new_tokenize


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--baseline-root", type=Path, required=True, help="A checkout of the baseline (main).")
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    old_messages = _load("baseline_messages", args.baseline_root / "worker" / "kafka" / "messages.py")
    old_tokenize = _load("baseline_tokenize", args.baseline_root / "worker" / "tokenize.py")
    info = ModelInfo.from_dir(default_model_dir())
    texts = [t for _, t in read_keywords(args.file, limit=2000)]
    row = np.random.default_rng(0).standard_normal(info.dim).astype(np.float32)
    row /= np.linalg.norm(row)
    sides = {
        "main": (old_tokenize.KeywordTokenizer.from_model(info), old_messages.OutputCodec(info.name, info.dim, "float-list")),
        "new": (new_tokenize.KeywordTokenizer.from_model(info), new_messages.OutputCodec(info.name, info.dim, "float-list")),
    }
    best = {side: [float("inf"), float("inf")] for side in sides}
    for r in range(args.repeats):
        for side in (("main", "new") if r % 2 == 0 else ("new", "main")):
            tok, codec = sides[side]
            best[side][0] = min(best[side][0], timeit.timeit(lambda: codec.value("q-1", row, 5, False), number=2000) / 2000)
            best[side][1] = min(best[side][1], timeit.timeit(lambda: tok.encode(texts), number=1))
    for i, what in enumerate(("codec.value, one float-list record", f"tokenizer.encode, {len(texts)} queries")):
        old, new = best["main"][i], best["new"][i]
        print(f"{what}: main {old * 1e6:,.1f} us, new {new * 1e6:,.1f} us, throughput new/main {old / new:.3f} "
              f"(min of {args.repeats}, interleaved)")


if __name__ == "__main__":
    main()
