"""Errors shared by the layers above: raised by the engine build and the runtime backends alike."""

from __future__ import annotations


class BackendError(RuntimeError):
    """The backend cannot be loaded or cannot run a batch; the message says which and why."""
