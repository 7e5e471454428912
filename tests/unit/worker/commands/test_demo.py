"""`keyword-embedder demo`'s summary: a worker whose /metrics does not answer leaves its lines out
of the summary instead of failing the demo, whose verdict rests on the topics alone."""

from __future__ import annotations

import socket

import pytest

from worker.commands.demo import _backend_line, _metrics


def test_a_worker_whose_metrics_do_not_answer_is_left_out_of_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        port = silent.getsockname()[1]
        assert _metrics(port, timeout_s=0.3) == ""
    assert f"the metrics of the worker on port {port} were not read" in capsys.readouterr().err
    assert _backend_line("") == "unknown (no kwe_backend_info)"


def test_a_worker_that_is_gone_is_left_out_too(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the read: connection refused
    assert _metrics(port, timeout_s=0.3) == ""
    assert "were not read" in capsys.readouterr().err
