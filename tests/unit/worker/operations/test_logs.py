"""Logging: JSON lines by default, console on a terminal, stdlib logging routed, levels honoured."""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator

import pytest
import structlog

from worker.operations.logs import configure_logging, get_logger


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
    logging.captureWarnings(False)
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    # Every line must be one complete JSON object: that is what log shippers rely on.
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_structlog_events_are_json_lines() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    log = get_logger("worker.pipeline")
    log.info("partitions assigned", partitions=["keywords[0]", "keywords[3]"], group="g1")
    log.warning("partitions paused", partitions=6, uncommitted=4096)
    lines = _lines(out)
    assert len(lines) == 2
    first = lines[0]
    assert first["event"] == "partitions assigned"
    assert first["level"] == "info"
    assert first["logger"] == "worker.pipeline"
    assert first["partitions"] == ["keywords[0]", "keywords[3]"]
    assert first["group"] == "g1"
    assert str(first["timestamp"]).endswith("Z") or "+00:00" in str(first["timestamp"])
    assert lines[1]["level"] == "warning" and lines[1]["uncommitted"] == 4096


def test_stdlib_logging_is_routed_through_the_same_format() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    logging.getLogger("confluent_kafka.x").warning("broker %s is down", "b1", extra={"broker_id": 1})
    (line,) = _lines(out)
    assert line["event"] == "broker b1 is down"
    assert line["level"] == "warning"
    assert line["logger"] == "confluent_kafka.x"
    assert line["broker_id"] == 1
    assert "timestamp" in line


def test_level_filtering_applies_to_structlog_and_stdlib() -> None:
    out = io.StringIO()
    configure_logging("json", "warning", stream=out)
    log = get_logger("worker.test")
    log.debug("per message detail", offset=1)
    log.info("lifecycle")
    logging.getLogger("lib").info("library chatter")
    log.warning("kept")
    logging.getLogger("lib").error("kept too")
    assert [line["event"] for line in _lines(out)] == ["kept", "kept too"]


def test_debug_is_off_at_info_and_on_at_debug() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    get_logger("w").debug("dead-lettering", offset=7)
    assert _lines(out) == []
    configure_logging("json", "debug", stream=out)
    get_logger("w").debug("dead-lettering", offset=7)
    assert [line["event"] for line in _lines(out)] == ["dead-lettering"]


def test_exceptions_stay_inside_one_json_line() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    try:
        raise RuntimeError("engine load failed")
    except RuntimeError:
        get_logger("worker.backend").exception("backend failed", backend="tensorrt")
        logging.getLogger("lib").exception("library failed")
    lines = _lines(out)
    assert len(lines) == 2
    for line in lines:
        assert "RuntimeError: engine load failed" in str(line["exception"])
        assert "Traceback" in str(line["exception"])


def test_loggers_created_before_configuration_follow_it() -> None:
    early = get_logger("worker.early")  # as modules do at import time
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    early.info("engine loaded", seconds=1.5)
    assert _lines(out)[0]["event"] == "engine loaded"


def test_reconfiguring_replaces_the_handler_instead_of_doubling_lines() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("json", "info", stream=first)
    configure_logging("json", "info", stream=second)
    get_logger("w").info("once")
    assert first.getvalue() == ""
    assert len(_lines(second)) == 1


def test_bound_context_and_contextvars_appear() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    structlog.contextvars.bind_contextvars(worker_id="w-1")
    get_logger("w", component="delivery").info("started")
    (line,) = _lines(out)
    assert line["worker_id"] == "w-1" and line["component"] == "delivery"


def test_console_on_request_and_auto_picks_by_tty() -> None:
    out = io.StringIO()
    configure_logging("console", "info", stream=out)
    get_logger("w").info("worker stopped", produced=3)
    text = out.getvalue()
    assert "worker stopped" in text and "produced" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])

    piped = io.StringIO()  # not a terminal: auto means JSON
    configure_logging("auto", "info", stream=piped)
    get_logger("w").info("piped")
    assert _lines(piped)[0]["event"] == "piped"

    tty = FakeTTY()
    configure_logging("auto", "info", stream=tty)
    get_logger("w").info("on a terminal")
    assert "on a terminal" in tty.getvalue()
    with pytest.raises(json.JSONDecodeError):
        json.loads(tty.getvalue().splitlines()[0])


def test_python_warnings_become_log_lines() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("old API", DeprecationWarning, stacklevel=1)
    (line,) = _lines(out)
    assert line["logger"] == "py.warnings" and "old API" in str(line["event"])


def test_invalid_format_or_level_is_refused() -> None:
    with pytest.raises(ValueError, match="log format"):
        configure_logging("xml", "info", stream=io.StringIO())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="log level"):
        configure_logging("json", "verbose", stream=io.StringIO())


def test_settings_values_are_accepted() -> None:
    # Every log_format/log_level the settings allow must configure without error.
    from worker.settings.schema import Settings, setting_choices, setting_fields

    fields = {f.name: f for f in setting_fields()}
    for fmt in setting_choices(fields["log_format"]):
        for level in setting_choices(fields["log_level"]):
            configure_logging(fmt, level, stream=io.StringIO())
    assert Settings().log_format == "auto"
