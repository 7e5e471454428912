"""The worker's exception root.

Everything that stops the worker on purpose is a `WorkerError`: its message is the one line
the user reads (which topic, which setting, what failed), so it is written for them.
"""

from __future__ import annotations

from worker.core.errors import KeywordEmbedderError


class WorkerError(KeywordEmbedderError, RuntimeError):
    """The worker cannot go on; the message says why."""


class DeliveryError(WorkerError):
    """The broker refused, or never acknowledged, a record: nothing past it may be committed."""


class BackendBrokenError(WorkerError):
    """The inference backend fails on known-good input: stop rather than dead-letter the stream."""


class ThreadDiedError(WorkerError):
    """A worker thread ended with an exception (a bug): stop with what it raised."""


class SchemaRegistryFailure(WorkerError):
    """The Schema Registry cannot be reached, refuses the worker, or lacks the output schema."""
