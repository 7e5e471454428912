"""Errors of the Kafka layer that stop the worker: each names what is wrong and where."""

from __future__ import annotations

from worker.errors import WorkerError


class KafkaSetupError(WorkerError):
    """The cluster is not set up for this worker (a topic or a permission is missing, or the
    cluster cannot be reached); retrying does not help, so the worker stops with this message."""


class PreflightError(KafkaSetupError):
    """A startup check failed; `problems` lists each finding, the message joins them with '; '."""

    def __init__(self, problems: list[str] | tuple[str, ...]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(self.problems))
