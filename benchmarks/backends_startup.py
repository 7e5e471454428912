"""Start-up cost of backend=auto: choose_cpu on a cold cache (no cached choice, no compiled OpenVINO blobs; the ONNX
export copied in, it is not part of the choice) and then warm, 3 rounds.

    flock /tmp/kwe-bench.lock .venv/bin/python -m benchmarks.backends_startup > benchmarks/results/backends/backends_startup.json
"""
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from engines.onnx_export.export import ensure_onnx
from worker.backend_choice.select import choose_cpu, model_info
from worker.settings.schema import Settings


def main() -> int:
    onnx = ensure_onnx()  # the export is not part of the calibration
    s = Settings(); m = model_info(s)
    rows = []
    for r in range(3):
        root = Path(tempfile.mkdtemp())
        os.environ["KWE_CACHE_DIR"] = str(root)
        (root / "onnx").mkdir(); shutil.copytree(onnx.parent, root / "onnx", dirs_exist_ok=True)
        for kind in ("cold", "warm"):
            t0 = time.perf_counter(); c, b = choose_cpu(s, m, threads=1); dt = time.perf_counter() - t0
            ctx = b.create_context(0); ctx.close(); b.close()
            rows.append({"round": r, "cache": kind, "seconds": round(dt, 3), "choice": c.candidate.label,
                         "cached": c.cached})
            print(rows[-1], file=sys.stderr, flush=True)
        shutil.rmtree(root)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
