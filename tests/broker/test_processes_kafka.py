"""`run --processes 2` against the real broker: two members from one command, every ID once, one
/metrics for the machine, a SIGTERM that drains both and exits 0; a process that dies takes the
machine down with its code (nothing restarted silently); Ctrl-C to the process group drains
(one stop per process); a standby process is ready; a SIGSTOPped process is killed after the bound."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.kafka_tools import (
    TopicReader,
    WorkerProcess,
    committed_offsets,
    end_offsets,
    http_get,
    load_queries,
    produce_queries,
)
from tests.proc_tools import alive, children_of

pytestmark = pytest.mark.kafka

# The records waiting when the machine starts, for the Ctrl-C test.
BACKLOG = 6000


def test_two_processes_deliver_every_id_once_and_serve_one_metrics(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    inp, out, dlq = make_topic("kw", 6), make_topic("emb", 6), make_topic("dlq", 1)
    queries = load_queries(0, 3000)
    w = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "worker.log", ("--processes", "2"))
    w.start()
    reader = TopicReader(kafka_bootstrap, out, group_id + "-reader")
    try:
        w.wait_ready(180)  # ready once both processes are assigned their partitions
        produce_queries(kafka_bootstrap, inp, queries)
        reader.wait_for({q for q, _ in queries}, 240, alive=[w])
        families = {f.name: f for f in text_string_to_metric_families(http_get(w.url + "/metrics")[1].decode())}
        produced = {s.labels["process"]: s.value for s in families["kwe_produced_messages"].samples
                    if s.name == "kwe_produced_messages_total"}
        assert set(produced) == {"0", "1"} and sum(produced.values()) >= len(queries)
        assert all(v > 0 for v in produced.values()), f"both members took partitions: {produced}"
        assert http_get(w.url + "/healthz")[0] == 200
        w.signal(signal.SIGTERM)
        assert w.proc is not None and w.proc.wait(90) == 0
    finally:
        if w.proc and w.proc.poll() is None:
            w.proc.kill()
    reader.settle(1.0)
    reader.close()
    counts = reader.key_counts()
    assert {q for q, _ in queries} <= set(counts) and max(counts.values()) == 1, "every ID once"
    assert committed_offsets(kafka_bootstrap, group_id, inp, 6) == end_offsets(kafka_bootstrap, inp, 6)
    log = w.log()
    assert '"process": 0' in log and '"process": 1' in log, "each process's lines say which it is"


def test_a_process_that_dies_stops_the_machine_and_names_itself(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    inp, out, dlq = make_topic("kw", 4), make_topic("emb", 4), make_topic("dlq", 1)
    w = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "worker.log", ("--processes", "2"))
    w.start()
    try:
        w.wait_ready(180)
        assert w.proc is not None
        children = children_of(w.proc.pid)
        assert len(children) == 2, children
        # One process is killed from outside (an OOM kill, say): the supervisor stops the other,
        # which drains and leaves, and exits with the dead one's code, 128 + SIGKILL.
        os.kill(children[0], signal.SIGKILL)
        assert w.proc.wait(90) == 128 + signal.SIGKILL
    finally:
        if w.proc and w.proc.poll() is None:
            w.proc.kill()
    log = w.log()
    assert "a worker process exited on its own" in log and "exited with 137; the others were stopped" in log
    assert '"event": "worker stopped"' in log, "the other process drained and stopped"


def _cpu_s(pid: int) -> float | None:
    """The process's own user + system CPU time so far (not its children's)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_ctrl_c_to_the_process_group_drains_both_processes_and_loses_nothing(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    # Ctrl-C in a terminal (tini -g, kill -- -PGID) signals the supervisor's whole process group.
    # Each process must get one stop (drain, commit: exit 0), not the group's signal and then the
    # supervisor's (an abort, 130); the supervisor sleeps meanwhile; a second run of the group
    # finishes the topic with every ID, and duplicates only from what the drain could not finish.
    inp, out, dlq = make_topic("kw", 4), make_topic("emb", 4), make_topic("dlq", 1)
    queries = load_queries(0, BACKLOG)
    produce_queries(kafka_bootstrap, inp, queries)  # a backlog before the machine starts
    w = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "worker.log", ("--processes", "2"),
                      new_session=True)
    w.start()
    reader = TopicReader(kafka_bootstrap, out, group_id + "-reader")
    again = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "again.log")
    try:
        w.wait_ready(180)
        deadline = time.monotonic() + 180
        while len(reader.ids()) < BACKLOG // 10:  # both processes embedding, the backlog far from done
            assert time.monotonic() < deadline and w.proc is not None and w.proc.poll() is None, w.log()[-3000:]
            reader.poll(0.5)
        assert w.proc is not None
        cpu = [(time.monotonic(), _cpu_s(w.proc.pid))]
        os.killpg(w.proc.pid, signal.SIGINT)
        while w.proc.poll() is None and time.monotonic() - cpu[0][0] < 90:
            if (now := _cpu_s(w.proc.pid)) is not None:
                cpu.append((time.monotonic(), now))
            time.sleep(0.2)
        took = time.monotonic() - cpu[0][0]
        code = w.proc.wait(30)
        (t0, c0), (t1, c1) = cpu[0], cpu[-1]
        share = ((c1 or 0.0) - (c0 or 0.0)) / max(t1 - t0, 1e-3)
        stopped = w.events("worker stopped")
        print(f"group SIGINT: exit {code} after {took:.1f} s; supervisor CPU {share:.1%} of a core over "
              f"{t1 - t0:.1f} s; {len(reader.ids())} IDs out before the stop")
        assert code == 0 and took < 60, f"exit {code} after {took:.1f} s:\n{w.log()[-3000:]}"
        assert "second stop request" not in w.log() and len(stopped) == 2, "each process drained once"
        assert share < 0.3, f"the supervisor used {share:.0%} of a core while its processes drained"
        again.start()  # the group's next run finishes the topic from the committed offsets
        reader.wait_for({q for q, _ in queries}, 600, alive=[again])
        assert again.stop() == 0
    finally:
        for proc in (w.proc, again.proc):
            if proc and proc.poll() is None:
                proc.kill()
    reader.settle(1.0)
    reader.close()
    counts = reader.key_counts()
    duplicates = sum(n - 1 for n in counts.values())
    print(f"every ID out: {len(counts)} of {len(queries)}; duplicates {duplicates} ({duplicates / len(queries):.2%})")
    assert {q for q, _ in queries} <= set(counts)
    assert duplicates <= 0.01 * len(queries), f"{duplicates} duplicates of {len(queries)}"


