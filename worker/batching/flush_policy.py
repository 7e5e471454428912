"""Which bucket flushes next, and how much of it: pure functions of a snapshot and the clock.

The bucketer (worker/batching/bucketer.py) holds the lock, the threads, the padding and the lanes; under
its lock it takes a `Snapshot` of what is queued and asks `next_flush` what to do, then applies
the answer. Nothing here reads a clock, takes a lock or touches an item, so every rule is tested
with a table (tests/unit/worker/batching/test_flush_policy.py), without threads.

The rules, for the buckets of one lane whose ready queue has room:
1. a bucket is *full* (`is_full`) when it holds max_batch items or a batch of it would fill the
   padded-token budget (bound x batch for pad_to="bucket", the current longest item x batch for
   pad_to="longest"); it is *due* when its oldest item has waited the queue delay.
2. oldest first: among full or due buckets, the one whose oldest item is oldest goes first, so
   a rare bucket is never passed over by a busy one once its item is older. A full batch is
   formed ahead (it cannot grow); a due partial batch only when a dispatcher of the lane waits
   for one (bound late, items arriving meanwhile still join it), and nothing younger is formed
   ahead of it.
3. eager: when a dispatcher of the lane waits and nothing is full or due, the bucket with the
   oldest item flushes at once instead of the engine idling until a deadline.
4. merge: with prices (the cost model), a batch led by a bucket that is not full takes whole
   neighbouring buckets along where one call costs less than two (worker/batching/batch_policy.py's
   `plan_merge`), never while any bucket of the lane is full.
While draining (`flush_all`) every non-empty bucket counts as due and is formed at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from worker.batching.batch_policy import BucketView, plan_merge
from worker.batching.cost_model import Prices
from worker.core.profiles import PadPolicy


# The snapshot is taken under the bucketer's lock at every decision: named tuples, the cheapest
# immutable records to build (a frozen dataclass costs the decision four times as much).
class QueuedBucket(NamedTuple):
    """One non-empty bucket as the policy sees it."""

    index: int
    count: int  # items waiting
    oldest: float  # when its oldest item was submitted (the bucketer's clock)
    length: int  # what a batch of it is padded to (its longest item, or its bound)
    max_batch: int  # items a batch padded in this bucket may hold
    full: bool


class LaneSnapshot(NamedTuple):
    buckets: Sequence[QueuedBucket]  # its non-empty buckets, in order of length
    has_room: bool  # its ready queue may take another formed batch
    waiting: bool  # a dispatcher of the lane waits with nothing formed for it


class Snapshot(NamedTuple):
    lanes: Sequence[LaneSnapshot]
    delay_s: float  # max_queue_delay_ms, in seconds
    eager: bool = True
    flush_all: bool = False  # draining: everything queued goes now
    prices: Prices | None = None  # None: no merging
    token_budget: int = 0


class Flush(NamedTuple):
    lane: int
    buckets: tuple[int, ...]  # the bucket that leads the batch first, then those merged into it

    @property
    def lead(self) -> int:
        return self.buckets[0]


class Wait(NamedTuple):
    seconds: float | None  # until the earliest deadline; None: until something changes


def is_full(count: int, longest: int, pad_to: PadPolicy, limit: int, max_batch: int, token_budget: int) -> bool:
    """Rule 1: a batch of this bucket cannot grow (`limit`: max_batch cut by the budget at the bound)."""
    if pad_to == "bucket":
        return count >= limit
    # pad_to="longest": the budget counts what the batch would really be padded to.
    return count >= max_batch or count * longest >= token_budget


def batch_count(count: int, lengths: Iterable[int], pad_to: PadPolicy, limit: int, max_batch: int,
                token_budget: int) -> int:
    """How many of a bucket's `count` items, oldest first (`lengths` in queue order, read only as
    far as needed), one batch takes: within max_batch and the padded-token budget."""
    if pad_to == "bucket":
        return min(limit, count)
    taken = longest = 0
    for n in lengths:
        if taken >= max_batch:
            break
        longest_if = max(longest, n)
        if taken and longest_if * (taken + 1) > token_budget:
            break
        longest, taken = longest_if, taken + 1
    return taken


def next_flush(snapshot: Snapshot, now: float) -> Flush | Wait:
    """The batch to form next (rules 2-4), or how long nothing needs forming."""
    best: QueuedBucket | None = None
    best_lane = -1
    wait: float | None = None
    flush_all = snapshot.flush_all
    for lane_no, lane in enumerate(snapshot.lanes):
        if not lane.has_room:
            continue  # a dispatcher taking a batch wakes the bucketer
        cand: QueuedBucket | None = None  # the full-or-due bucket with the oldest item
        oldest: QueuedBucket | None = None
        for b in lane.buckets:
            if oldest is None or b.oldest < oldest.oldest:
                oldest = b
            if flush_all or now - b.oldest >= snapshot.delay_s or b.full:
                if cand is None or b.oldest < cand.oldest:
                    cand = b
            else:
                left = b.oldest + snapshot.delay_s - now
                wait = left if wait is None else min(wait, left)
        choice: QueuedBucket | None = None
        if cand is not None:
            # Full: formed ahead. Due and partial: only for a waiting dispatcher (bound late).
            if flush_all or lane.waiting or cand.full:
                choice = cand
        elif snapshot.eager and lane.waiting:
            choice = oldest
        if choice is not None and (best is None or choice.oldest < best.oldest):
            best, best_lane = choice, lane_no
    if best is None:
        return Wait(wait)
    return Flush(best_lane, _merged(best, snapshot.lanes[best_lane], snapshot))


def _merged(lead: QueuedBucket, lane: LaneSnapshot, snapshot: Snapshot) -> tuple[int, ...]:
    """Rule 4: the lead bucket alone, or with the neighbours one call serves more cheaply."""
    if snapshot.prices is None or lead.full or len(lane.buckets) == 1:
        return (lead.index,)
    views = [BucketView(b.index, b.count, b.length, b.max_batch, b.full) for b in lane.buckets]
    return tuple(plan_merge(lead.index, views, snapshot.prices, token_budget=snapshot.token_budget))
