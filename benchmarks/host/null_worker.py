"""`keyword-embedder run` with the model taken out: every batch is answered with unit vectors
(benchmarks/host/doubles.py's NullBackend), so what the worker process spends is its own cost:
intake, batching, output, delivery and librdkafka's threads. For benchmarks/host/kafka_cpu.py;
no setting selects it, so no user can run it by mistake.

    python -m benchmarks.host.null_worker run --backend onnxruntime --bootstrap-servers ... [run's flags]

The ONNX Runtime backend is opened as usual (its profile and settings), then replaced. Imports only
what an older checkout has too, so the same file measures a baseline.
"""

from __future__ import annotations

import sys
from typing import Any

from .doubles import NullBackend


def main(argv: list[str] | None = None) -> int:
    from worker.backend_choice import select
    from worker.cli import main as cli_main

    def null_backend(kind: Any, model: Any, profile: Any = None, **_: Any) -> NullBackend:
        return NullBackend(model.dim)

    select.open_backend = null_backend  # type: ignore[assignment]
    return cli_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