def test_a_standby_process_is_ready_and_a_stopped_one_is_killed_after_the_bound(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    # One partition, two processes: one stands by with nothing assigned, and the machine is still
    # ready (a rolling update of pods x processes > partitions goes on). Then a process that cannot
    # answer (SIGSTOPped) must not hold the supervisor: it is killed shutdown_timeout_s + 5 s after
    # the SIGTERM, named in the log and the exit code, and no process is left.
    inp, out, dlq = make_topic("kw", 1), make_topic("emb", 1), make_topic("dlq", 1)
    w = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "worker.log",
                      ("--processes", "2", "--revoke-timeout-s", "1", "--shutdown-timeout-s", "10"))
    w.start()
    children: list[int] = []
    try:
        w.wait_ready(180)
        assert w.proc is not None
        children = children_of(w.proc.pid)
        assert len(children) == 2, children
        os.kill(children[0], signal.SIGSTOP)
        began = time.monotonic()
        w.signal(signal.SIGTERM)
        code = w.proc.wait(60)
        took = time.monotonic() - began
    finally:
        for pid in [*children, *([w.proc.pid] if w.proc else [])]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    left = [pid for pid in children if alive(pid)]
    print(f"SIGSTOPped process: the machine exited {code} after {took:.1f} s; left: {left}")
    assert code == 128 + signal.SIGKILL and took < 40 and not left
    log = w.log()
    assert "did not stop in time; killing it" in log and "did not stop within 15 s and were killed" in log
