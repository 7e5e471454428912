"""The bucketer's queues: items, buckets, lanes and formed batches, how buckets map to lanes and
backend contexts, and the operations on them (a snapshot for the flush policy, take, pad).

No locks and no threads here: the `Bucketer` (worker/batching/bucketer.py) owns every object made here
and calls `snapshot`, `take` and `take_flush` with its lock held; `pad` runs on the former thread
outside the lock, on items the former has already taken out of the queues.

Lanes: with a backend that hands out any number of contexts (`max_contexts is None`, ONNX
Runtime), one lane holds every bucket and `dispatchers` threads share its ready queue. With a
backend that binds context i to bucket profile i (`max_contexts` set, TensorRT), there is one
lane, one context and one dispatcher per bucket, and bucket i's batches only ever run on
context i, whose optimisation profile covers exactly that bucket's shapes. A backend whose
contexts must never run at once (`requires_serial_dispatch`, TensorRT with one shared block of
activation memory) gets one lane for every bucket and ONE dispatcher that creates, runs and
closes all the contexts, still bucket i on context i.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from worker.backends.base import Backend
from worker.batching.cost_model import Prices
from worker.batching.flush_policy import Flush, LaneSnapshot, QueuedBucket, Snapshot, batch_count, is_full
from worker.batching.padding import pad_batch
from worker.core.profiles import PadPolicy, Profile


@dataclass(slots=True)
class Item:
    seq: int
    ids: np.ndarray
    t_submit: float


@dataclass(slots=True)
class Bucket:
    index: int
    bound: int
    limit: int  # profile.batch_limit(index): max_batch cut by the token budget at the bound
    max_batch: int
    lane: int
    items: deque[Item] = field(default_factory=deque)
    longest: int = 0  # longest item queued
    # How many queued items have each token count: `longest` after a take, without reading the
    # whole queue (a backlog queues thousands; a bucket's items span a few lengths).
    lengths: dict[int, int] = field(default_factory=dict)

    def add(self, item: Item, n: int) -> None:
        """Queues `item` of `n` tokens."""
        self.items.append(item)
        self.lengths[n] = self.lengths.get(n, 0) + 1
        if n > self.longest:
            self.longest = n

    def take_oldest(self, k: int) -> list[Item]:
        popleft = self.items.popleft
        taken = [popleft() for _ in range(k)]
        lengths = self.lengths
        # Counted in C, then one update per length (a bucket's items span a few lengths).
        for n, c in Counter([len(it.ids) for it in taken]).items():
            left = lengths[n] - c
            if left:
                lengths[n] = left
            else:
                del lengths[n]
        self.longest = max(lengths, default=0)
        return taken

    def clear(self) -> None:
        self.items.clear()
        self.lengths.clear()
        self.longest = 0


@dataclass(slots=True)
class Batch:
    bucket: int  # the longest bucket whose items it holds: its shape limits (and TensorRT context)
    items: list[Item]
    input_ids: np.ndarray
    attention_mask: np.ndarray
    real_tokens: int
    merged: int


@dataclass(slots=True)
class Lane:
    buckets: list[int]
    threads: int  # dispatchers serving this lane
    ready: deque[Batch] = field(default_factory=deque)
    forming: int = 0  # batches taken from buckets and being padded by the former
    idle: int = 0  # dispatchers of this lane waiting for a batch
    running: int = 0  # batches being run by its dispatchers

    def has_room(self) -> bool:
        # At most one formed batch waiting per dispatcher: enough that no dispatcher ever waits
        # for padding, few enough that items stay in their buckets (and batches keep filling)
        # while the engine is busy.
        return len(self.ready) + self.forming < self.threads


@dataclass(slots=True)
class Layout:
    """The lanes, the buckets (each knowing its lane), and which contexts each dispatcher thread
    creates, owns and runs; `by_bucket`: it picks the context by the batch's bucket (context i =
    bucket i) instead of running every batch on its one context."""

    lanes: list[Lane]
    buckets: list[Bucket]
    thread_contexts: list[tuple[int, ...]]
    by_bucket: bool


def plan_layout(profile: Profile, backend: Backend, dispatchers: int) -> Layout:
    """Lay the profile's buckets out on lanes and dispatcher threads for this backend (one that
    binds contexts to buckets has at least as many contexts as buckets: the caller checks)."""
    n_buckets = len(profile.buckets)
    if backend.max_contexts is not None:
        if backend.requires_serial_dispatch:
            # The contexts share one block of activation memory (TensorRT share_device_memory):
            # no two may run at once, so ONE thread owns all of them, one lane for every bucket.
            lanes = [Lane(list(range(n_buckets)), 1)]
            thread_contexts = [tuple(range(n_buckets))]
            lane_of = [0] * n_buckets
        else:
            # Context i is bound to bucket profile i: one lane, context and thread per bucket.
            lanes = [Lane([i], 1) for i in range(n_buckets)]
            thread_contexts = [(i,) for i in range(n_buckets)]
            lane_of = list(range(n_buckets))
    else:
        lanes = [Lane(list(range(n_buckets)), dispatchers)]
        thread_contexts = [(k,) for k in range(dispatchers)]
        lane_of = [0] * n_buckets
    buckets = [Bucket(i, b.max_len, profile.batch_limit(i), b.max_batch, lane_of[i])
               for i, b in enumerate(profile.buckets)]
    return Layout(lanes, buckets, thread_contexts, backend.max_contexts is not None)


def bucket_full(b: Bucket, pad_to: PadPolicy, budget: int) -> bool:
    return is_full(len(b.items), b.longest, pad_to, b.limit, b.max_batch, budget)


def snapshot(lanes: Sequence[Lane], buckets: Sequence[Bucket], pad_to: PadPolicy, budget: int, *,
             delay: float, eager: bool, flush_all: bool, prices: Prices | None) -> Snapshot:
    """What `next_flush` reads: per lane with room, its non-empty buckets."""
    longest = pad_to == "longest"
    snaps = []
    for lane in lanes:
        if not lane.has_room():
            snaps.append(LaneSnapshot((), False, False))
            continue
        queued = []
        for i in lane.buckets:
            b = buckets[i]
            if b.items:
                n = len(b.items)
                queued.append(QueuedBucket(b.index, n, b.items[0].t_submit, b.longest if longest else b.bound,
                                           b.max_batch if longest else b.limit,
                                           is_full(n, b.longest, pad_to, b.limit, b.max_batch, budget)))
        snaps.append(LaneSnapshot(queued, True, lane.idle > len(lane.ready) + lane.forming))
    return Snapshot(snaps, delay, eager, flush_all, prices, budget)


def take(b: Bucket, pad_to: PadPolicy, budget: int) -> list[Item]:
    """Pop the next batch of bucket b, oldest first, within max_batch and the token budget."""
    most = min(len(b.items), b.max_batch)
    if pad_to == "longest" and b.longest * most <= budget:
        # Padded to the queue's longest item, as many as max_batch allows still fit the budget:
        # batch_count would read each of them to say so (a backlog's every take).
        return b.take_oldest(most)
    n = batch_count(len(b.items), (len(it.ids) for it in b.items), pad_to, b.limit, b.max_batch, budget)
    return b.take_oldest(n)


def take_flush(buckets: Sequence[Bucket], flush: Flush, pad_to: PadPolicy,
               budget: int) -> tuple[Bucket, list[Item], int]:
    """The batch `flush` names: its lead bucket's next batch, or whole buckets merged.
    Returns (the bucket whose shape it takes, its items, how many buckets it holds)."""
    if len(flush.buckets) == 1:
        b = buckets[flush.lead]
        return b, take(b, pad_to, budget), 1
    members = [buckets[i] for i in flush.buckets]
    items = [it for m in members for it in m.items]
    for m in members:
        m.clear()
    return max(members, key=lambda m: m.bound), items, len(members)


def pad(b: Bucket, items: list[Item], pad_to: PadPolicy, merged: int = 1) -> Batch:
    rows = [it.ids for it in items]
    input_ids, mask = pad_batch(rows, b.bound if pad_to == "bucket" else None)
    return Batch(b.index, items, input_ids, mask, sum(len(r) for r in rows), merged)
