"""What a backfill says when it ends (worker/backfill/progress.py): the summary of a complete run, of
one stopped before the end (what is left, and how to resume), of a `--capture-only` run; and the
periodic log line standing in for the bar where there is no terminal."""

from __future__ import annotations

import io

import pytest
from structlog.testing import capture_logs

from worker.backfill import progress
from worker.backfill.progress import Outcome, Progress, summary
from worker.backfill.range import PartitionRange, Plan, Range

RANGE = Range("keywords", "beginning", 0, (PartitionRange(0, 0, 100), PartitionRange(1, 10, 50)))


def _summary(plan: Plan, *, done: int, left: dict[int, int], stopped_by: str | None = None) -> list[str]:
    out = io.StringIO()
    summary(Outcome(plan, done=done, embedded=done - plan.done_before - 2, dead_lettered=2, past_end=3, seconds=2.0,
                    left=left, stopped_by=stopped_by), group="out-backfill", output_topic="embeddings", stream=out)
    return out.getvalue().splitlines()


def test_a_complete_run_says_what_it_did_and_what_earlier_runs_did() -> None:
    plan = Plan(RANGE, resume={0: 40, 1: 10}, to_commit={})
    lines = _summary(plan, done=140, left={})
    assert lines[0] == "backfill keywords -> embeddings (group out-backfill): complete"
    assert lines[1].startswith("  range        140 offsets in 2 partitions, from beginning, to the ends captured "
                               "1970-01-01T00:00:00Z")
    assert lines[2] == "  before       40 offsets done by earlier runs"
    assert lines[3] == ("  this run     98 embedded, 2 dead-lettered in 2.0 s (50 records/s); 3 records past the "
                        "end left to the live group")
    assert lines[4] == "  left         0"


def test_a_stopped_run_names_what_is_left_by_partition_and_how_to_resume() -> None:
    plan = Plan(RANGE, resume={0: 0, 1: 10}, to_commit={0: 0, 1: 10})
    lines = _summary(plan, done=60, left={1: 20, 0: 60}, stopped_by="SIGTERM")
    assert lines[0].endswith(": stopped by SIGTERM")
    assert lines[-1] == "  left         80 offsets (partition 0: 60, 1: 20); rerun the same command to resume"


def test_a_capture_only_run_says_the_range_is_kept_for_the_next_one() -> None:
    plan = Plan(RANGE, resume={0: 0, 1: 10}, to_commit={0: 0, 1: 10})
    lines = _summary(plan, done=2, left={0: 100, 1: 40}, stopped_by="--capture-only")
    assert "range captured and kept (--capture-only)" in lines[0]
    assert lines[-1].endswith("; run the same command without --capture-only")


def test_without_a_terminal_a_log_line_reports_the_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    bar = Progress(Plan(RANGE, resume={0: 40, 1: 10}, to_commit={}), stream=io.StringIO())
    with capture_logs() as logs:
        bar.update(60)  # before LOG_EVERY_S: no line
        now[0] += progress.LOG_EVERY_S
        bar.update(80)
    bar.close()
    assert [(e["event"], e["done"], e["total"], e["records_per_s"], e["seconds_left"]) for e in logs] == [
        ("backfill progress", 80, 140, 4.0, 15)]
