"""The backfill's range: which offsets of the input topic it embeds, captured once, kept in Kafka.

A backfill embeds, per partition, the offsets from `--from` (the log start, an offset, or the
first record at or after a timestamp) up to the partition's end when it first started: the last
stable offset, since the worker reads read_committed (without transactions it is the high
watermark). Records that arrive later are past the end: the live group embeds them.

The range is captured once and kept as the committed offsets of a group of its own,
`<backfill group>-range` (offset: the end; metadata: the start, `--from` and when it was captured),
a group no consumer ever joins. A restart with the same arguments, on any machine, reads it back
and so ends where the first start would have, however much arrived meanwhile; the backfill's own
group, committed as it goes, says where each partition resumes (`plan`). Another `--from` against
a kept range is refused: that is another range, in another group.

Before the pipeline starts, a partition its group has no offset for gets the range's start
committed (the group is empty then), so the group member begins there with no seek of its own.

The groups' offsets are read and committed through consumers that never join
(worker/backfill/group_offsets.py: not the admin client, whose ListConsumerGroupOffsets crashes on a
coordinator still loading), and every step that asks the cluster retries its retriable errors
within one bound (worker/backfill/cluster_calls.py).

Threads: everything here runs on the command's main thread, before the pipeline starts.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

import structlog
from confluent_kafka import IsolationLevel, TopicPartition
from confluent_kafka.admin import OffsetSpec

from worker.backfill.cluster_calls import BackfillError, GroupBusyError, Retriable, Retry, classify
from worker.backfill.group_offsets import GroupOffsets
from worker.settings.schema import SettingsError

log = structlog.get_logger(__name__)

# What the range group's commit metadata holds; a change of its meaning bumps it.
RANGE_FORMAT = 1


FromKind = Literal["beginning", "offset", "timestamp"]


@dataclass(frozen=True)
class FromSpec:
    """Where the range begins in every partition (`--from`)."""

    kind: FromKind
    value: int = 0  # the offset, or the timestamp in ms since the epoch
    text: str = "beginning"  # canonical: what the range group keeps and a restart compares

    @classmethod
    def parse(cls, raw: str) -> FromSpec:
        """`beginning` (or `earliest`), an offset (`1200`), epoch milliseconds (`1717171717000ms`),
        or an ISO 8601 timestamp (`2026-05-01T00:00:00Z`; without a zone: UTC)."""
        text = raw.strip()
        if text.lower() in ("beginning", "earliest"):
            return cls("beginning")
        if re.fullmatch(r"\d+", text):
            return cls("offset", int(text), f"offset:{int(text)}")
        if m := re.fullmatch(r"(\d+)\s*ms", text):
            return cls("timestamp", int(m[1]), f"timestamp:{int(m[1])}")
        try:
            when = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise SettingsError(f"--from {raw!r}: expected 'beginning', an offset (1200), epoch milliseconds "
                                f"(1717171717000ms) or an ISO 8601 timestamp (2026-05-01T00:00:00Z)") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        ms = int(when.timestamp() * 1000)
        return cls("timestamp", ms, f"timestamp:{ms}")


@dataclass(frozen=True)
class PartitionRange:
    partition: int
    start: int  # the first offset of the range
    end: int  # one past the last: the partition's end (last stable offset) when the range was captured

    @property
    def size(self) -> int:
        return max(0, self.end - self.start)


@dataclass(frozen=True)
class Range:
    """The offsets a backfill embeds: per partition [start, end), captured once."""

    topic: str
    origin: str  # FromSpec.text
    captured_ms: int
    parts: tuple[PartitionRange, ...]

    @property
    def total(self) -> int:
        """Offsets in the range (records, and transaction markers between them)."""
        return sum(p.size for p in self.parts)

    def end_of(self, partition: int) -> int | None:
        """The partition's end; None for a partition made after the range was captured."""
        for p in self.parts:
            if p.partition == partition:
                return p.end
        return None

    def metadata(self, part: PartitionRange) -> str:
        return json.dumps({"v": RANGE_FORMAT, "start": part.start, "from": self.origin,
                           "captured_ms": self.captured_ms}, separators=(",", ":"))


