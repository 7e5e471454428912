"""The flush decision as a table: a snapshot of the buckets and the clock in, the decision out.
No threads, no clock, no bucketer (tests/unit/worker/batching/test_bucketer.py checks the bucketer applies it)."""

from __future__ import annotations

import pytest

from worker.batching.cost_model import Prices
from worker.batching.flush_policy import (
    Flush,
    LaneSnapshot,
    QueuedBucket,
    Snapshot,
    Wait,
    batch_count,
    is_full,
    next_flush,
)

NOW = 100.0
DELAY = 0.020
# A call's fixed cost dominates: merging near lengths pays (t = 4 ms + 0.01 ms/row + 1 us/token).
CHEAP_PADDING = Prices(fixed_s=0.004, per_row_s=0.00001, per_token_s=0.000001)


def q(index: int, count: int, age_s: float, *, length: int | None = None, max_batch: int = 32,
      full: bool = False) -> QueuedBucket:
    """A bucket whose oldest item has waited age_s."""
    return QueuedBucket(index, count, NOW - age_s, length if length is not None else 8 * (index + 1), max_batch, full)


def lane(*buckets: QueuedBucket, room: bool = True, waiting: bool = False) -> LaneSnapshot:
    return LaneSnapshot(buckets, room, waiting)


def snap(*lanes: LaneSnapshot, eager: bool = False, flush_all: bool = False,
         prices: Prices | None = None) -> Snapshot:
    return Snapshot(lanes, DELAY, eager=eager, flush_all=flush_all, prices=prices, token_budget=8192)


CASES = {
    # nothing queued: wait for a submit
    "empty": (snap(lane()), Wait(None)),
    # a young partial bucket: wait until its deadline
    "young partial waits for its deadline": (snap(lane(q(0, 3, 0.005))), Wait(pytest.approx(0.015))),
    "the earliest deadline of several": (snap(lane(q(0, 3, 0.005), q(1, 1, 0.012))), Wait(pytest.approx(0.008))),
    # full: formed ahead, even with no dispatcher waiting
    "full goes at once": (snap(lane(q(0, 3, 0.001), q(1, 32, 0.0, full=True))), Flush(0, (1,))),
    # due and partial: bound late, only for a waiting dispatcher
    "due partial waits for a dispatcher": (snap(lane(q(0, 3, 0.030))), Wait(None)),
    "due partial goes to a waiting dispatcher": (snap(lane(q(0, 3, 0.030), waiting=True)), Flush(0, (0,))),
    # oldest first among full or due: the rare old bucket before the busy full one
    "oldest of full or due first": (snap(lane(q(0, 1, 0.025), q(1, 32, 0.001, full=True), waiting=True)),
                                    Flush(0, (0,))),
    # ... and nothing younger formed ahead of a due partial one waiting for a dispatcher
    "no younger full batch ahead of an older due one": (snap(lane(q(0, 1, 0.025), q(1, 32, 0.001, full=True))),
                                                         Wait(None)),
    # eager: an idle dispatcher takes the oldest bucket at once
    "eager takes the oldest for an idle dispatcher": (snap(lane(q(0, 2, 0.002), q(1, 1, 0.004), waiting=True),
                                                           eager=True), Flush(0, (1,))),
    "eager without an idle dispatcher waits": (snap(lane(q(0, 2, 0.002)), eager=True), Wait(pytest.approx(0.018))),
    "not eager, an idle dispatcher still waits": (snap(lane(q(0, 2, 0.002), waiting=True)),
                                                  Wait(pytest.approx(0.018))),
    # a lane without room is skipped, even with a full bucket
    "no room": (snap(lane(q(0, 32, 0.5, full=True), room=False)), Wait(None)),
    # draining: everything goes, the oldest first
    "draining flushes everything": (snap(lane(q(0, 1, 0.0), q(1, 1, 0.001)), flush_all=True), Flush(0, (1,))),
    # lanes (TensorRT: one per bucket): the oldest choice over all lanes
    "oldest over lanes": (snap(lane(q(0, 32, 0.001, full=True)), lane(q(1, 32, 0.003, full=True))),
                          Flush(1, (1,))),
    # merge: a partial batch takes its near neighbour along when one call costs less than two
    "merge near lengths": (snap(lane(q(0, 2, 0.030, length=8), q(1, 2, 0.001, length=9), waiting=True),
                                prices=CHEAP_PADDING), Flush(0, (0, 1))),
    "no merge without prices": (snap(lane(q(0, 2, 0.030, length=8), q(1, 2, 0.001, length=9), waiting=True)),
                                Flush(0, (0,))),
    "no merge while a bucket is full": (snap(lane(q(0, 2, 0.030, length=8), q(1, 32, 0.001, length=9, full=True),
                                                  waiting=True), prices=CHEAP_PADDING), Flush(0, (0,))),
    "a full lead takes nobody along": (snap(lane(q(0, 32, 0.030, length=8, full=True), q(1, 2, 0.0, length=9)),
                                            prices=CHEAP_PADDING), Flush(0, (0,))),
    "no merge over the batch limit": (snap(lane(q(0, 20, 0.030, length=8), q(1, 20, 0.001, length=9),
                                                waiting=True), prices=CHEAP_PADDING), Flush(0, (0,))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_next_flush(name: str) -> None:
    snapshot, expected = CASES[name]
    assert next_flush(snapshot, NOW) == expected


FULL = {
    # (count, longest, pad_to, limit, max_batch, budget) -> full
    "bucket: at its limit": ((16, 8, "bucket", 16, 32, 1024), True),
    "bucket: below its limit": ((15, 8, "bucket", 16, 32, 1024), False),
    "longest: max_batch": ((32, 4, "longest", 16, 32, 1024), True),
    "longest: the budget at the longest item": ((10, 103, "longest", 16, 32, 1024), True),
    "longest: short items fit": ((10, 100, "longest", 16, 32, 1024), False),
}


@pytest.mark.parametrize("name", list(FULL))
def test_is_full(name: str) -> None:
    args, expected = FULL[name]
    assert is_full(*args) is expected


TAKE = {
    # (count, lengths, pad_to, limit, max_batch, budget) -> items taken
    "bucket: up to the limit": ((40, [8] * 40, "bucket", 16, 32, 1024), 16),
    "bucket: all of a partial one": ((5, [8] * 5, "bucket", 16, 32, 1024), 5),
    "longest: up to max_batch": ((40, [4] * 40, "longest", 16, 32, 1024), 32),
    "longest: stops where the next item would pass the budget": ((4, [100, 100, 300, 10], "longest", 16, 32, 600), 2),
    "longest: one item always goes, however long": ((2, [900, 10], "longest", 16, 32, 600), 1),
}


@pytest.mark.parametrize("name", list(TAKE))
def test_batch_count(name: str) -> None:
    (count, lengths, *rest), expected = TAKE[name]
    assert batch_count(count, iter(lengths), *rest) == expected
