"""`run --processes 2` against the real broker: two members from one command, every ID once, one
/metrics for the machine, a SIGTERM that drains both and exits 0; a process that dies takes the
machine down with its code (nothing restarted silently)."""

from __future__ import annotations

import os
import signal
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

pytestmark = pytest.mark.kafka


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
        children = _children(w.proc.pid)
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


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found