@dataclass(frozen=True)
class Plan:
    """Where each partition of the range resumes, from the backfill group's committed offsets."""

    range: Range
    resume: Mapping[int, int]  # partition -> the first offset not yet done
    to_commit: Mapping[int, int]  # partitions the group has no offset for: their start, committed first

    @property
    def done_before(self) -> int:
        """Offsets of the range finished by earlier runs."""
        return sum(min(self.resume[p.partition], p.end) - p.start for p in self.range.parts
                   if self.resume[p.partition] > p.start)

    @property
    def left(self) -> dict[int, int]:
        """Offsets still to do, by partition (only those with any)."""
        return {p.partition: p.end - self.resume[p.partition] for p in self.range.parts
                if self.resume[p.partition] < p.end}

    @property
    def complete(self) -> bool:
        return not self.left


def plan(rng: Range, committed: Mapping[int, int | None]) -> Plan:
    """Resume each partition at the backfill group's committed offset, within [start, end].

    A partition the group has no offset for (a first start) starts at the range's start and is
    committed there first. An offset below the start (the group used for something else before)
    is not followed back: the range starts where it was captured. An offset past the end means
    the partition is done.
    """
    resume: dict[int, int] = {}
    to_commit: dict[int, int] = {}
    for p in rng.parts:
        at = committed.get(p.partition)
        if at is None or at < 0:
            resume[p.partition] = p.start
            to_commit[p.partition] = p.start
        else:
            resume[p.partition] = min(max(at, p.start), p.end)
            if at < p.start:
                to_commit[p.partition] = p.start
    return Plan(rng, resume, to_commit)


# ------------------------------------------------------------------ Kafka


@dataclass
class Kafka:
    """What the range is read from and kept in: the admin client (the topic's partitions and offsets)
    and the groups' offsets (consumers that never join), each step retried within `retry`'s bound. A
    commit that needs its group empty waits up to `empty_wait_s` for it (group_offsets.py)."""

    admin: Any
    groups: GroupOffsets
    empty_wait_s: float
    retry: Retry = field(default_factory=Retry)


def partitions_of(kafka: Kafka, topic: str) -> list[int]:
    def attempt(timeout_s: float) -> list[int]:
        found = kafka.admin.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if found is None:
            raise Retriable("not in the metadata answer")
        if found.error is not None:
            failure = classify(found.error)
            raise BackfillError(f"topic {topic!r} does not exist ({found.error.str()})") \
                if isinstance(failure, BackfillError) else failure
        return sorted(found.partitions)

    return kafka.retry.run(f"cannot read the partitions of {topic}", attempt)


def list_offsets(kafka: Kafka, topic: str, partitions: Sequence[int], spec: Any) -> dict[int, int]:
    """One ListOffsets per partition, read_committed (the ends are last stable offsets)."""
    def attempt(timeout_s: float) -> dict[int, int]:
        futures = kafka.admin.list_offsets({TopicPartition(topic, p): spec for p in partitions},
                                           isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=timeout_s)
        return {tp.partition: f.result(timeout=timeout_s + 1).offset for tp, f in futures.items()}

    return kafka.retry.run(f"cannot list the offsets of {topic}", attempt)


def capture(kafka: Kafka, topic: str, origin: FromSpec, *, now_ms: int | None = None) -> Range:
    """The range as the topic stands now: each partition's start per `origin`, and its end."""
    partitions = partitions_of(kafka, topic)
    ends = list_offsets(kafka, topic, partitions, OffsetSpec.latest())
    earliest = list_offsets(kafka, topic, partitions, OffsetSpec.earliest())
    if origin.kind == "timestamp":
        # The first offset whose timestamp is at or after it; -1: none, the partition has nothing to do.
        found = list_offsets(kafka, topic, partitions, OffsetSpec.for_timestamp(origin.value))
        starts = {p: ends[p] if found[p] < 0 else found[p] for p in partitions}
    elif origin.kind == "offset":
        starts = {p: origin.value for p in partitions}
    else:
        starts = dict(earliest)
    parts = tuple(PartitionRange(p, min(max(starts[p], earliest[p]), ends[p]), ends[p]) for p in partitions)
    return Range(topic, origin.text, int(time.time() * 1000) if now_ms is None else now_ms, parts)


def range_group(group: str) -> str:
    """The group that keeps a backfill group's range (never joined by a consumer)."""
    return f"{group}-range"


