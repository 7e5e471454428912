"""Startup checks against the real broker: missing topics, the dead-letter size limit, the run command
(an unreachable cluster and the access rules: tests/unit/worker/kafka/test_preflight.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.kafka_tools import ROOT, free_port
from worker.kafka.client_config import admin_config
from worker.kafka.errors import KafkaSetupError, PreflightError
from worker.kafka.preflight import check_topics
from worker.settings.schema import Settings


def _settings(bootstrap: str, inp: str, out: str, dlq: str) -> Settings:
    return Settings(bootstrap_servers=bootstrap, input_topic=inp, output_topic=out, dead_letter_topic=dlq)


@pytest.mark.kafka
def test_all_topics_present_passes(kafka_bootstrap: str, make_topic: Callable[..., str]) -> None:
    s = _settings(kafka_bootstrap, make_topic("in", 2), make_topic("out"), make_topic("dlq"))
    start = time.monotonic()
    check_topics(admin_config(s), s)
    assert time.monotonic() - start < 5


@pytest.mark.kafka
@pytest.mark.parametrize("missing", ["input", "output", "dead-letter"])
def test_each_missing_topic_is_named(kafka_bootstrap: str, make_topic: Callable[..., str], missing: str) -> None:
    names = {role: make_topic(role) for role in ("input", "output", "dead-letter")}
    names[missing] = f"absent-{missing}-{free_port()}"
    s = _settings(kafka_bootstrap, names["input"], names["output"], names["dead-letter"])
    with pytest.raises(PreflightError) as info:
        check_topics(admin_config(s), s)
    assert str(info.value) == f"topic '{names[missing]}' does not exist"
    assert isinstance(info.value, KafkaSetupError)


@pytest.mark.kafka
def test_every_missing_topic_is_named_in_one_message(kafka_bootstrap: str) -> None:
    s = _settings(kafka_bootstrap, "absent-a", "absent-b", "absent-c")
    with pytest.raises(PreflightError) as info:
        check_topics(admin_config(s), s)
    assert info.value.problems == ("topic 'absent-a' does not exist", "topic 'absent-b' does not exist",
                                   "topic 'absent-c' does not exist")


@pytest.mark.kafka
def test_dead_letter_limit_above_the_topic_limit_is_named(kafka_bootstrap: str, make_topic: Callable[..., str]) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    dlq = f"dlq-small-{free_port()}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(dlq, 1, 1, config={"max.message.bytes": "100000"})])[dlq].result(30)
    try:
        s = Settings(bootstrap_servers=kafka_bootstrap, input_topic=make_topic("in"), output_topic=make_topic("out"),
                     dead_letter_topic=dlq)  # dead_letter_max_bytes: 262144 by default
        with pytest.raises(PreflightError) as info:
            check_topics(admin_config(s), s)
        assert str(info.value) == (f"dead_letter_max_bytes=262144 does not fit topic '{dlq}' "
                                   f"(max.message.bytes=100000); set it to at most {100000 - 512}")
        small = dataclasses.replace(s, dead_letter_max_bytes=100000 - 512)
        check_topics(admin_config(small), small)
    finally:
        admin.delete_topics([dlq])[dlq].result(30)


@pytest.mark.kafka
def test_run_exits_nonzero_when_the_dead_letter_topic_is_missing(kafka_bootstrap: str,
                                                                 make_topic: Callable[..., str],
                                                                 tmp_path: Path) -> None:
    inp, out, dlq = make_topic("in"), make_topic("out"), f"absent-dlq-{free_port()}"
    cmd = [sys.executable, "-m", "worker.cli", "run", "--bootstrap-servers", kafka_bootstrap, "--input-topic", inp,
           "--output-topic", out, "--dead-letter-topic", dlq, "--group-id", "g-preflight", "--log-format", "json"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"keyword-embedder run: topic '{dlq}' does not exist" in proc.stderr
    assert elapsed < 20, f"took {elapsed:.1f} s"
