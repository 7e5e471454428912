"""Errors shared by the layers above, and their one root.

Every error raised on purpose to stop a command (a bad setting, model file, profile or backend,
a worker failure) is a `KeywordEmbedderError`: its message is the one line the user reads, so
a command catches this one type and maps it to that line and an exit code.
"""

from __future__ import annotations

from typing import ClassVar


class KeywordEmbedderError(Exception):
    """The root of every error the user is meant to read; the message says what and why."""

    # The exit code of a command that stops on it (the CLI's); a usage error's is 2.
    exit_code: ClassVar[int] = 1


class BackendError(KeywordEmbedderError, RuntimeError):
    """The backend cannot be loaded or cannot run a batch; the message says which and why."""


class ModelError(KeywordEmbedderError, ValueError):
    """The model folder is missing a file or a file is invalid; the message names the path."""


def extra_missing(extra: str, feature: str, missing: str) -> str:
    """The one wording of a missing optional extra: the install line first, then what is missing.

    A user reads "pip install" and the extra's name before a module name (`google.type`,
    `authlib`) that only says which of the extra's packages was found missing.
    """
    return f"{feature} needs the {extra} extra: {install_line(extra)} (missing: {missing})"


def install_line(extra: str) -> str:
    """The command that installs an optional extra."""
    return f"pip install 'keyword-embedder[{extra}]'"


GPU_INSTALL_HINT = install_line("gpu")