def load_range(kafka: Kafka, group: str, topic: str, partitions: Sequence[int]) -> Range | None:
    """The range kept for `group`, or None when none was captured. Partitions made after the
    capture are not part of it."""
    kept = kafka.groups.committed(range_group(group), topic, partitions)
    parts: list[PartitionRange] = []
    origin, captured = None, 0
    for p in partitions:
        end, raw = kept.get(p, (None, None))
        if end is None:
            continue
        try:
            meta = json.loads(raw or "")
            if meta.get("v") != RANGE_FORMAT:
                raise ValueError(f"format {meta.get('v')!r}")
            start, origin, captured = int(meta["start"]), str(meta["from"]), int(meta["captured_ms"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BackfillError(f"group {range_group(group)!r} holds an offset for {topic}[{p}] that is not a "
                                f"backfill range ({exc}); pick another --group-id") from None
        parts.append(PartitionRange(p, start, end))
    if not parts:
        return None
    assert origin is not None
    return Range(topic, origin, captured, tuple(parts))


def open_range(kafka: Kafka, group: str, topic: str, origin: FromSpec, *,
               live_group: str = "") -> tuple[Range, bool]:
    """The kept range of `group` (refused when it began at another `--from`), or a new one captured
    and kept now. Returns (range, kept: it was there before).

    `live_group`, the new model's live group, takes over where the range ends: a partition it has
    an offset for already ends the range there (it embeds from there on); one it has none for gets
    the range's end committed as its start. No record is embedded by both, none by neither.
    """
    partitions = partitions_of(kafka, topic)
    kept = load_range(kafka, group, topic, partitions)
    if kept is not None:
        if kept.origin != origin.text:
            raise SettingsError(f"group {group!r} already holds a range of {topic} from {kept.origin} (captured "
                                f"{_when(kept.captured_ms)}), not from {origin.text}: rerun with that --from to "
                                f"resume it, or give another --group-id for another range")
        if live_group:
            hand_off(kafka, live_group, kept)
        return kept, True
    rng = capture(kafka, topic, origin)
    if live_group:
        rng = hand_off(kafka, live_group, rng)
    kafka.groups.commit(range_group(group), topic, {p.partition: p.end for p in rng.parts},
                        {p.partition: rng.metadata(p) for p in rng.parts}, wait_empty_s=kafka.empty_wait_s)
    log.info("backfill range captured", topic=topic, origin=rng.origin, offsets=rng.total, live_group=live_group or None,
             partitions={p.partition: [p.start, p.end] for p in rng.parts})
    return rng, False


def hand_off(kafka: Kafka, live_group: str, rng: Range) -> Range:
    """The range ended where `live_group` begins: its committed offsets end the range where it has
    them (at capture they are at most the ends: it reads read_committed too); where it has none, the
    range's end is committed for it (it must not run yet: its offsets can only be set while it is
    empty)."""
    have = kafka.groups.committed(live_group, rng.topic, [p.partition for p in rng.parts])
    parts, missing = [], {}
    for p in rng.parts:
        at = have.get(p.partition, (None, None))[0]
        if at is None:
            missing[p.partition] = p.end
            parts.append(p)
        else:
            end = min(at, p.end)
            parts.append(PartitionRange(p.partition, min(p.start, end), end))
    if missing:
        try:
            kafka.groups.commit(live_group, rng.topic, missing, wait_empty_s=0.0, busy_hint="")
        except GroupBusyError as exc:
            raise BackfillError(f"--live-group {live_group!r} runs already but has no offsets for "
                                f"{rng.topic}[{', '.join(map(str, sorted(missing)))}] to hand off at: stop it, run "
                                f"the backfill with --capture-only first, then start it ({exc})") from None
        log.info("live group starts where the range ends", live_group=live_group, offsets=missing)
    return Range(rng.topic, rng.origin, rng.captured_ms, tuple(parts))


def prepare(kafka: Kafka, group: str, rng: Range) -> Plan:
    """Reads where the backfill group stands and commits the start of each partition it has no offset
    for (waiting up to kafka.empty_wait_s for the member of a killed run to time out)."""
    committed = kafka.groups.committed(group, rng.topic, [p.partition for p in rng.parts])
    resumed = plan(rng, {p: off for p, (off, _) in committed.items()})
    if resumed.to_commit:
        kafka.groups.commit(group, rng.topic, resumed.to_commit, wait_empty_s=kafka.empty_wait_s)
    return resumed


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="seconds")
