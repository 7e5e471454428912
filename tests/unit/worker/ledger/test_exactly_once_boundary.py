"""Exactly-once in one place (issue 36): the at-least-once path's modules name none of exactly-once's
parts, and running at-least-once loads none of its modules."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT


# What at-least-once runs: the assembly and the pipeline, intake, the output stage and dead letters, acknowledgement,
# the in-flight table, the delivery interface (with AtLeastOnce), the producer and the committer.
AT_LEAST_ONCE = ["worker/app.py", "worker/pipeline.py", "worker/intake/stage.py", "worker/output/stage.py",
                 "worker/output/dead_letters.py", "worker/ledger/acks.py", "worker/ledger/inflight.py",
                 "worker/ledger/guarantees.py", "worker/ledger/at_least_once.py", "worker/ledger/base.py",
                 "worker/kafka/producer.py", "worker/ledger/committer.py", "worker/ledger/offsets.py"]
# Exactly-once's names: the write gate, failed-write routing, the client take-over, the transaction loop.
NAMES = ["write_gate", "fail_writes_into", "given_up", "drop_revoked", "replace_client", "PURGED", "take_over",
         "Transactions", "ExactlyOnceProducer", "txn", "transactional_keys", "abort_transaction", "commit_transaction", "TransactionHungError", "TransactionFencedError"]
# Loaded only when exactly-once runs.
MODULES = ["worker.ledger.exactly_once.loop", "worker.ledger.exactly_once.producer",
           "worker.ledger.exactly_once.transactions", "worker.ledger.exactly_once.take_over",
           "worker.ledger.exactly_once.bounded_calls", "worker.ledger.exactly_once.errors",
           "worker.ledger.exactly_once.transactional_calls", "worker.ledger.exactly_once.rewind",
           "worker.ledger.exactly_once.write_failures", "worker.ledger.exactly_once.loss_bound"]


def test_the_at_least_once_modules_name_nothing_of_exactly_once() -> None:
    pattern = re.compile(r"\b(" + "|".join(NAMES) + r")\b")
    found = [f"{path}:{n}: {m.group(1)}" for path in AT_LEAST_ONCE
             for n, line in enumerate((ROOT / path).read_text().splitlines(), 1)
             if (m := pattern.search(line))]
    assert found == []


def test_at_least_once_loads_no_exactly_once_module() -> None:
    code = ("import sys\n"
            "from worker.settings.schema import Settings\n"
            "from worker.ledger.guarantees import build_delivery\n"
            "from worker.ledger.committer import Committer\n"
            "from worker.kafka.producer import OutputProducer\n"
            "from worker.latch import FatalLatch\n"
            "import worker.app, worker.pipeline\n"
            "s = Settings()\n"
            "producer = OutputProducer({}, FatalLatch(), producer_factory=lambda c: object())\n"
            "d = build_delivery(s, Committer(None, interval_s=1.0), producer, None, FatalLatch(), None, None, None)\n"
            "assert d.writer is producer and d.around_batch is None\n"
            f"print(sorted(m for m in sys.modules if m in {MODULES!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr
