"""Where a batch's time goes on the GPU (PyTorch eager): per-shape forward time, with and without copies.

Runs the worker's torch backend (worker/backends/torch_cuda.py) in eager mode on .device/model,
with one 256 x 256 bucket so that every shape below has a context.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.gpu.torch_backend import TorchBertBackend

ROOT = Path(__file__).resolve().parents[2]
from benchmarks.gpu.device_bench import torch_backend


def timed(fn, n: int = 30) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1000


def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    rows = []
    be = torch_backend(graphs=False)
    ctx = be.create_context(0)
    for b, L in [(256, 8), (128, 16), (64, 32), (32, 64), (256, 16), (256, 32), (256, 64), (16, 8), (1, 8)]:
        ids = np.random.randint(1000, 2000, size=(b, L)).astype(np.int64)
        mask = np.ones((b, L), dtype=np.int64)
        dids, dmask = torch.from_numpy(ids).cuda(), torch.from_numpy(mask).cuda()
        with torch.inference_mode():
            fwd = timed(lambda: be._forward(dids, dmask))
        full = timed(lambda: ctx.run(ids, mask))
        rows.append({"pin": True, "batch": b, "len": L, "forward_ms": round(fwd, 3), "run_ms": round(full, 3),
                     "tokens_per_s_run": round(b * L / full * 1000)})
        print(rows[-1], flush=True)
    ctx.close()
    be.close()
    (out / "torch-probe.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
