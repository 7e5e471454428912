"""`keyword-embedder backfill` started the moment a broker answers, while its group coordinator loads.

librdkafka's admin ListConsumerGroupOffsets, answered NOT_COORDINATOR, dereferences a NULL consumer
group (librdkafka #5040): the backfill died of SIGSEGV with nothing logged, or exited 2 with
"Coordinator load in progress" (issue 57). A broker of the test's own: round 1 right after a fresh
start (no offsets topic yet: the first FindCoordinator creates it), each later round during a
restart: the backfill's process starts while the broker is down, imports what its start needs, and
runs the command the moment the broker's port accepts a connection. (kafka.sh's own readiness check,
a JVM tool, returns seconds later, and a backfill started then found the coordinator loaded; a bare
admin client that sent ListConsumerGroupOffsets as the port opened crashed the same way.) Each round
has a topic of records, a group and an output topic of its own; each backfill must exit 0 with
exactly the topic's records embedded. Every round runs, whatever the one before did, and the outcomes are
printed and asserted together.

KWE_FRESH_BROKER_ROUNDS sets the rounds (default 3, about 15 s each on a 2-core box); issue 57's
goal ran 10:
    KWE_FRESH_BROKER_ROUNDS=10 .venv/bin/python -m pytest tests/system/test_backfill_fresh_broker.py -s -p no:cacheprovider
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import orjson
import pytest

from tests.conftest import KAFKA_SH
from tests.kafka_tools import ROOT, TopicReader, load_queries, produce_queries
from worker.kafka.admin import ensure_topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

ROUNDS = int(os.environ.get("KWE_FRESH_BROKER_ROUNDS", "3"))
RECORDS = 300


# `python -c` with the port to wait for, then the command's arguments: `keyword-embedder backfill`
# in-process, with its start-up's imports done before the wait (the model loads after the range).
AT_ONCE = """
import socket, sys, time
import worker.backfill.range, worker.cli, worker.commands.backfill, worker.kafka.preflight, worker.settings.loader
port, argv = int(sys.argv[1]), sys.argv[2:]
while True:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        break
    except OSError:
        time.sleep(0.02)
sys.exit(worker.cli.main(argv))
"""


def _backfill(bootstrap: str, inp: str, out: str, dlq: str, group: str, log: Path) -> subprocess.Popen[bytes]:
    port = bootstrap.rsplit(":", 1)[1]
    cmd = [sys.executable, "-c", AT_ONCE, port, "backfill", "--bootstrap-servers", bootstrap, "--input-topic", inp,
           "--output-topic", out, "--dead-letter-topic", dlq, "--group-id", group, "--backend", "onnxruntime",
           "--log-format", "json", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KWE_")}
    with log.open("wb") as err:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)


def _restart(env: dict[str, str]) -> subprocess.Popen[str]:
    """Starts `kafka.sh restart` and returns once the old broker has exited (its port closed)."""
    pid = int((Path(env["KWE_KAFKA_RUN"]) / "broker.pid").read_text())
    restart = subprocess.Popen(["bash", str(KAFKA_SH), "restart"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return restart
        assert restart.poll() is None, restart.communicate()[0]
        time.sleep(0.05)
    raise AssertionError("the broker did not stop within 60 s")


def _retries(log: Path) -> str:
    """The retries the backfill logged, by error: what the broker answered while it started."""
    seen: Counter[str] = Counter()
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("event") == "backfill: the cluster asked to try again":
            seen[str(event.get("error"))] += 1
    return ", ".join(f"{n}x {error}" for error, n in seen.items()) or "none"


def _outcome(bootstrap: str, proc: subprocess.Popen[bytes], out: str, expected: set[str], log: Path) -> str:
    """'ok', or what went wrong: the exit code and the log's last line, or the output's difference."""
    try:
        code = proc.wait(180)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        return f"no exit within 180 s; {log.read_text(errors='replace').strip().splitlines()[-1:]}"
    print(f"  exit {code}; retries: {_retries(log)}")
    if code != 0:
        return f"exit {code}; {log.read_text(errors='replace').strip().splitlines()[-1:]}"
    reader = TopicReader(bootstrap, out, f"reader-{uuid.uuid4().hex[:8]}")
    try:
        reader.wait_for(expected, 60)
        reader.settle(2.0)
    except AssertionError as exc:
        return f"exit 0 but {exc}"
    finally:
        reader.close()
    extra = reader.ids() - expected
    return "ok" if not extra else f"exit 0 but {len(extra)} records past the range"


def test_a_backfill_started_while_the_coordinator_loads_completes_the_range(
        own_broker: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    bootstrap, env = own_broker
    outcomes: list[str] = []
    for n in range(1, ROUNDS + 1):
        tag = f"{n}-{uuid.uuid4().hex[:6]}"
        inp, out, dlq = f"fresh-in-{tag}", f"fresh-out-{tag}", f"fresh-dlq-{tag}"
        ensure_topics(bootstrap, {inp: 3, out: 3, dlq: 1})
        queries = load_queries(n * RECORDS, RECORDS)
        produce_queries(bootstrap, inp, queries)
        restart = _restart(env) if n > 1 else None  # round 1: the fresh broker, no offsets topic yet
        started = time.monotonic()
        proc = _backfill(bootstrap, inp, out, dlq, f"fresh-{tag}", tmp_path / f"backfill{n}.log")
        if restart is not None:
            assert restart.wait(180) == 0, restart.communicate()[0]
            print(f"  kafka.sh restart returned {time.monotonic() - started:.1f} s after the backfill started")
        outcome = _outcome(bootstrap, proc, out, {q for q, _ in queries}, tmp_path / f"backfill{n}.log")
        outcomes.append(outcome)
        print(f"round {n} ({'fresh start' if n == 1 else 'restart'}): {outcome} ({time.monotonic() - started:.1f} s)")
    assert outcomes == ["ok"] * ROUNDS, outcomes
