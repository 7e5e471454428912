"""Commit-after-write offset tracking: never commit past the lowest unfinished offset."""

from __future__ import annotations

import random
import threading

import pytest

from worker.kafka.offsets import OffsetTracker, OffsetWentBack, PartitionOffsets, Refetched


def test_out_of_order_completion_commits_only_the_finished_prefix() -> None:
    p = PartitionOffsets("t", 0, 1)
    assert p.committable() is None
    for off in range(10, 15):
        p.track(off)
    assert p.committable() == 10
    p.done(12)
    p.done(11)
    assert p.committable() == 10  # 10 still unfinished
    p.done(10)
    assert p.committable() == 13  # 10..12 done, 13 next
    p.done(14)
    assert p.committable() == 13
    p.done(13)
    assert p.committable() == 15 and p.unfinished() == 0


def test_gaps_in_offsets_are_fine() -> None:
    # Compacted topics and transaction markers leave gaps; the commit point skips them.
    p = PartitionOffsets("t", 0, 1)
    for off in (3, 7, 8, 20):
        p.track(off)
    p.done(7)
    p.done(3)
    assert p.committable() == 8
    p.done(20)
    p.done(8)
    assert p.committable() == 21


def test_uncommitted_counts_until_the_broker_confirms() -> None:
    p = PartitionOffsets("t", 0, 1)
    for off in range(100, 110):
        p.track(off)
    assert p.uncommitted() == 10
    for off in range(100, 106):
        p.done(off)
    assert p.uncommitted() == 10  # done but not yet committed: a crash now redelivers them
    p.request_commit(103)
    p.request_commit(106)
    assert p.confirm_commit(106)
    assert p.committed == 106 and p.uncommitted() == 4
    assert not p.confirm_commit(103)  # a late, older commit confirmation never moves it back
    assert p.committed == 106


def test_a_late_confirmation_of_an_earlier_assignment_is_ignored() -> None:
    tracker = OffsetTracker()
    old = tracker.assign("t", 0)
    old.track(0)
    old.done(0)
    old.request_commit(1)
    tracker.revoke("t", 0)
    new = tracker.assign("t", 0)  # the partition came back; the old commit answer arrives now
    new.track(5)
    assert not new.confirm_commit(1)
    assert new.committed is None and new.uncommitted() == 1
    new.request_commit(5)
    assert new.confirm_commit(5) and new.committed == 5


def test_tracking_backwards_is_refused() -> None:
    p = PartitionOffsets("t", 0, 1)
    p.track(5)
    with pytest.raises(ValueError, match=r"t\[0\]"):
        p.track(5)


def test_a_refetch_from_where_the_state_began_is_recognised_and_then_tracking_goes_on() -> None:
    p = PartitionOffsets("t", 0, 1)
    for off in range(4, 10):
        p.track(off, ("rec", off))
    for off in range(4, 10):
        p.done(off)
    with pytest.raises(Refetched) as first:
        p.track(4, ("rec", 4))
    assert first.value.first
    for off in (5, 7, 9):  # the rest of it, gaps included (transaction markers)
        with pytest.raises(Refetched) as later:
            p.track(off, ("rec", off))
        assert not later.value.first
    p.track(10, ("rec", 10))  # past the re-fetch: new records again
    assert p.committable() == 10 and p.unfinished() == 1
    with pytest.raises(OffsetWentBack):  # and a lower offset now is no longer taken for it
        p.track(9, ("rec", 9))


def test_a_lower_offset_is_a_reset_unless_it_is_the_first_record_again() -> None:
    p = PartitionOffsets("t", 0, 1)
    for off in range(4, 10):
        p.track(off, ("rec", off))
    with pytest.raises(OffsetWentBack):  # the same offset, another record: the log was recreated
        p.track(4, ("new", 4))
    with pytest.raises(OffsetWentBack):  # below where the state began
        p.track(0, ("rec", 0))
    with pytest.raises(OffsetWentBack):  # inside it, but nothing to compare the record with
        p.track(6, ("rec", 6))
    q = PartitionOffsets("t", 0, 2)
    q.track(4)
    with pytest.raises(OffsetWentBack):  # no record given: never taken for a re-fetch
        q.track(4)


def test_done_twice_or_unknown_is_harmless() -> None:
    p = PartitionOffsets("t", 0, 1)
    p.track(0)
    p.track(1)
    p.done(1)
    p.done(1)
    p.done(99)
    assert p.committable() == 0


def test_reassignment_starts_a_new_epoch_and_marks_the_old_one_revoked() -> None:
    tracker = OffsetTracker()
    first = tracker.assign("t", 0)
    first.track(0)
    assert tracker.revoke("t", 0) is first and first.revoked
    assert tracker.get("t", 0) is None
    second = tracker.assign("t", 0)
    assert second is not first and second.epoch > first.epoch and not second.revoked
    # A late completion of the old owner's message lands on the old object only.
    first.done(0)
    assert second.committable() is None
    assert tracker.partitions() == [second]


def test_concurrent_completion_matches_a_sequential_model() -> None:
    p = PartitionOffsets("t", 0, 1)
    offsets = list(range(5000))
    for off in offsets:
        p.track(off)
    shuffled = offsets[:]
    random.Random(7).shuffle(shuffled)
    finished = shuffled[:4000]
    chunks = [finished[i::4] for i in range(4)]
    threads = [threading.Thread(target=lambda c=c: [p.done(o) for o in c]) for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = min(set(offsets) - set(finished))
    assert p.committable() == expected
    assert p.unfinished() == 1000
