"""The benchmark's one error type."""

from __future__ import annotations

from worker.core.errors import KeywordEmbedderError


class BenchError(KeywordEmbedderError, RuntimeError):
    """The benchmark cannot run (bad input file, incomplete run); the message says why."""
