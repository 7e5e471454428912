"""Logging setup: structlog for the worker's own events, stdlib logging routed through it.

Every line, from structlog or from a library logging through the stdlib, goes through one
handler on the root logger and comes out in one format: JSON lines by default (what log
shippers parse), a coloured console renderer on a terminal or on request. Call
`configure_logging` once from the CLI; structlog's configuration and the root logger are
process-wide by nature, and nothing else here keeps state.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any, Literal, TextIO

import structlog
from structlog.typing import Processor

from worker.operations.redact import RedactSecrets

LogFormat = Literal["auto", "json", "console"]
LogLevel = Literal["debug", "info", "warning", "error"]

_LEVELS: dict[str, int] = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
                           "error": logging.ERROR}
# Marks the handler this module installs, so a second call replaces it instead of doubling
# every line.
_HANDLER_MARK = "_kwe_handler"


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def configure_logging(fmt: LogFormat = "auto", level: LogLevel = "info", stream: TextIO | None = None,
                      secrets: Iterable[str] = ()) -> None:
    """Sets up structlog and the root logger to write to `stream` (default: sys.stderr at call time).

    Every line passes a redactor last: values of secret-looking keys (sasl.password=..., a
    `sasl_password` key) and the given secret values are masked, in the worker's own events, in
    librdkafka's log lines and in rendered tracebacks.
    """
    stream = sys.stderr if stream is None else stream
    if fmt not in ("auto", "json", "console"):
        raise ValueError(f"log format {fmt!r} is not one of auto, json, console")
    try:
        numeric_level = _LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"log level {level!r} is not one of {', '.join(_LEVELS)}") from None
    console = fmt == "console" or (fmt == "auto" and _is_tty(stream))

    # Run on structlog events and on foreign (stdlib) records alike, so both carry the same keys.
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        # `extra={...}` on a stdlib call becomes keys of the line, as structlog kwargs do.
        structlog.stdlib.ExtraAdder(),
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.PositionalArgumentsFormatter(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: list[Processor]
    redact = RedactSecrets(secrets)
    if console:
        renderer = [structlog.processors.format_exc_info, redact, structlog.dev.ConsoleRenderer(colors=_is_tty(stream))]
    else:
        # Tracebacks become one string field: a multi-line traceback outside the JSON would
        # break line-oriented log shipping. They are formatted before the redactor sees them.
        renderer = [structlog.processors.format_exc_info, redact, structlog.processors.JSONRenderer(default=str)]

    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    setattr(handler, _HANDLER_MARK, True)

    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric_level)
    # warnings.warn() from libraries (deprecations, onnxruntime) would otherwise print raw
    # multi-line text to stderr, outside the JSON stream.
    logging.captureWarnings(True)

    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Off on purpose: modules bind `log = structlog.get_logger(__name__)` at import, often
        # before the CLI configures logging; a cached logger would keep the defaults forever.
        cache_logger_on_first_use=False,
    )


def get_logger(name: str | None = None, **initial: Any) -> structlog.stdlib.BoundLogger:
    """A structlog logger named like a stdlib one (the `logger` key in every line)."""
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(name, **initial)
    return logger
