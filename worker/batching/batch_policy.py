"""Which length buckets a partial batch takes along: a short, pure function of the bucket state and the prices.

Exact-length buckets keep padding near zero under a backlog, but under a trickle they split the
few waiting keywords across many buckets, and each bucket pays a whole backend call for one or
two rows. The call's fixed part (a few ms on CPU, most of a small batch's cost) then dominates:
issue 19 measured batches of ~4 keywords at 2.5x their isolated cost and a service rate of a
quarter of the backlog rate. So when the bucketer flushes a bucket that is *not full*, it asks
`plan_merge` whether neighbouring buckets should ride along in the same call, padded to the
longest: a neighbour joins when one call costs less than two,

    t(B + Bj, max(L, Lj)) <= t(B, L) + t(Bj, Lj)

with t the measured prices (worker/batching/cost_model.py). With t = a + b*B + d*B*L that is "the padding
it adds costs less than a call": merges happen only between near lengths, and only as far as the
measured fixed cost pays for the padding.

Never under a backlog: when any bucket of the lane is full, batches fill on their own and a merge
would only add padding (issue 15 measured 18% waste and seconds of p99 from a top-up rule that
merged under load). Deadlines are kept: a merge only takes items *earlier* than they would have
gone, and never more than the batch limits allow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.batching.cost_model import Prices


@dataclass(frozen=True)
class BucketView:
    """What the policy sees of one bucket of the lane."""

    index: int
    count: int  # items waiting
    length: int  # what a batch of it would be padded to (its longest item, or its bound)
    max_batch: int  # items a batch padded in this bucket may hold
    full: bool


def plan_merge(chosen: int, buckets: Sequence[BucketView], prices: Prices | None, *, token_budget: int) -> list[int]:
    """The buckets whose items go into one batch with bucket `chosen`'s, `chosen` first.

    `buckets` are the lane's buckets in order of length. A neighbour is considered nearest first
    (by padded length) and joins whole or not at all; the batch's limits are those of the longest
    bucket in it (its max_batch, and rows x length within the token budget).
    """
    by_index = {b.index: b for b in buckets}
    head = by_index[chosen]
    if prices is None or head.full or any(b.full for b in buckets):
        return [chosen]
    rows, length, max_batch = head.count, head.length, head.max_batch
    taken = [chosen]
    others = sorted((b for b in buckets if b.index != chosen and b.count > 0),
                    key=lambda b: (abs(b.length - head.length), b.length))
    for b in others:
        new_rows, new_len = rows + b.count, max(length, b.length)
        # The batch runs in the longest bucket's shape limits.
        new_max = b.max_batch if b.length > length else max_batch
        if new_rows > new_max or new_rows * new_len > token_budget:
            continue
        if prices.cost(new_rows, new_len) <= prices.cost(rows, length) + prices.cost(b.count, b.length):
            rows, length, max_batch = new_rows, new_len, new_max
            taken.append(b.index)
    return taken
