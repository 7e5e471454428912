"""The backfill's start against a cluster that is not ready, without a broker (tests/backfill_fakes.py).

Issue 57: `keyword-embedder backfill` started while the group coordinator loaded died of SIGSEGV (the
admin client's ListConsumerGroupOffsets, librdkafka #5040) or exited 2 with "Coordinator load in
progress". Here the command's start-up (`main`, --capture-only, so no model and no pipeline) runs
against a fake cluster on a fake clock:
- a coordinator loading, then moving: retried with backoff until it answers, each retry logged, and
  the admin client's group calls never used;
- one that never answers: exit 2 with the reason once the one bound is spent, not before;
- a killed run's member still in the group: waited for as long as the members' effective session
  (session.timeout.ms, overridable with --kafka-config) and a margin;
- each retriable error retried, a missing ACL not.
Under a second.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os

import confluent_kafka
import confluent_kafka.admin
import pytest
from confluent_kafka import KafkaError, KafkaException

from tests.backfill_fakes import TOPIC, FakeClock, FakeCluster
from worker.backfill import cluster_calls
from worker.backfill.cluster_calls import RETRY_BOUND_S, BackfillError, Retriable, Retry
from worker.backfill.group_offsets import EMPTY_GROUP_MARGIN_S, GroupOffsets
from worker.commands import backfill
from worker.kafka import preflight
from worker.kafka.client_config import SESSION_TIMEOUT_MS

GROUP = "out-backfill"


class _NoSignals:
    requested = None
    on_stop = None

    def stopped_during_startup(self) -> None:
        return None


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> FakeCluster:
    """The command's clients, its start-up check and the retries' clock, all fakes."""
    fake = FakeCluster(earliest={0: 0, 1: 10, 2: 0}, latest={0: 100, 1: 50, 2: 0})
    for key in list(os.environ):
        if key.startswith("KWE_"):
            monkeypatch.delenv(key)
    monkeypatch.setattr(confluent_kafka.admin, "AdminClient", fake.admin)
    monkeypatch.setattr(confluent_kafka, "Consumer", fake.consumer)
    monkeypatch.setattr(preflight, "check_topics", lambda *args, **kwargs: None)
    monkeypatch.setattr(cluster_calls, "time", fake.clock)
    return fake


def _start(*extra: str) -> int:
    parser = argparse.ArgumentParser()
    backfill.configure(parser)
    args = parser.parse_args(["--bootstrap-servers", "fake:9092", "--input-topic", TOPIC, "--output-topic", "out",
                              "--dead-letter-topic", "dlq", "--log-format", "json", "--capture-only", *extra])
    return backfill.main(args, _NoSignals())  # type: ignore[arg-type]


def _retries(err: str) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("event") == "backfill: the cluster asked to try again"]


def test_a_start_while_the_coordinator_loads_waits_for_it_and_keeps_the_range(
        cluster: FakeCluster, capsys: pytest.CaptureFixture[str]) -> None:
    cluster.loading_until, cluster.not_coordinator = 6.0, 2  # loading for 6 s, then it moves twice
    assert _start() == 0
    err = capsys.readouterr().err
    assert {p: off for p, (off, _) in cluster.groups[f"{GROUP}-range"].items()} == {0: 100, 1: 50, 2: 0}
    assert {p: off for p, (off, _) in cluster.groups[GROUP].items()} == {0: 0, 1: 10, 2: 0}
    retries = _retries(err)
    assert {r["error"] for r in retries} >= {"Broker: Coordinator load in progress", "Broker: Not coordinator"}
    assert cluster.clock.sleeps[:5] == [0.25, 0.5, 1.0, 2.0, 4.0] and max(cluster.clock.sleeps) <= 5.0
    assert len(retries) == len(cluster.clock.sleeps)  # each retry logged
    # The crash's path is never taken: groups are read and committed through consumers that never join.
    assert not [call for call in cluster.calls if call.startswith("admin")], cluster.calls
    assert cluster.consumers and all(c.closed for c in cluster.consumers)


def test_a_coordinator_that_never_answers_ends_the_start_with_the_reason_at_the_bound(
        cluster: FakeCluster, capsys: pytest.CaptureFixture[str]) -> None:
    cluster.loading_until = float("inf")
    assert _start() == 2
    err = capsys.readouterr().err
    assert "cannot read the committed offsets of group 'out-backfill-range': Broker: Coordinator load in progress" \
        in err and f"over {RETRY_BOUND_S:.1f} s" in err, err[-2000:]
    # Retried up to the bound, not past it: the last try falls on it.
    assert cluster.clock.now == pytest.approx(RETRY_BOUND_S)
    assert cluster.calls["consumer OffsetFetch"] == len(cluster.clock.sleeps) + 1 > 10


def test_a_killed_runs_member_is_waited_for_as_long_as_the_effective_session(
        cluster: FakeCluster, capsys: pytest.CaptureFixture[str]) -> None:
    # A run killed just before this start: its member leaves the group when its session (30 s) expires.
    session_s = SESSION_TIMEOUT_MS / 1000
    cluster.members_until[GROUP] = session_s + 2
    assert _start() == 0
    assert {p: off for p, (off, _) in cluster.groups[GROUP].items()} == {0: 0, 1: 10, 2: 0}
    assert cluster.clock.now >= session_s + 2
    # A session of 45 s given through --kafka-config: waited for too.
    for group in list(cluster.groups):
        del cluster.groups[group]
    cluster.clock.now, cluster.members_until[GROUP] = 0.0, 47.0
    assert _start("--kafka-config", "session.timeout.ms=45000") == 0
    assert GROUP in cluster.groups
    # A member that outlives the session and the margin: another run holds the group.
    del cluster.groups[GROUP]
    cluster.clock.now, cluster.members_until[GROUP] = 0.0, session_s + EMPTY_GROUP_MARGIN_S + 5
    capsys.readouterr()
    assert _start() == 2
    err = capsys.readouterr().err
    assert "Unknown member (another backfill with this group runs" in err, err[-2000:]
    assert cluster.clock.now == pytest.approx(session_s + EMPTY_GROUP_MARGIN_S)


@pytest.mark.parametrize("code", [
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.REQUEST_TIMED_OUT, KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._WAIT_COORD,
    KafkaError.NETWORK_EXCEPTION, KafkaError.LEADER_NOT_AVAILABLE,
])
def test_each_retriable_error_is_retried_in_reads_and_commits(code: int) -> None:
    cluster = FakeCluster(earliest={0: 0}, latest={0: 10})
    clock = FakeClock()
    groups = GroupOffsets({}, Retry(clock=clock.monotonic, sleep=clock.sleep), consumer=cluster.consumer)
    cluster.errors = [KafkaError(code), KafkaError(code)]
    groups.commit("g", TOPIC, {0: 7}, {0: "m"}, wait_empty_s=0.0)
    cluster.errors = [KafkaError(code)]
    assert groups.committed("g", TOPIC, [0]) == {0: (7, "m")}
    assert clock.sleeps == [0.25, 0.5, 0.25]


def test_an_error_that_retrying_cannot_fix_ends_the_step_at_once() -> None:
    cluster = FakeCluster(earliest={0: 0}, latest={0: 10})
    clock = FakeClock()
    groups = GroupOffsets({}, Retry(clock=clock.monotonic, sleep=clock.sleep), consumer=cluster.consumer)
    cluster.errors = [KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED)]
    with pytest.raises(BackfillError, match="cannot read the committed offsets of group 'g': not authorised"):
        groups.committed("g", TOPIC, [0])
    assert clock.sleeps == []


def test_an_attempt_without_an_answer_is_retried_and_the_bound_holds_for_every_kind_of_failure() -> None:
    clock = FakeClock()
    failures = iter([concurrent.futures.TimeoutError(), KafkaException(KafkaError(KafkaError._TRANSPORT)),
                     Retriable("not in the metadata answer")])
    timeouts: list[float] = []

    def attempt(timeout_s: float) -> str:
        timeouts.append(timeout_s)
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return "answered"

    assert Retry(clock=clock.monotonic, sleep=clock.sleep).run("step", attempt) == "answered"
    assert clock.sleeps == [0.25, 0.5, 1.0] and timeouts[0] == cluster_calls.ATTEMPT_TIMEOUT_S

    def never(timeout_s: float) -> None:
        timeouts.append(timeout_s)
        raise concurrent.futures.TimeoutError()

    clock.now, timeouts[:] = 0.0, []
    with pytest.raises(BackfillError, match=r"step: no answer within .* \(tried \d+ times over 20.0 s\)"):
        Retry(bound_s=20.0, clock=clock.monotonic, sleep=clock.sleep).run("step", never)
    assert clock.now == pytest.approx(20.0) and min(timeouts) >= 0.5
