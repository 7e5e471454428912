"""The bucketer's flush rules, dispatch and shutdown, against a trivial backend and a fake clock.

Time is an injected FakeClock: nothing here sleeps to make something happen or asserts on
wall-clock time. To check what the bucketer decided at a given (fake) moment, `settle`
advances the clock, wakes the former, waits until it has read the clock again and then takes
the bucketer's lock (the former decides under that lock), so the answer reflects that decision.
Waits on events carry a generous real-time timeout only so a bug fails instead of hanging.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from worker.core.profiles import Bucket, PadPolicy, Profile
from worker.batching.bucketer import Bucketer, BucketerError, BucketerStoppedError
from worker.batching.calibration import SHAPES
from worker.batching.cost_model import CostModel, Prices
from worker.deadline import Deadline
from worker.operations.batch_stats import BatchStats
from worker.operations.metrics import Metrics

WAIT = 10.0  # seconds; only a guard against hangs


class FakeClock:
    """A clock that moves only when told; counts its reads so tests can wait for a decision."""

    def __init__(self) -> None:
        self._now = 1000.0
        self._cv = threading.Condition()
        self.reads = 0
        self.listeners: list[Callable[[], None]] = []

    def __call__(self) -> float:
        with self._cv:
            self.reads += 1
            self._cv.notify_all()
            return self._now

    def advance(self, seconds: float) -> None:
        with self._cv:
            self._now += seconds
        for listener in self.listeners:  # outside our lock: listeners take the bucketer's lock
            listener()

    def wait_reads(self, n: int) -> None:
        with self._cv:
            assert self._cv.wait_for(lambda: self.reads >= n, WAIT), "the former never re-read the clock"


class FakeContext:
    def __init__(self, backend: FakeBackend, index: int) -> None:
        self.backend = backend
        self.index = index
        self.thread = threading.current_thread().name
        self.closed = False

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        b = self.backend
        with b.cv:
            b.calls.append((self.index, input_ids.copy(), attention_mask.copy(), threading.current_thread().name))
            b.cv.notify_all()
        if b.gate is not None:
            assert b.gate.acquire(timeout=WAIT), "test never released the gated batch"
        if b.fail is not None and b.fail(input_ids):
            raise RuntimeError("injected backend failure")
        # Row = (sum of real ids, real length): lets the test check each row belongs to its seq
        # (float64 so that the sums stay exact; the bucketer passes rows through untouched).
        return np.stack([(input_ids * attention_mask).sum(1), attention_mask.sum(1)], axis=1).astype(np.float64)

    def close(self) -> None:
        self.closed = True


class FakeBackend:
    name = "fake"
    dim = 2
    requires_serial_dispatch = False

    def __init__(self, *, max_contexts: int | None = None, gate: bool = False,
                 fail: Callable[[np.ndarray], bool] | None = None, broken_context: int | None = None) -> None:
        self.max_contexts = max_contexts
        self.gate = threading.Semaphore(0) if gate else None
        self.fail = fail
        self.broken_context = broken_context
        self.cv = threading.Condition()
        self.calls: list[tuple[int, np.ndarray, np.ndarray, str]] = []
        self.contexts: list[FakeContext] = []

    def create_context(self, index: int) -> FakeContext:
        if index == self.broken_context:
            raise RuntimeError(f"context {index} cannot be created")
        ctx = FakeContext(self, index)
        with self.cv:
            self.contexts.append(ctx)
        return ctx

    def wait_calls(self, n: int) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.calls) >= n, WAIT), f"expected {n} backend calls"

    def close(self) -> None:
        pass


class Results:
    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.batches: list[tuple[list[int], np.ndarray, BatchStats]] = []
        self.errors: list[tuple[list[int], BaseException]] = []

    def on_complete(self, seqs: Sequence[int], rows: np.ndarray, stats: BatchStats) -> None:
        with self.cv:
            self.batches.append((list(seqs), rows, stats))
            self.cv.notify_all()

    def on_error(self, seqs: Sequence[int], exc: BaseException) -> None:
        with self.cv:
            self.errors.append((list(seqs), exc))
            self.cv.notify_all()

    def wait_items(self, n: int) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: self.done() >= n, WAIT), f"expected {n} items, got {self.done()}"

    def done(self) -> int:
        return sum(len(s) for s, _, _ in self.batches) + sum(len(s) for s, _ in self.errors)

    def seqs(self) -> list[int]:
        return [q for s, _, _ in self.batches for q in s]


def profile(bounds: Sequence[int] = (4, 8, 16), max_batch: int = 4, budget: int = 10_000,
            pad_to: PadPolicy = "bucket") -> Profile:
    return Profile("test", tuple(Bucket(b, max_batch, max_batch) for b in bounds), budget, pad_to)


def ids(seq: int, length: int) -> np.ndarray:
    # [CLS]-like first token, then seq-dependent ids, so each row's sum identifies its item.
    return np.arange(seq * 1000 + 1, seq * 1000 + 1 + length, dtype=np.int64)


def make(prof: Profile, backend: FakeBackend | None = None, *, delay_ms: float = 20.0, eager: bool = False,
         dispatchers: int = 1, pad_to: PadPolicy | None = None,
         costs: CostModel | None = None) -> tuple[Bucketer, FakeClock, FakeBackend, Results]:
    clock = FakeClock()
    backend = backend or FakeBackend()
    res = Results()
    b = Bucketer(prof, backend, res.on_complete, on_error=res.on_error, max_queue_delay_ms=delay_ms,
                 dispatchers=dispatchers, pad_to=pad_to, clock=clock, eager=eager, costs=costs)
    clock.listeners.append(b.wake)
    b.start()
    return b, clock, backend, res


def settle(b: Bucketer, clock: FakeClock, seconds: float = 0.0) -> int:
    """Advance the clock, let the former decide at the new time; returns items still queued."""
    n = clock.reads
    clock.advance(seconds)
    b.wake()
    clock.wait_reads(n + 1)
    return b.queued()


def check_rows(batches: Sequence[tuple[list[int], np.ndarray, BatchStats]], lengths: dict[int, int]) -> None:
    for seqs, rows, _ in batches:
        for seq, row in zip(seqs, rows):
            assert row[0] == ids(seq, lengths[seq]).sum() and row[1] == lengths[seq], f"row of seq {seq}"


def no_worker_threads() -> bool:
    return not any(t.name.startswith("kwe-") for t in threading.enumerate())


# --------------------------------------------------------------------------- flush rules
def test_capacity_flush_without_waiting_for_the_deadline() -> None:
    b, clock, backend, res = make(profile(), delay_ms=1e6)
    for seq in range(3):
        b.submit(seq, ids(seq, 3))
    assert settle(b, clock) == 3, "a partial, not-due batch must wait"
    b.submit(3, ids(3, 4))  # the 4th item fills bucket 0 (bound 4, max_batch 4)
    res.wait_items(4)
    (seqs, rows, stats), = res.batches
    assert seqs == [0, 1, 2, 3]
    assert (stats.bucket, stats.bound, stats.size, stats.pad_len) == (0, 4, 4, 4)
    assert (stats.real_tokens, stats.padded_tokens) == (13, 16)
    assert stats.padding_waste == pytest.approx(3 / 16)
    assert list(stats.queue_wait_s) == [0.0] * 4  # the fake clock never moved
    check_rows(res.batches, {0: 3, 1: 3, 2: 3, 3: 4})
    assert b.stop() == []


def test_deadline_flush_exactly_at_max_queue_delay() -> None:
    # Binary fractions of a second, so "exactly 15.625 ms" is exact in floating point.
    b, clock, backend, res = make(profile(), delay_ms=15.625)
    b.submit(0, ids(0, 6))
    clock.advance(1 / 256)
    b.submit(1, ids(1, 7))
    assert settle(b, clock, 1 / 64 - 1 / 256 - 1 / 1024) == 2, "not due yet: 14.6 ms"
    assert backend.calls == []
    settle(b, clock, 1 / 1024)  # the oldest has now waited 15.625 ms
    res.wait_items(2)
    (seqs, _, stats), = res.batches
    assert seqs == [0, 1] and stats.bound == 8 and stats.size == 2
    assert list(stats.queue_wait_s) == [1 / 64, 1 / 64 - 1 / 256]
    assert b.stop() == []


def test_token_budget_caps_batches_at_the_bound() -> None:
    # Bound 16 x batch <= 32: two items per batch, although max_batch is 8.
    prof = profile(bounds=(8, 16), max_batch=8, budget=32)
    assert prof.batch_limit(1) == 2
    b, clock, backend, res = make(prof, delay_ms=1e6)
    for seq in range(3):
        b.submit(seq, ids(seq, 10))
    res.wait_items(2)
    assert settle(b, clock) == 1
    assert [s for s, _, _ in res.batches] == [[0, 1]]
    assert res.batches[0][2].padded_tokens == 32
    assert b.stop() == [] and sorted(res.seqs()) == [0, 1, 2]  # the drain flushed the third


def test_token_budget_counts_the_longest_item_when_padding_to_longest() -> None:
    # Padded to the longest (5), 6 items are 30 <= 32 tokens; a 7th would make 35.
    prof = profile(bounds=(8, 16), max_batch=64, budget=32, pad_to="longest")
    b, clock, backend, res = make(prof, delay_ms=1e6)
    for seq in range(6):
        b.submit(seq, ids(seq, 5))
    assert settle(b, clock) == 6, "30 padded tokens: not full yet"
    b.submit(6, ids(6, 5))
    res.wait_items(6)
    (seqs, _, stats), = res.batches
    assert seqs == list(range(6)) and stats.pad_len == 5 and stats.padded_tokens == 30
    assert stats.padding_waste == 0.0
    assert b.stop() == [] and sorted(res.seqs()) == list(range(7))


def test_pad_to_bucket_and_longest() -> None:
    for pad_to, want in (("bucket", 8), ("longest", 6)):
        b, clock, backend, res = make(profile(), delay_ms=0.0, pad_to=pad_to)
        b.submit(0, ids(0, 6))
        res.wait_items(1)
        _, in_ids, mask, _ = backend.calls[0]
        assert in_ids.shape == (1, want) and mask.tolist() == [[1] * 6 + [0] * (want - 6)]
        assert b.pad_to == pad_to
        b.stop()
    # None: the profile's choice.
    b, *_ = make(profile(pad_to="longest"))
    assert b.pad_to == "longest"
    b.stop()


def test_the_settings_word_auto_never_reaches_the_bucketer() -> None:
    # "auto" is resolved where the settings are read (resolve_settings); here it is a mistake.
    with pytest.raises(ValueError, match="pad_to must be one of bucket, longest or None"):
        Bucketer(profile(), FakeBackend(), Results().on_complete, on_error=Results().on_error,
                 pad_to="auto")  # type: ignore[arg-type]


def test_oldest_deadline_first_across_buckets() -> None:
    backend = FakeBackend(gate=True)
    b, clock, backend, res = make(profile(bounds=(4, 8, 16)), backend, delay_ms=10.0)
    b.submit(0, ids(0, 3))
    settle(b, clock, 0.011)
    backend.wait_calls(1)  # seq 0 runs and holds the only dispatcher at the gate
    b.submit(1, ids(1, 12))  # bucket 2, oldest
    clock.advance(0.001)
    b.submit(2, ids(2, 6))  # bucket 1
    clock.advance(0.001)
    b.submit(3, ids(3, 3))  # bucket 0, youngest
    settle(b, clock, 0.050)  # all three due while the engine is busy
    for _ in range(4):
        backend.gate.release()
    res.wait_items(4)
    assert [s for s, _, _ in res.batches] == [[0], [1], [2], [3]]
    assert b.stop() == []


def test_a_rare_bucket_is_not_starved_by_a_busy_one() -> None:
    backend = FakeBackend(gate=True)
    b, clock, backend, res = make(profile(bounds=(4, 8, 64), max_batch=4), backend, delay_ms=20.0)
    b.submit(0, ids(0, 3))
    settle(b, clock, 0.021)
    backend.wait_calls(1)  # the engine is busy on seq 0
    b.submit(1, ids(1, 40))  # the rare long bucket: one item, never full
    seq = 2
    for _ in range(10):  # then a flood of full batches in the busy bucket
        for _ in range(4):
            clock.advance(0.0001)
            b.submit(seq, ids(seq, 3))
            seq += 1
    settle(b, clock, 0.030)  # the rare item is past its deadline
    for _ in range(12):
        backend.gate.release()
    res.wait_items(seq)
    order = [s for s, _, _ in res.batches]
    # At most one full batch was formed ahead of it before it became due; then it goes next.
    assert order.index([1]) <= 2, order
    assert b.stop() == []


def test_next_full_batch_is_formed_while_the_engine_runs_the_current_one() -> None:
    backend = FakeBackend(gate=True)
    b, clock, backend, res = make(profile(), backend, delay_ms=1e6)
    for seq in range(4):
        b.submit(seq, ids(seq, 3))
    backend.wait_calls(1)  # batch 1 is running (held at the gate)
    for seq in range(4, 8):
        b.submit(seq, ids(seq, 3))
    # The second full batch leaves its bucket (formed and padded) before the engine is free...
    assert settle(b, clock) == 0
    for seq in range(8, 12):
        b.submit(seq, ids(seq, 3))
    # ...but only one batch per dispatcher is formed ahead: the third stays in its bucket.
    assert settle(b, clock) == 4
    for _ in range(3):
        backend.gate.release()
    res.wait_items(12)
    assert [s for s, _, _ in res.batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert b.stop() == []


def test_eager_idle_dispatcher_takes_a_partial_batch_at_once() -> None:
    b, clock, backend, res = make(profile(), delay_ms=1e6, eager=True)
    b.submit(0, ids(0, 3))
    res.wait_items(1)
    assert res.batches[0][0] == [0]
    # Not eager: the same item waits for its deadline.
    b2, clock2, _, res2 = make(profile(), delay_ms=1e6, eager=False)
    b2.submit(0, ids(0, 3))
    assert settle(b2, clock2) == 1 and res2.done() == 0
    assert b.stop() == [] and b2.stop() == []


# --------------------------------------------------------------------------- delivery
def test_every_item_completed_exactly_once_under_concurrency() -> None:
    rng = np.random.default_rng(7)
    prof = profile(bounds=(4, 6, 8, 12, 16, 32), max_batch=16, budget=256, pad_to="longest")
    res = Results()
    backend = FakeBackend()
    b = Bucketer(prof, backend, res.on_complete, on_error=res.on_error, max_queue_delay_ms=1.0, dispatchers=3)
    b.start()
    lengths: dict[int, int] = {}
    lock = threading.Lock()

    def feed(start: int) -> None:
        for seq in range(start, start + 2000):
            n = int(rng.integers(3, 33))
            with lock:
                lengths[seq] = n
            b.submit(seq, ids(seq, n))

    feeders = [threading.Thread(target=feed, args=(k * 10_000,)) for k in range(4)]
    for t in feeders:
        t.start()
    for t in feeders:
        t.join()
    assert b.stop(drain=True) == []
    counts = Counter(res.seqs())
    assert len(counts) == 8000 and set(counts.values()) == {1}
    assert b.pending() == 0
    check_rows(res.batches, lengths)
    for _, rows, stats in res.batches:
        assert stats.size == len(rows) <= 16 and stats.padded_tokens <= 256
        assert 0.0 <= stats.padding_waste < 1.0
    assert sorted({ctx.thread for ctx in backend.contexts}) == ["kwe-dispatch-0", "kwe-dispatch-1",
                                                                 "kwe-dispatch-2"]
    assert all(ctx.closed for ctx in backend.contexts)
    assert no_worker_threads()


def test_batch_stats_feed_the_worker_metrics() -> None:
    b, clock, backend, res = make(profile(), delay_ms=1e6)
    for seq in range(4):
        b.submit(seq, ids(seq, 3))
    res.wait_items(4)
    b.stop()
    metrics = Metrics()
    metrics.observe_batch(res.batches[0][2])  # BatchStats satisfies BatchStatsLike
    text = metrics.render().decode()
    assert 'kwe_padded_tokens_total{bucket="4"} 16.0' in text
    assert 'kwe_real_tokens_total{bucket="4"} 12.0' in text
    assert 'kwe_queue_wait_seconds_count{bucket="4"} 4.0' in text


def test_backend_errors_go_to_on_error_and_the_bucketer_keeps_running() -> None:
    backend = FakeBackend(fail=lambda x: x.shape[1] == 8)  # every batch of bucket 8 fails
    b, clock, backend, res = make(profile(), backend, delay_ms=0.0)
    for seq, n in enumerate([3, 7, 4, 8, 3]):
        b.submit(seq, ids(seq, n))
        res.wait_items(seq + 1)
    assert b.stop() == []
    assert sorted(q for s, _ in res.errors for q in s) == [1, 3]
    assert all(isinstance(e, RuntimeError) for _, e in res.errors)
    assert sorted(res.seqs()) == [0, 2, 4]
    assert b.pending() == 0


@pytest.mark.parametrize("failing", ["on_complete", "on_error"])
def test_a_callback_that_raises_trips_the_latch_and_its_batch_is_not_taken_for_done(failing: str) -> None:
    """Issue 46: a callback that raised was logged and its batch's records stayed in flight for good
    (their offsets never finish: commits stall until /healthz's stall timeout). It is a thread
    failure like any other now: the guard trips the fatal latch with a ThreadDiedError naming the
    callback, and stop() still returns at once (the batch is not left counted as running)."""
    from worker.errors import ThreadDiedError
    from worker.latch import FatalLatch, guarded

    latch = FatalLatch()
    res = Results()
    completed: list[list[int]] = []

    def on_complete(seqs: Sequence[int], rows: np.ndarray, stats: BatchStats) -> None:
        if failing == "on_complete" and 1 in seqs:
            raise KeyError("a bug in the output stage")
        completed.append(list(seqs))
        res.on_complete(seqs, rows, stats)

    def on_error(seqs: Sequence[int], exc: BaseException) -> None:
        if failing == "on_error":
            raise KeyError("a bug in the output stage")
        res.on_error(seqs, exc)

    backend = FakeBackend(fail=lambda x: failing == "on_error" and x.shape[1] == 8)
    b = Bucketer(profile(), backend, on_complete, on_error=on_error, max_queue_delay_ms=0.0,
                 guard=lambda name, body: guarded(latch, name, body))
    b.start()
    b.submit(0, ids(0, 3))
    res.wait_items(1)
    b.submit(1, ids(1, 7))  # bucket 8: its callback raises
    assert latch.wait(WAIT), f"the {failing} callback raised and the latch never tripped"
    error = latch.error
    assert isinstance(error, ThreadDiedError), error
    assert failing in str(error) and "a bug in the output stage" in str(error) and "batch of 1 items" in str(error)
    assert completed == [[0]]  # the failed batch never reached the output stage as done
    t0 = time.monotonic()
    b.stop(Deadline.after(0.5), drain=False)
    assert time.monotonic() - t0 < WAIT / 2
    assert b.pending() == 0
    assert no_worker_threads()


def test_one_context_per_bucket_when_the_backend_binds_contexts_to_buckets() -> None:
    prof = profile(bounds=(4, 8, 16))
    backend = FakeBackend(max_contexts=3)
    b, clock, backend, res = make(prof, backend, delay_ms=0.0, dispatchers=1)
    lengths = {0: 3, 1: 12, 2: 7, 3: 4, 4: 16, 5: 5}
    for seq, n in lengths.items():
        b.submit(seq, ids(seq, n))
    res.wait_items(len(lengths))
    assert b.stop() == []
    assert sorted(c.index for c in backend.contexts) == [0, 1, 2]
    assert len({c.thread for c in backend.contexts}) == 3
    for ctx_index, in_ids, _, _ in backend.calls:
        assert in_ids.shape[1] <= prof.bounds[ctx_index]
        assert ctx_index == 0 or in_ids.shape[1] > prof.bounds[ctx_index - 1]
    check_rows(res.batches, lengths)
    with pytest.raises(BucketerError, match="contexts"):
        Bucketer(prof, FakeBackend(max_contexts=2), res.on_complete, on_error=res.on_error)


# --------------------------------------------------------------------------- shutdown
def test_stop_with_drain_flushes_before_deadlines() -> None:
    b, clock, backend, res = make(profile(), delay_ms=1e6)
    for seq, n in enumerate([3, 5, 9, 16, 4]):
        b.submit(seq, ids(seq, n))
    assert b.stop(drain=True) == []
    assert sorted(res.seqs()) == [0, 1, 2, 3, 4]
    assert b.pending() == 0 and no_worker_threads()
    assert all(ctx.closed for ctx in backend.contexts)
    with pytest.raises(BucketerStoppedError):
        b.submit(9, ids(9, 3))


def test_stop_without_drain_drops_queued_items_and_finishes_the_running_batch() -> None:
    backend = FakeBackend(gate=True)
    b, clock, backend, res = make(profile(), backend, delay_ms=0.0)
    b.submit(0, ids(0, 3))
    backend.wait_calls(1)  # running, held at the gate
    for seq in range(1, 6):
        b.submit(seq, ids(seq, 7))
    stopper_result: list[list[int]] = []
    stopper = threading.Thread(target=lambda: stopper_result.append(b.stop(drain=False)))
    stopper.start()
    backend.gate.release()  # the running batch may finish; nothing else may start
    stopper.join(WAIT)
    assert not stopper.is_alive()
    assert res.seqs() == [0]
    assert sorted(stopper_result[0]) == [1, 2, 3, 4, 5]
    assert len(backend.calls) == 1
    assert b.pending() == 0 and no_worker_threads()


def test_stop_timeout_drops_what_did_not_finish() -> None:
    backend = FakeBackend(gate=True)
    b, clock, backend, res = make(profile(), backend, delay_ms=0.0)
    b.submit(0, ids(0, 3))
    backend.wait_calls(1)
    b.submit(1, ids(1, 7))
    # The batch of seq 0 is stuck past the timeout; it is released only after stop gave up,
    # so seq 1 must be dropped rather than run.
    stopper_result: list[list[int]] = []
    stopper = threading.Thread(target=lambda: stopper_result.append(b.stop(Deadline.after(0.05), drain=True)))
    stopper.start()
    # Wait until stop() has given up (after its 50 ms) before letting the stuck batch finish.
    # Nothing public shows that moment, so this polls the private flag; the poll only decides
    # when to go on, it asserts nothing about time.
    for _ in range(int(WAIT / 0.01)):
        if b._abort:
            break
        time.sleep(0.01)
    backend.gate.release()
    stopper.join(WAIT)
    assert stopper_result == [[1]]
    assert res.seqs() == [0] and b.pending() == 0 and no_worker_threads()


def test_a_call_under_way_is_waited_for_even_when_the_deadline_expired_long_ago() -> None:
    """A shutdown timeout below the pipeline's reserves (3 s against 6 s kept back after the
    drain) hands stop() a deadline that is already past. The call under way still gets its
    grace from now: before, its thread was left inside the backend and the interpreter's
    teardown aborted (exit -6, "terminate called without an active exception")."""
    backend = FakeBackend(gate=True)
    b, clock, backend, res = make(profile(), backend, delay_ms=0.0)
    b.submit(0, ids(0, 3))
    backend.wait_calls(1)  # running, held at the gate
    threading.Timer(0.1, backend.gate.release).start()  # the call ends 0.1 s into the stop
    drain_by = Deadline.after(3.0).before(6.0)  # as Pipeline derives it from --shutdown-timeout-s 3
    assert drain_by.expired()
    assert b.stop(drain_by, drain=False) == []
    assert b.stuck == [] and no_worker_threads()
    assert res.seqs() == [0]  # the running batch finished and was delivered before stop returned


def test_a_call_that_does_not_return_is_named_stuck_and_stop_still_returns() -> None:
    backend = FakeBackend(gate=True)
    b, clock, backend, res = make(profile(), backend, delay_ms=0.0)
    b.submit(0, ids(0, 3))
    backend.wait_calls(1)
    try:
        b.stop(Deadline.after(0.0), drain=False)
        assert [name.startswith("kwe-dispatch-") for name in b.stuck] == [True]
    finally:
        backend.gate.release()


def test_a_shortened_deadline_shortens_a_drain_already_under_way() -> None:
    """The second stop request: the Deadline the drain holds is shortened, and the drain ends."""
    backend = FakeBackend(gate=True)
    b, clock, backend, res = make(profile(), backend, delay_ms=0.0)
    b.submit(0, ids(0, 3))
    backend.wait_calls(1)  # running, held at the gate
    b.submit(1, ids(1, 7))
    deadline = Deadline.after(3600.0)  # the first request: an hour to drain
    stopper_result: list[list[int]] = []
    stopper = threading.Thread(target=lambda: stopper_result.append(b.stop(deadline, drain=True)))
    stopper.start()
    time.sleep(0.05)
    assert stopper.is_alive() and not b._abort  # draining: waiting for the gated batch
    deadline.shorten(0.0)  # the second request
    for _ in range(int(WAIT / 0.01)):  # when to go on, not a timing assertion (as above)
        if b._abort:
            break
        time.sleep(0.01)
    assert b._abort  # before the fix the drain waited the hour out
    backend.gate.release()
    stopper.join(WAIT)
    assert stopper_result == [[1]]
    assert res.seqs() == [0] and b.pending() == 0 and no_worker_threads()


def test_failed_context_creation_fails_start_and_leaves_no_threads() -> None:
    res = Results()
    backend = FakeBackend(broken_context=1)
    b = Bucketer(profile(), backend, res.on_complete, on_error=res.on_error, dispatchers=2)
    with pytest.raises(BucketerError, match="cannot create backend contexts"):
        b.start()
    assert no_worker_threads()
    assert all(ctx.closed for ctx in backend.contexts)


def test_submit_validates_length_and_state() -> None:
    res = Results()
    b = Bucketer(profile(), FakeBackend(), res.on_complete, on_error=res.on_error)
    with pytest.raises(BucketerStoppedError):
        b.submit(0, ids(0, 3))  # not started
    b.start()
    with pytest.raises(ValueError, match="more than the profile's last bound"):
        b.submit(0, ids(0, 17))
    assert b.stop() == []


# --------------------------------------------------------------------------- merging buckets (cost model)
CPU_PRICES = Prices(fixed_s=0.004, per_row_s=0.0001, per_token_s=0.00004)


def cpu_costs() -> CostModel:
    return CostModel([(b, n, CPU_PRICES.cost(b, n)) for b, n in SHAPES])


def test_a_trickle_across_buckets_runs_as_one_call_when_the_prices_say_so() -> None:
    costs = cpu_costs()
    b, clock, backend, res = make(profile((4, 8, 16), max_batch=8), FakeBackend(gate=True), delay_ms=1e6,
                                  eager=True, pad_to="longest", costs=costs)
    b.submit(0, ids(0, 3))
    backend.wait_calls(1)  # the idle engine took the first keyword alone (eager)
    for seq, n in ((1, 3), (2, 6), (3, 10)):  # one keyword in each bucket while the engine is busy
        b.submit(seq, ids(seq, n))
    backend.gate.release()
    backend.gate.release()
    res.wait_items(4)
    assert [s for s, _, _ in res.batches] == [[0], [1, 2, 3]]
    stats = res.batches[1][2]
    assert (stats.bucket, stats.size, stats.pad_len, stats.merged) == (2, 3, 10, 3)
    check_rows(res.batches, {0: 3, 1: 3, 2: 6, 3: 10})
    assert b.stop() == []


def test_without_prices_the_same_trickle_takes_a_call_per_bucket() -> None:
    b, clock, backend, res = make(profile((4, 8, 16), max_batch=8), FakeBackend(gate=True), delay_ms=1e6,
                                  eager=True, pad_to="longest")
    b.submit(0, ids(0, 3))
    backend.wait_calls(1)
    for seq, n in ((1, 3), (2, 6), (3, 10)):
        b.submit(seq, ids(seq, n))
    for _ in range(4):
        backend.gate.release()
    res.wait_items(4)
    assert [s for s, _, _ in res.batches] == [[0], [1], [2], [3]]
    assert b.stop() == []


def test_a_full_bucket_is_never_merged() -> None:
    b, clock, backend, res = make(profile((4, 8, 16), max_batch=4), FakeBackend(gate=True), delay_ms=1e6,
                                  eager=True, pad_to="longest", costs=cpu_costs())
    b.submit(0, ids(0, 6))
    backend.wait_calls(1)
    b.submit(1, ids(1, 6))  # bucket 8, partial and oldest
    for seq in range(2, 6):  # bucket 4 fills: a backlog
        b.submit(seq, ids(seq, 3))
    for _ in range(3):
        backend.gate.release()
    res.wait_items(6)
    batches = [(s, st.merged, st.pad_len) for s, _, st in res.batches]
    assert batches[0] == ([0], 1, 6)
    assert ([2, 3, 4, 5], 1, 3) in batches and ([1], 1, 6) in batches, batches
    assert b.stop() == []


def test_a_due_partial_batch_takes_its_neighbours_and_nothing_waits_past_its_deadline() -> None:
    # Binary fractions of a second, so "exactly 15.625 ms" is exact in floating point.
    b, clock, backend, res = make(profile((4, 8, 16), max_batch=8), delay_ms=15.625, pad_to="longest",
                                  costs=cpu_costs())
    b.submit(0, ids(0, 7))
    clock.advance(1 / 256)
    b.submit(1, ids(1, 4))
    b.submit(2, ids(2, 12))
    assert settle(b, clock, 1 / 64 - 1 / 256 - 1 / 1024) == 3, "nothing is due before 15.625 ms"
    settle(b, clock, 1 / 1024)  # the oldest is due: it leaves, and its neighbours with it (early)
    res.wait_items(3)
    (seqs, _, stats), = res.batches
    assert sorted(seqs) == [0, 1, 2] and seqs[0] == 0 and stats.merged == 3 and stats.pad_len == 12
    assert max(stats.queue_wait_s) == 1 / 64
    assert b.stop() == []


def test_a_bucket_knows_its_longest_item_after_every_take() -> None:
    from worker.batching.bucket_queues import Bucket, Item

    rng = np.random.default_rng(5)
    bucket = Bucket(index=1, bound=16, limit=8, max_batch=8, lane=0)
    queued: list[int] = []
    for step in range(200):
        if rng.random() < 0.6 or not queued:
            n = int(rng.integers(9, 17))
            bucket.add(Item(step, np.arange(n), 0.0), n)
            queued.append(n)
        else:
            k = int(rng.integers(1, len(queued) + 1))
            assert [len(it.ids) for it in bucket.take_oldest(k)] == queued[:k]
            queued = queued[k:]
        assert bucket.longest == max(queued, default=0) and len(bucket.items) == len(queued)
    bucket.clear()
    assert bucket.longest == 0 and not bucket.items and not bucket.lengths


def test_a_take_holds_what_batch_count_allows_with_or_without_the_budget_shortcut() -> None:
    from worker.batching.bucket_queues import Bucket, Item, take
    from worker.batching.flush_policy import batch_count

    rng = np.random.default_rng(11)
    for trial in range(300):
        max_batch = int(rng.integers(1, 40))
        budget = int(rng.integers(8, 400))
        bucket = Bucket(index=0, bound=16, limit=max_batch, max_batch=max_batch, lane=0)
        lengths = [int(n) for n in rng.integers(3, 17, size=int(rng.integers(1, 60)))]
        for i, n in enumerate(lengths):
            bucket.add(Item(i, np.arange(n), 0.0), n)
        expected = batch_count(len(lengths), iter(lengths), "longest", max_batch, max_batch, budget)
        taken = take(bucket, "longest", budget)
        assert [it.seq for it in taken] == list(range(expected)), (trial, lengths, max_batch, budget)
        assert max(lengths[:expected], default=0) * len(taken) <= max(budget, max(lengths[:1], default=0))


@pytest.mark.parametrize("layout", ["shared lane", "a lane per bucket", "serial"])
def test_every_item_of_polls_submitted_at_once_completes_exactly_once_on_every_lane_layout(layout: str) -> None:
    """Polls of items (submit_many, from feeders at once) over each lane layout: a formed batch
    wakes one dispatcher of its lane, and none may be left waiting with a batch ready."""
    rng = np.random.default_rng(17)
    bounds = (4, 6, 8, 12, 16, 32)
    prof = profile(bounds=bounds, max_batch=16, budget=256, pad_to="longest")
    res = Results()
    backend = FakeBackend(max_contexts=None if layout == "shared lane" else len(bounds))
    backend.requires_serial_dispatch = layout == "serial"
    b = Bucketer(prof, backend, res.on_complete, on_error=res.on_error, max_queue_delay_ms=1.0, dispatchers=3)
    b.start()
    lengths: dict[int, int] = {}
    lock = threading.Lock()

    def feed(start: int) -> None:
        for poll in range(40):
            seqs = list(range(start + poll * 50, start + poll * 50 + 50))
            ns = [int(rng.integers(3, 33)) for _ in seqs]
            with lock:
                lengths.update(zip(seqs, ns))
            b.submit_many(seqs, [ids(seq, n) for seq, n in zip(seqs, ns)])

    feeders = [threading.Thread(target=feed, args=(k * 10_000,)) for k in range(3)]
    for t in feeders:
        t.start()
    for t in feeders:
        t.join()
    res.wait_items(6000)  # before stop: a batch left unwoken would wait here, not be drained by stop
    assert b.stop(drain=True) == []
    counts = Counter(res.seqs())
    assert len(counts) == 6000 and set(counts.values()) == {1}
    check_rows(res.batches, lengths)
    assert no_worker_threads()
