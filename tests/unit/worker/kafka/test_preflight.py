"""Startup checks without a broker: an unreachable cluster, the access each topic needs and what the
broker's authorized operations leave missing (missing topics and the run command against the real
broker: tests/broker/test_preflight_kafka.py)."""

from __future__ import annotations

import time

import pytest
from confluent_kafka.admin import AclOperation

from tests.kafka_tools import free_port
from worker.kafka.client_config import admin_config
from worker.kafka.errors import PreflightError
from worker.kafka.preflight import check_topics, missing_access, required_access
from worker.settings.schema import Settings


def _settings(bootstrap: str, inp: str, out: str, dlq: str) -> Settings:
    return Settings(bootstrap_servers=bootstrap, input_topic=inp, output_topic=out, dead_letter_topic=dlq)


def test_unreachable_cluster_fails_within_the_timeout() -> None:
    bootstrap = f"127.0.0.1:{free_port()}"  # a closed loopback port
    s = _settings(bootstrap, "in", "out", "dlq")
    start = time.monotonic()
    with pytest.raises(PreflightError) as info:
        check_topics(admin_config(s), s, timeout_s=2.0)
    elapsed = time.monotonic() - start
    assert str(info.value).startswith(f"cannot reach the Kafka cluster at {bootstrap} within 2 s")
    assert "Connection refused" in str(info.value)  # the root cause, not just "timed out"
    assert 1.5 < elapsed < 5.0


def test_missing_access_from_authorized_operations() -> None:
    read, write, describe, all_ = AclOperation.READ, AclOperation.WRITE, AclOperation.DESCRIBE, AclOperation.ALL
    assert missing_access("t", {"read"}, [read, describe]) == []
    assert missing_access("t", {"write"}, [read, describe]) == ["not authorised to write topic 't'"]
    assert missing_access("t", {"read", "write"}, [describe]) == ["not authorised to read topic 't'",
                                                                 "not authorised to write topic 't'"]
    assert missing_access("t", {"read", "write"}, [all_]) == []
    # The broker did not say (no authorizer on some versions, or not requested): nothing to conclude.
    assert missing_access("t", {"write"}, None) == []
    assert missing_access("t", {"write"}, []) == []


def test_required_access_merges_a_topic_used_twice() -> None:
    s = Settings(input_topic="a", output_topic="b", dead_letter_topic="a")
    assert required_access(s) == {"a": {"read", "write"}, "b": {"write"}}
