"""At least once, the default guarantee, as a `Delivery` (worker/ledger/base.py; worker/ledger/guarantees.py
says when the pipeline calls each method and picks this or exactly once, its peer in
worker/ledger/exactly_once/): an input offset is committed only after its output (or its dead-letter
record) is acknowledged, and never past a partition's lowest unfinished offset. Built from only what
it uses, the committer and the producer; it runs no exactly-once code.

AtLeastOnce (the committer; worker/ledger/committer.py) states:
    running --finish--> finished
  running: poll_step commits asynchronously at most once per commit interval; on_revoke commits
  the revoked partitions' finished work synchronously; on_lost drops nothing but the state (the
  committer remembers what they finished: worker/ledger/committer.py, `remember_lost`).
  finish: commits all finished work, retrying until confirmed or the deadline (after an abort:
  nothing); finished: no more commits.
"""

from __future__ import annotations

from typing import Any

from worker.deadline import Deadline
from worker.kafka.producer import RecordWriter
from worker.ledger.base import AroundBatch, BoundCounts, Phase, Serve
from worker.ledger.committer import Committer
from worker.ledger.offsets import PartitionOffsets

# The at-least-once revoke commit: at most this long inside the callback.
REVOKE_COMMIT_S = 5.0
# The commit that frees room at the in-flight bound: at most this long (the poll thread holds
# meanwhile; a coordinator that does not answer ends the hold in a pause instead).
RELIEVE_COMMIT_S = 1.0


class AtLeastOnce:
    guarantee = "at-least-once"

    def __init__(self, committer: Committer, writer: RecordWriter) -> None:
        self._committer = committer
        self.writer = writer
        self.around_batch: AroundBatch | None = None
        self.bound_counts: BoundCounts = "uncommitted"
        self.phase: Phase = "created"

    def start(self) -> None:
        self.phase = "running"

    def poll_step(self, *, flow_paused: bool) -> str | None:
        self._committer.maybe_commit()
        return "flow control" if flow_paused else None

    def relieve(self, target: int) -> bool:
        self._committer.commit_to_relieve(target, RELIEVE_COMMIT_S)
        return True

    def before_intake(self) -> None:
        pass

    def on_revoke(self, parts: list[PartitionOffsets], wait_s: float) -> bool:
        return self._committer.commit_sync(parts, timeout_s=REVOKE_COMMIT_S, in_callback=True)

    def on_lost(self) -> bool:
        # Another member may own them already: nothing is committed for them now. Their finished
        # records' outputs are acknowledged, so if they come back unmoved that work need not be redone.
        return True

    def drain_step(self) -> None:
        self._committer.maybe_commit()

    def finish(self, deadline: Deadline, serve: Serve, *, drained: bool, aborted: bool) -> None:
        # Finished work is committed even after a fatal error: each partition commits only up
        # to its lowest unfinished offset, and the failed record is never finished.
        if not aborted and self.phase == "running":
            self._committer.commit_until(deadline, serve)
        self.phase = "finished"

    def summary(self) -> dict[str, Any]:
        return {}
