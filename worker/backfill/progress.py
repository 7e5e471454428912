"""What a backfill shows while it runs and says when it ends.

On a terminal a tqdm bar: offsets of the range done (earlier runs included) of the range, the
rate and the time left. Elsewhere (a Kubernetes job's log) a `backfill progress` log line every
LOG_EVERY_S with the same numbers. At the end `summary` writes a few lines to stdout: what the range
was, what this run did, and what is left when it was stopped before the end.

Threads: the bar is updated from the poll thread (RangeGate's progress callback) only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TextIO

import structlog
from tqdm import tqdm

from worker.backfill.range import Plan

log = structlog.get_logger(__name__)

LOG_EVERY_S = 10.0


class Progress:
    """The bar (or the periodic log line) of one run; `update` takes the offsets done so far."""

    def __init__(self, plan: Plan, *, enabled: bool = True, stream: TextIO = sys.stderr) -> None:
        self._total = plan.range.total
        self._initial = plan.done_before
        self._done = self._initial
        self._start = time.monotonic()
        self._next_log = self._start + LOG_EVERY_S
        self._log = enabled and not stream.isatty()
        # disable=None: tqdm draws only on a terminal; the log line stands in elsewhere.
        self._bar = tqdm(total=self._total, initial=self._initial, unit=" records", unit_scale=True,
                         desc=f"backfill {plan.range.topic}", file=stream, mininterval=0.5, smoothing=0.1,
                         disable=None if enabled else True, dynamic_ncols=True)

    def update(self, done: int) -> None:
        if done > self._done:
            self._bar.update(done - self._done)
            self._done = done
        if self._log and time.monotonic() >= self._next_log:
            self._next_log = time.monotonic() + LOG_EVERY_S
            elapsed = time.monotonic() - self._start
            rate = (self._done - self._initial) / elapsed if elapsed > 0 else 0.0
            left = self._total - self._done
            log.info("backfill progress", done=self._done, total=self._total, records_per_s=round(rate, 1),
                     seconds_left=round(left / rate) if rate > 0 else None)

    def close(self) -> None:
        self._bar.close()


@dataclass(frozen=True)
class Outcome:
    """What one run did, for the summary."""

    plan: Plan
    done: int  # offsets of the range done, earlier runs included
    embedded: int
    dead_lettered: int
    past_end: int  # records read past their partition's end, left to the live group
    seconds: float  # from the first record of the range to the end of the work
    left: Mapping[int, int]  # partition -> offsets not done
    stopped_by: str | None  # what stopped it before the end (a stop signal, --capture-only), or None


def summary(outcome: Outcome, *, group: str, output_topic: str, stream: TextIO | None = None) -> None:
    rng = outcome.plan.range
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(rng.captured_ms / 1000))
    this_run = outcome.embedded + outcome.dead_lettered
    rate = this_run / outcome.seconds if outcome.seconds > 0 else 0.0
    left = sum(outcome.left.values())
    if not left:
        state = "complete"
    elif outcome.stopped_by == "--capture-only":
        state = "range captured and kept (--capture-only); the same command without it embeds it"
    else:
        state = f"stopped{f' by {outcome.stopped_by}' if outcome.stopped_by else ''}"
    lines = [
        f"backfill {rng.topic} -> {output_topic} (group {group}): {state}",
        f"  range        {rng.total:,} offsets in {len(rng.parts)} partitions, from {rng.origin}, to the ends "
        f"captured {when}",
        f"  before       {outcome.plan.done_before:,} offsets done by earlier runs",
        f"  this run     {outcome.embedded:,} embedded, {outcome.dead_lettered:,} dead-lettered in "
        f"{outcome.seconds:,.1f} s ({rate:,.0f} records/s); {outcome.past_end:,} records past the end left "
        f"to the live group",
    ]
    if left:
        parts = ", ".join(f"{p}: {n:,}" for p, n in sorted(outcome.left.items()))
        again = "run the same command without --capture-only" if outcome.stopped_by == "--capture-only" else \
            "rerun the same command to resume"
        lines.append(f"  left         {left:,} offsets (partition {parts}); {again}")
    else:
        lines.append("  left         0")
    # sys.stdout at the call, not at import (a test's captured stdout is closed by then).
    print("\n".join(lines), file=stream or sys.stdout, flush=True)
