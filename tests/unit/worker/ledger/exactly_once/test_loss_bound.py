"""Exactly-once's session and transaction timeout pair (worker/ledger/exactly_once/loss_bound.py):
a session raised past what the transaction timeout leaves room for is refused at start, with the
numbers; a lowered transaction timeout is the documented trade, said at start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from worker.ledger.exactly_once.loss_bound import (SessionTooLongError, abortable_after_loss_s, check_session,
                                                     effective_session_ms, oldest_at_loss_s)
from worker.kafka.client_config import SESSION_TIMEOUT_MS
from worker.settings.schema import Settings
from tests.conftest import ROOT



def eos(**kw: object) -> Settings:
    return Settings(processing_guarantee="exactly-once", **kw)  # type: ignore[arg-type]


def test_the_session_is_the_workers_or_the_kafka_config_override(tmp_path: Path) -> None:
    assert effective_session_ms(eos()) == SESSION_TIMEOUT_MS
    assert effective_session_ms(eos(kafka_config=("session.timeout.ms=45000",))) == 45000
    props = tmp_path / "client.properties"
    props.write_text("session.timeout.ms=40000\n")
    assert effective_session_ms(eos(kafka_config_file=str(props))) == 40000
    # --kafka-config overrides the file, as flags override files.
    assert effective_session_ms(eos(kafka_config_file=str(props), kafka_config=("session.timeout.ms=20000",))) == 20000


def test_the_defaults_fit_and_at_least_once_is_not_asked() -> None:
    assert check_session(eos()) is None
    assert oldest_at_loss_s(30.0, 2.0) == 37.0 and abortable_after_loss_s(60.0) == 44.0
    assert check_session(Settings(kafka_config=("session.timeout.ms=45000",))) is None


def test_a_45_s_session_with_the_default_timeout_is_refused_with_the_numbers_and_what_fits() -> None:
    """Issue 57: librdkafka's and Kafka's default session, 45 s, through --kafka-config: an outage just
    past it loses the partitions with a transaction up to 52 s old, past the 44 s bound, so every such
    outage stopped the member, unchecked."""
    with pytest.raises(SessionTooLongError) as refused:
        check_session(eos(kafka_config=("session.timeout.ms=45000",)))
    message = str(refused.value)
    assert "session.timeout.ms 45000 and transaction_timeout_ms 60000" in message
    assert "up to 52 s old" in message and "older than 44 s" in message
    assert "session.timeout.ms at most 37000" in message and "transaction_timeout_ms to at least 68000" in message
    # What it names fits.
    assert check_session(eos(kafka_config=("session.timeout.ms=37000",))) is None
    assert check_session(eos(kafka_config=("session.timeout.ms=45000",), transaction_timeout_ms=68000)) is None
    with pytest.raises(SessionTooLongError):
        check_session(eos(kafka_config=("session.timeout.ms=45000",), transaction_timeout_ms=67999))


def test_a_raised_session_with_a_lowered_timeout_is_told_to_keep_the_workers_session() -> None:
    with pytest.raises(SessionTooLongError, match=r"at most 30000 \(the worker's own\)"):
        check_session(eos(kafka_config=("session.timeout.ms=31000",), transaction_timeout_ms=20000))


@pytest.mark.parametrize(("timeout_ms", "session_ms"), [(5000, 10000), (20000, 30000)])
def test_a_lowered_transaction_timeout_is_the_documented_trade_said_not_refused(timeout_ms: int,
                                                                                session_ms: int) -> None:
    warning = check_session(eos(transaction_timeout_ms=timeout_ms, kafka_config=(f"session.timeout.ms={session_ms}",)))
    assert warning is not None and f"transaction_timeout_ms {timeout_ms}" in warning and "or more" in warning


def test_run_refuses_a_session_too_long_for_the_transaction_timeout_before_the_broker() -> None:
    out = subprocess.run([sys.executable, "-m", "worker.cli", "run", "--processing-guarantee", "exactly-once",
                          "--kafka-config", "session.timeout.ms=45000", "--bootstrap-servers", "127.0.0.1:9"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "keyword-embedder run: session.timeout.ms 45000 and transaction_timeout_ms 60000" in out.stderr, \
        out.stderr[-2000:]
