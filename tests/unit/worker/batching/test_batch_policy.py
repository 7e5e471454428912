"""The merge policy as a pure function of bucket states and prices: no threads, no clock."""

from __future__ import annotations

from worker.batching.batch_policy import BucketView, plan_merge
from worker.batching.cost_model import Prices

# Roughly this box's ONNX Runtime prices: a 4 ms call, 0.04 ms per padded token.
CPU = Prices(fixed_s=0.004, per_row_s=0.0001, per_token_s=0.00004)
BUDGET = 8192


def view(index: int, count: int, length: int | None = None, *, max_batch: int = 128, full: bool = False) -> BucketView:
    # Exact-length buckets as in the cpu profile: bucket i holds keywords of i + 3 tokens.
    return BucketView(index, count, index + 3 if length is None else length, max_batch, full)


def test_a_trickle_of_near_lengths_runs_as_one_call() -> None:
    # One or two keywords in each of the 5..9 token buckets: five calls of ~4.3 ms, or one of ~5.5 ms.
    state = [view(2, 1), view(3, 2), view(4, 1), view(5, 1), view(6, 2)]
    plan = plan_merge(3, state, CPU, token_budget=BUDGET)
    assert plan[0] == 3 and sorted(plan) == [2, 3, 4, 5, 6]
    assert plan[1:3] in ([2, 4], [4, 2]), "nearest lengths are considered first"


def test_far_lengths_stay_apart_when_their_padding_costs_more_than_a_call() -> None:
    # 20 rows of 4 tokens padded to 60 would add 1,120 padded tokens (45 ms) to save one 4 ms call.
    state = [view(1, 20, 4), view(17, 1, 60)]
    assert plan_merge(1, state, CPU, token_budget=BUDGET) == [1]
    assert plan_merge(17, state, CPU, token_budget=BUDGET) == [17]


def test_the_decision_follows_the_prices() -> None:
    state = [view(2, 4), view(6, 4)]  # 5 and 9 tokens: merging pads 4 rows by 4 tokens
    cheap_calls = Prices(fixed_s=0.0001, per_row_s=0.0001, per_token_s=0.0004)
    assert plan_merge(2, state, cheap_calls, token_budget=BUDGET) == [2], "a call is cheaper than the padding"
    assert plan_merge(2, state, CPU, token_budget=BUDGET) == [2, 6], "the padding is cheaper than a call"


def test_never_under_a_backlog() -> None:
    # A full bucket anywhere in the lane: batches fill on their own, a merge would only add padding.
    state = [view(2, 1), view(3, 128, full=True), view(4, 2)]
    assert plan_merge(2, state, CPU, token_budget=BUDGET) == [2]
    assert plan_merge(3, state, CPU, token_budget=BUDGET) == [3]
    assert plan_merge(4, state, CPU, token_budget=BUDGET) == [4]


def test_without_prices_every_batch_is_one_bucket() -> None:
    state = [view(2, 1), view(3, 1)]
    assert plan_merge(2, state, None, token_budget=BUDGET) == [2]


def test_a_merge_keeps_the_batch_limits_of_its_longest_bucket() -> None:
    # max_batch: the longer bucket holds at most 8 rows; 6 + 4 would not fit it.
    state = [view(2, 6, max_batch=128), view(3, 4, max_batch=8)]
    assert plan_merge(2, state, CPU, token_budget=BUDGET) == [2]
    # ...but a shorter neighbour joins within the chosen bucket's own limit.
    state = [view(2, 3, max_batch=128), view(3, 4, max_batch=8)]
    assert plan_merge(3, state, CPU, token_budget=BUDGET) == [3, 2]
    # Token budget: rows x padded length of the merged batch.
    state = [view(2, 10, 5), view(3, 10, 6)]
    assert plan_merge(2, state, CPU, token_budget=100) == [2]
    assert plan_merge(2, state, CPU, token_budget=120) == [2, 3]


def test_empty_buckets_are_ignored_and_the_chosen_bucket_leads() -> None:
    state = [view(0, 0), view(2, 1), view(5, 0), view(3, 1)]
    assert plan_merge(3, state, CPU, token_budget=BUDGET) == [3, 2]
