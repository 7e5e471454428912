"""Commit-after-write offset tracking: never commit past the lowest unfinished offset."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

from worker.ledger.offsets import OffsetTracker, OffsetWentBack, PartitionOffsets, Refetched


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


def _log(end: int, start: int = 0) -> Any:
    """Watermarks of a partition whose log holds offsets start..end-1."""
    return lambda topic, partition: (start, end)


def test_a_refetch_of_the_same_log_is_recognised_and_then_tracking_goes_on() -> None:
    p = PartitionOffsets("t", 0, 1)
    for off in range(4, 10):
        p.track(off, 3)
    for off in range(4, 10):
        p.done(off)
    with pytest.raises(Refetched) as first:
        p.track(4, 3, _log(10))
    assert first.value.first
    for off in (5, 7, 9):  # the rest of it, gaps included (transaction markers)
        with pytest.raises(Refetched) as later:
            p.track(off, 3, _log(10))
        assert not later.value.first
    p.track(10, 3)  # past the re-fetch: new records again
    assert p.committable() == 10 and p.unfinished() == 1


def test_a_reset_to_the_log_start_below_where_the_state_began_is_a_refetch() -> None:
    """librdkafka's resets go to auto.offset.reset (earliest: the log start), not where the state
    began; below that, the group committed the records before this state began."""
    p = PartitionOffsets("t", 0, 1)
    p.track(40, 2)
    p.track(41, 3)  # a leader change within the state
    with pytest.raises(Refetched, match="from the log start") as first:
        p.track(0, 1, _log(42))  # written in an older epoch: before offset 40
    assert first.value.first
    for off in range(1, 40):
        with pytest.raises(Refetched):
            p.track(off, 2, _log(42))
    with pytest.raises(Refetched):
        p.track(40, 2, _log(42))
    with pytest.raises(OffsetWentBack, match="leader epoch 4"):  # 41 was written in epoch 3
        p.track(41, 4, _log(42))


def test_a_lower_offset_is_a_reset_when_the_log_ends_below_what_was_consumed() -> None:
    """A log whose end is below the state's next offset was truncated or replaced (a recreated
    topic starts again at epoch 0, like the old one may have): its records are new."""
    p = PartitionOffsets("t", 0, 1)
    for off in range(10):
        p.track(off, 0)
    with pytest.raises(OffsetWentBack, match="ends at 4"):
        p.track(0, 0, _log(4))
    with pytest.raises(OffsetWentBack, match="unknown"):
        p.track(0, 0, lambda topic, partition: None)
    with pytest.raises(OffsetWentBack):  # no way to read the log's end: never taken for a re-fetch
        p.track(0, 0)


def test_a_lower_offset_with_another_leader_epoch_is_a_new_record() -> None:
    p = PartitionOffsets("t", 0, 1)
    for off in range(4, 10):
        p.track(off, 2)
    with pytest.raises(OffsetWentBack):  # rewritten after a truncation: a newer epoch
        p.track(6, 3, _log(12))
    with pytest.raises(OffsetWentBack):  # an older epoch at an offset this state saw: another log
        p.track(6, 1, _log(12))
    with pytest.raises(OffsetWentBack):  # below where it began, in a newer epoch than its first record
        p.track(0, 3, _log(12))
    with pytest.raises(OffsetWentBack):  # no leader epoch (an old broker or message format)
        p.track(4, None, _log(12))
    q = PartitionOffsets("t", 0, 2)
    q.track(4)
    with pytest.raises(OffsetWentBack):  # tracked without one: never taken for a re-fetch
        q.track(4, 0, _log(12))


def test_a_refetch_that_meets_a_rewritten_record_becomes_a_reset_there() -> None:
    """An unclean election kept offsets 0-5 and rewrote the rest: the same records are skipped, the
    first rewritten one is a reset (processed as new, and what follows it)."""
    p = PartitionOffsets("t", 0, 1)
    for off in range(10):
        p.track(off, 0)
    for off in range(6):
        with pytest.raises(Refetched):
            p.track(off, 0, _log(12))
    with pytest.raises(OffsetWentBack, match="leader epoch 1"):
        p.track(6, 0 + 1, _log(12))


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


def test_a_rewound_state_begins_where_the_seek_sent_it_with_the_old_leader_epochs() -> None:
    """A seek of ours rewinds a partition to 45 with fresh state (OffsetTracker.replace, then
    begin_at at the seek): a reset to the log start before the first record from 45 is a re-fetch
    of records the group committed; a record below 45 in a leader epoch the old state never saw
    there is a new one (another log), and begin_at after a record was tracked changes nothing."""
    tracker = OffsetTracker()
    old = tracker.assign("t", 0)
    for off in range(40, 45):
        old.track(off, 2)
    for off in range(45, 50):
        old.track(off, 3)  # a leader change inside the old state
    fresh = tracker.replace("t", 0)
    assert old.revoked and fresh.first is None
    fresh.begin_at(45)
    assert fresh.first == 45 and fresh.to_commit() is None and fresh.uncommitted() == 0
    with pytest.raises(Refetched, match="from the log start") as first:
        fresh.track(0, 1, _log(60))
    assert first.value.first
    for off in range(1, 45):
        with pytest.raises(Refetched):
            fresh.track(off, 2 if off >= 40 else 1, _log(60))
    fresh.track(45, 3)  # where the seek sent it: tracked as usual
    fresh.done(45)
    assert fresh.to_commit() == 46
    fresh.begin_at(10)  # tracked a record already: ignored
    assert fresh.first == 45

    other = tracker.replace("t", 0)
    other.begin_at(45)
    with pytest.raises(OffsetWentBack, match="leader epoch 7"):  # 44 was written in epoch 2
        other.track(44, 7, _log(60))
