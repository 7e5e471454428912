"""keyword-embedder: a streaming Kafka worker that embeds search keywords.

`from worker import Embedder` gives the offline API; `keyword-embedder run` the worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Embedder", "__version__"]

if TYPE_CHECKING:
    from worker.embedder import Embedder


def __getattr__(name: str) -> Any:
    # Lazy: `keyword-embedder --help` must not pay for onnxruntime's import.
    if name == "Embedder":
        from worker.embedder import Embedder

        return Embedder
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
