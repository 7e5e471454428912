"""A static model folder shaped like model2vec's potion-base-8M, for the host-path benchmark: the
default model's BERT tokenizer (30,522 tokens, potion's own is BERT uncased's too), a 256-d
table (random, seeded: the cost does not depend on the values), normalize true, model2vec's
default max_length. No network, no model2vec needed.

    python -m benchmarks.host.static_model /tmp/potion-shaped
    python -m benchmarks.host.pipeline_bench --rounds 8 -n 150000 --backend auto --against-backend null \\
        --setting model_dir=/tmp/potion-shaped
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np


def make(folder: Path, dim: int = 256) -> Path:
    from safetensors.numpy import save_file

    from worker.core.model import default_model_dir

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = default_model_dir() / "tokenizer.json"
    shutil.copyfile(tokenizer, folder / "tokenizer.json")
    rows = json.loads(tokenizer.read_text(encoding="utf-8"))["model"]["vocab"]
    table = np.random.default_rng(59).standard_normal((len(rows), dim)).astype(np.float32)
    save_file({"embeddings": table}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "model2vec", "normalize": True,
                                                    "hidden_dim": dim}, indent=1) + "\n")
    (folder / "README.md").write_text("# potion-shaped\n\nA random 256-d model2vec table over the BERT uncased "
                                      "tokenizer (benchmarks/host/static_model.py).\n")
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args()
    print(make(args.folder, args.dim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
