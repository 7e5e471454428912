"""A broker crash under a running worker: nothing lost, duplicates within the in-flight bound.

Runs its own broker (beside the session's, same jar cache, own data folder), so that killing
it does not disturb the other tests.
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import KAFKA_SH
from tests.kafka_tools import TopicReader, WorkerProcess, load_queries, produce_queries
from worker.kafka.admin import ensure_topics

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_worker_survives_a_broker_crash_and_restart(own_broker: tuple[str, dict[str, str]], tmp_path: Path,
                                                     group_id: str) -> None:
    bootstrap, env = own_broker
    max_in_flight = 500
    inp, out, dlq = f"kw-{group_id}", f"emb-{group_id}", f"dlq-{group_id}"
    ensure_topics(bootstrap, {inp: 3, out: 3, dlq: 1})
    queries = load_queries(3000, 4000)
    produce_queries(bootstrap, inp, queries)
    w = WorkerProcess(bootstrap, inp, out, dlq, group_id, tmp_path / "worker.log",
                      ("--max-in-flight", str(max_in_flight))).start()
    reader = TopicReader(bootstrap, out, group_id + "-reader")
    try:
        deadline = time.monotonic() + 300
        while len(reader.ids()) < 800:
            reader.poll(0.1)
            assert time.monotonic() < deadline, w.log()[-3000:]
        # SIGKILL: no controlled shutdown, the broker recovers its logs on start.
        subprocess.run(["bash", str(KAFKA_SH), "restart", "--hard"], env=env, capture_output=True, text=True,
                       check=True)
        reader.wait_for({q for q, _ in queries}, 300, alive=[w])
        reader.settle(3.0)
        assert w.stop() == 0, w.log()[-3000:]
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
        reader.close()
    counts = Counter(r.key for r in reader.records)
    duplicates = sum(n - 1 for n in counts.values())
    print(f"\nbroker SIGKILL + restart under load: {len(counts)} IDs, {duplicates} duplicates "
          f"(bound: max_in_flight = {max_in_flight})")
    assert set(counts) == {q for q, _ in queries}
    assert duplicates <= max_in_flight
