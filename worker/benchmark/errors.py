"""The benchmark's one error type."""

from __future__ import annotations


class BenchError(RuntimeError):
    """The benchmark cannot run (bad input file, incomplete run); the message says why."""
