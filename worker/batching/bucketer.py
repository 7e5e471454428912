"""Length-bucketed dynamic batching: intake, flush rules, and dispatch to backend contexts.

Threads and what each one owns:
- callers of `submit` (the Kafka poll thread, the bench feeder): they only append to a
  bucket queue under the lock and, when that changes what the former should do, notify it.
- the former thread ("kwe-bucket-former"): the only thread that takes items *out* of the
  bucket queues. It decides which bucket flushes next, pads the batch into the arrays the
  backend takes (outside the lock), and puts it on the ready queue of the lane that serves
  that bucket. Forming happens while the dispatchers are still running the previous batch,
  so a dispatcher that finishes finds its next batch already padded (work-conserving).
- the dispatcher threads ("kwe-dispatch-N"): each owns its backend context for its whole life
  (created, used and closed on that thread; all of them when the backend requires serial dispatch), pops formed batches from its lane's
  ready queue, runs them, and calls on_complete / on_error. A callback that raises ends its
  dispatcher with a `ThreadDiedError` (the worker's guard trips the fatal latch with it): the
  batch's records can never finish, so going on would only stall the commit point behind them.

All shared state (bucket queues, ready queues, counters, flags) sits behind one lock with
conditions on it: the former waits on `_form_cv`, each lane's dispatchers on that lane's
`_ready_cvs` entry, and `stop()` on `_idle_cv`. A formed batch wakes one dispatcher of its lane,
not all of them: with the lanes' dispatchers on one condition, every batch woke each idle one,
and each that found the batch gone told the former it was idle, waking it for nothing too.

Lanes (which buckets share a ready queue, which contexts each dispatcher owns), the queue
records and the snapshot / take / pad operations on them: worker/batching/bucket_queues.py, called here
with the lock held (pad: on the former, outside it).

Flush rules (full, due, oldest first, eager, merge): worker/batching/flush_policy.py, pure functions of a
snapshot of the buckets and the clock. The former takes the snapshot under the lock, asks
`next_flush`, and applies the answer; so every item leaves within its deadline plus the batch
running and at most one formed before it became due. `eager=True` is the default, chosen by
measurement (benchmarks/results/batching/bucketing.md); `costs` (the worker's merge_buckets setting)
gives the prices merging reads, and every finished call refines them.

Stopping: `stop(deadline)` drains until the `Deadline` (worker/deadline.py) expires, re-reading
it, so a second stop request that shortens the deadline shortens the drain under way.

Over 400 lines because it holds the lock, its three conditions and every thread that shares them;
the decisions themselves are in flush_policy.py, batch_policy.py and bucket_queues.py.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import structlog

from worker.backends.base import Backend, InferenceContext
from worker.batching.bucket_queues import Batch, Bucket, Item, bucket_full, pad, plan_layout, snapshot, take_flush
from worker.batching.cost_model import CostModel
from worker.batching.flush_policy import Flush, next_flush
from worker.core.profiles import PAD_POLICIES, PadPolicy, Profile
from worker.deadline import Deadline
from worker.errors import ThreadDiedError, WorkerError
from worker.operations.batch_stats import BatchStats

log = structlog.get_logger(__name__)

# stop(deadline): how long past its deadline it waits for the threads to end, and how often it
# re-reads the deadline while draining.
JOIN_GRACE_S = 0.5
STOP_STEP_S = 0.05

OnComplete = Callable[[Sequence[int], np.ndarray, BatchStats], None]
OnError = Callable[[Sequence[int], BaseException], None]


class BucketerError(WorkerError):
    """The bucketer was used wrongly (submit after stop, start twice) or cannot start: a fatal
    worker error (the pipeline trips the latch with it)."""


class BucketerStoppedError(BucketerError):
    """submit() after stop() began: the item was not taken."""


class Bucketer:
    def __init__(self, profile: Profile, backend: Backend, on_complete: OnComplete, *, on_error: OnError,
                 max_queue_delay_ms: float = 20.0, dispatchers: int = 1,
                 pad_to: PadPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, eager: bool = True,
                 costs: CostModel | None = None,
                 guard: Callable[[str, Callable[..., None]], Callable[..., None]] | None = None) -> None:
        if max_queue_delay_ms < 0:
            raise ValueError(f"max_queue_delay_ms must be >= 0, got {max_queue_delay_ms}")
        if dispatchers < 1:
            raise ValueError(f"dispatchers must be >= 1, got {dispatchers}")
        # None: the profile's own pad_to. The settings word "auto" is resolved where the settings
        # are read (worker.backend_choice.select.resolve_settings), never here.
        if pad_to is not None and pad_to not in PAD_POLICIES:
            raise ValueError(f"pad_to must be one of {', '.join(PAD_POLICIES)} or None (the profile's), "
                             f"got {pad_to!r}")
        policy: PadPolicy = profile.pad_to if pad_to is None else pad_to
        self.profile = profile
        self.pad_to: PadPolicy = policy
        self._backend = backend
        self._on_complete = on_complete
        self._on_error = on_error
        # Wraps each thread's body (the worker: report an exception to the fatal latch instead
        # of the thread dying silently, worker.latch.guarded).
        self._guard = guard or (lambda name, body: body)
        self._delay = max_queue_delay_ms / 1000.0
        self._clock = clock
        self._eager = eager
        # The measured prices of a call: a partial batch takes neighbouring buckets along when one
        # call costs less than two (worker/batching/batch_policy.py), and every call refines them. None:
        # every batch holds one bucket, as before.
        self._costs = costs

        n_buckets = len(profile.buckets)
        if backend.max_contexts is not None and backend.max_contexts < n_buckets:
            raise BucketerError(f"backend {backend.name} has {backend.max_contexts} contexts but profile "
                                f"{profile.name!r} has {n_buckets} buckets; they must match one to one")
        layout = plan_layout(profile, backend, dispatchers)
        self._lanes = layout.lanes
        self._buckets = layout.buckets
        # The bucket of each token count up to the profile's last bound: a submit's per-item lookup
        # (Profile.bucket_for bisects a tuple it builds per call).
        self._bucket_of_length = [self._buckets[profile.bucket_for(n)] for n in range(profile.max_len + 1)]
        # Which contexts each dispatcher thread creates, owns and runs, and whether it picks the
        # context by the batch's bucket (context i = bucket i) or runs every batch on its one context.
        self._thread_contexts = layout.thread_contexts
        self._by_bucket = layout.by_bucket
        self._budget = profile.token_budget

        self._lock = threading.Lock()
        self._form_cv = threading.Condition(self._lock)
        self._ready_cvs = [threading.Condition(self._lock) for _ in self._lanes]
        self._idle_cv = threading.Condition(self._lock)
        self._queued = 0  # items in bucket queues
        self._pending = 0  # submitted, not yet completed or errored
        self._started = False
        self._stopping = False  # no more submits
        self._drain = True  # while stopping: flush everything regardless of deadlines
        self._abort = False  # stop forming and dispatching; what is left is dropped
        self._former_done = False
        self._live_dispatchers = 0
        self._threads: list[threading.Thread] = []
        # Names of the threads stop() could not join (still inside a backend call).
        self.stuck: list[str] = []
        self._start_errors: list[BaseException] = []
        self._contexts_ready = threading.Barrier(len(self._thread_contexts) + 1)

    # ------------------------------------------------------------------ public API
    def start(self) -> None:
        with self._lock:
            if self._started:
                raise BucketerError("bucketer already started")
            self._started = True
        for lane_no, lane in enumerate(self._lanes):
            for _ in range(lane.threads):
                ctx_ids = self._thread_contexts[len(self._threads)]
                name = f"kwe-dispatch-{ctx_ids[0]}"
                # Daemon: a backend call that never returns must not hold the process at exit
                # (stop() waits for it only until its timeout).
                t = threading.Thread(target=self._guard(name, self._dispatch_loop), args=(lane_no, ctx_ids),
                                     name=name, daemon=True)
                self._threads.append(t)
        self._live_dispatchers = len(self._threads)
        for t in self._threads:
            t.start()
        # Contexts are created on their own threads (a CUDA context must be current on the
        # thread that uses it); wait for all of them so a failure surfaces here, not later.
        self._contexts_ready.wait()
        if self._start_errors:
            with self._lock:
                self._abort = self._stopping = True
                self._wake_dispatchers()
            for t in self._threads:
                t.join()
            raise BucketerError(f"cannot create backend contexts: {self._start_errors[0]!r}") \
                from self._start_errors[0]
        former = threading.Thread(target=self._guard("kwe-bucket-former", self._form_loop),
                                  name="kwe-bucket-former", daemon=True)
        self._threads.insert(0, former)
        former.start()

    def submit(self, seq: int, ids: np.ndarray) -> None:
        """Queue one tokenized item; thread-safe. `ids` must already be cut at the model's max."""
        self.submit_many((seq,), (ids,))

    def submit_many(self, seqs: Sequence[int], ids: Sequence[np.ndarray]) -> None:
        """Queue a poll's tokenized items under one lock; thread-safe. Each item's `ids` must
        already be cut at the model's max; a wrong item raises before any is queued."""
        bucket_of, max_len = self._bucket_of_length, len(self._bucket_of_length) - 1
        picked = []
        for seq, row in zip(seqs, ids, strict=True):
            if not isinstance(row, np.ndarray) or row.ndim != 1:
                raise ValueError(f"item {seq}: ids must be a 1-D numpy array of token ids")
            n = len(row)
            if n > max_len:
                raise ValueError(f"item {seq} has {n} tokens, more than the profile's last bound "
                                 f"{max_len}; truncate at the model's max first")
            picked.append((bucket_of[n], n))
        with self._lock:
            if self._stopping or not self._started:
                raise BucketerStoppedError("bucketer is stopped" if self._stopping else "bucketer not started")
            now = self._clock()
            wake = self._queued == 0
            # The buckets empty before this call (a first item gives a bucket a deadline).
            empty = None if wake else [not b.items for b in self._buckets]
            for seq, row, (bucket, n) in zip(seqs, ids, picked):
                bucket.add(Item(seq, row, now), n)
            self._queued += len(picked)
            self._pending += len(picked)
            if empty is not None:
                # Wake the former only when its decision can change: a bucket it touched is full,
                # or was empty and so has a new deadline to wait for (a later item's deadline is
                # never earlier than its bucket head's), or an idle dispatcher could take it now.
                # Read once per bucket after the adds, not once per item.
                for index in {b.index for b, _ in picked}:
                    bucket = self._buckets[index]
                    lane = self._lanes[bucket.lane]
                    if lane.has_room() and (self._is_full(bucket) or (
                            empty[index] and lane.idle > len(lane.ready) + lane.forming)):
                        wake = True
                        break
            if wake:
                self._form_cv.notify()

    @property
    def backend_name(self) -> str:
        return str(self._backend.name)

    @property
    def threads(self) -> list[threading.Thread]:
        """The former and dispatcher threads, once started (for the liveness probe)."""
        return list(self._threads)

    def pending(self) -> int:
        """Items submitted and not yet completed or errored."""
        with self._lock:
            return self._pending

    def queued(self) -> int:
        """Items waiting in bucket queues (not yet formed into a batch)."""
        with self._lock:
            return self._queued

    def wake(self) -> None:
        """Re-read the clock now: for tests that drive an injected clock forward."""
        with self._lock:
            self._form_cv.notify_all()

    def stop(self, deadline: Deadline | None = None, *, drain: bool = True) -> list[int]:
        """Stop taking items and join every thread; returns the seqs that were never run.

        drain=True: everything queued is flushed (without waiting for deadlines) and run; once
        `deadline` expires the rest is dropped (None: no limit). The deadline is re-read while
        draining, so a second stop request that shortens it shortens the drain already under
        way. drain=False: queued items are dropped at once. Batches already running on the
        backend cannot be interrupted; they finish and are delivered before stop() returns, so
        no callback ever runs after it (threads are joined until JOIN_GRACE_S past the deadline).
        """
        deadline = deadline if deadline is not None else Deadline()
        with self._lock:
            if not self._started:
                self._stopping = True
                return [it.seq for b in self._buckets for it in b.items]
            self._stopping = True
            self._drain = drain
            if not drain:
                self._abort = True
            self._form_cv.notify_all()
            self._wake_dispatchers()
            if drain:
                while not self._finished_locked():
                    remaining = deadline.left()
                    if remaining <= 0:
                        break
                    # In steps: a shortened deadline is seen without waiting for a notify.
                    self._idle_cv.wait(min(remaining, STOP_STEP_S))
                if not self._finished_locked():
                    self._abort = True
                    self._form_cv.notify_all()
                    self._wake_dispatchers()
        # A call under way gets JOIN_GRACE_S from now even when the deadline expired long ago
        # (a shutdown timeout below the pipeline's reserves): most calls end within it, and a
        # thread left inside a backend at exit aborts the interpreter's teardown.
        join_by = max(deadline.before(-JOIN_GRACE_S), Deadline.after(JOIN_GRACE_S), key=lambda d: d.left())
        for t in self._threads:
            left = join_by.left()
            t.join(None if math.isinf(left) else left)
        self.stuck = [t.name for t in self._threads if t.is_alive()]
        if self.stuck:
            log.warning("bucketer threads still running at stop (a backend call that does not return)",
                        threads=self.stuck)
        with self._lock:
            dropped = [it.seq for b in self._buckets for it in b.items]
            dropped += [it.seq for lane in self._lanes for batch in lane.ready for it in batch.items]
            for b in self._buckets:
                b.clear()
            for lane in self._lanes:
                lane.ready.clear()
            self._queued = 0
            self._pending -= len(dropped)
        return dropped

    def _wake_dispatchers(self) -> None:
        """Every dispatcher of every lane re-reads the state (stopping, aborting); lock held."""
        for cv in self._ready_cvs:
            cv.notify_all()

    # ------------------------------------------------------------------ flush rules (lock held)
    # The decisions are worker/batching/flush_policy.py's pure functions, fed by worker/batching/bucket_queues.py.
    def _is_full(self, b: Bucket) -> bool:
        return bucket_full(b, self.pad_to, self._budget)

    def _finished_locked(self) -> bool:
        if self._live_dispatchers == 0:
            return True  # nothing can run any more (only after a thread died on a bug)
        return self._queued == 0 and all(not lane.ready and not lane.forming and not lane.running
                                         for lane in self._lanes)

    def _take_flush(self, flush: Flush) -> tuple[Bucket, list[Item], int]:
        target, items, merged = take_flush(self._buckets, flush, self.pad_to, self._budget)
        self._queued -= len(items)
        return target, items, merged

    # ------------------------------------------------------------------ threads
    def _form_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while True:
                        if self._abort or (self._stopping and self._queued == 0):
                            return
                        snap = snapshot(self._lanes, self._buckets, self.pad_to, self._budget,
                                        delay=self._delay, eager=self._eager,
                                        flush_all=self._stopping and self._drain,
                                        prices=self._costs.prices() if self._costs is not None else None)
                        decision = next_flush(snap, self._clock())
                        if isinstance(decision, Flush):
                            break
                        self._form_cv.wait(decision.seconds)
                    lane = self._lanes[decision.lane]
                    target, items, merged = self._take_flush(decision)
                    lane.forming += 1
                # Padding outside the lock: submitters and dispatchers are not held up by it.
                batch = self._pad(target, items, merged)
                with self._lock:
                    lane.forming -= 1
                    lane.ready.append(batch)
                    self._ready_cvs[decision.lane].notify()
        finally:
            with self._lock:
                self._former_done = True
                self._wake_dispatchers()
                self._idle_cv.notify_all()

    def _pad(self, b: Bucket, items: list[Item], merged: int = 1) -> Batch:
        return pad(b, items, self.pad_to, merged)

    def _dispatch_loop(self, lane_no: int, ctx_ids: tuple[int, ...]) -> None:
        lane, ready_cv = self._lanes[lane_no], self._ready_cvs[lane_no]
        contexts: dict[int, InferenceContext] = {}
        try:
            for i in ctx_ids:
                contexts[i] = self._backend.create_context(i)
        except BaseException as exc:  # reported by start(), which then stops every thread
            self._start_errors.append(exc)
            self._contexts_ready.wait()
            self._close_contexts(contexts)
            self._dispatcher_exit()
            return
        only = contexts[ctx_ids[0]]
        self._contexts_ready.wait()
        try:
            while True:
                with self._lock:
                    while not lane.ready:
                        if self._abort or self._former_done:
                            return
                        lane.idle += 1
                        # Due partial batches (and, eager, any partial batch) are formed for
                        # an idle dispatcher: tell the former one is waiting.
                        self._form_cv.notify()
                        ready_cv.wait()
                        lane.idle -= 1
                    if self._abort:
                        return
                    batch = lane.ready.popleft()
                    lane.running += 1
                    self._form_cv.notify()  # room on the ready queue: form the next batch now
                try:
                    self._run(contexts[batch.bucket] if self._by_bucket else only, batch)
                finally:
                    # Also when a callback raised (the thread then ends): stop() must not wait
                    # for a batch that no thread runs any more.
                    with self._lock:
                        lane.running -= 1
                        self._pending -= len(batch.items)
                        if self._stopping:  # only stop() waits on it (notify_all costs even with no waiter)
                            self._idle_cv.notify_all()
        finally:
            self._close_contexts(contexts)
            self._dispatcher_exit()

    @staticmethod
    def _close_contexts(contexts: dict[int, InferenceContext]) -> None:
        for ctx in contexts.values():
            try:
                ctx.close()
            except Exception:  # one context failing to close must not keep the others open
                log.exception("closing a backend context failed")

    def _dispatcher_exit(self) -> None:
        with self._lock:
            self._live_dispatchers -= 1
            self._idle_cv.notify_all()

    def _run(self, ctx: InferenceContext, batch: Batch) -> None:
        seqs = [it.seq for it in batch.items]
        start = self._clock()
        try:
            out = ctx.run(batch.input_ids, batch.attention_mask)
        except Exception as exc:  # the batch fails, the bucketer keeps running
            self._callback("on_error", self._on_error, seqs, exc)
            return
        end = self._clock()
        size, pad_len = batch.input_ids.shape
        if self._costs is not None:
            self._costs.observe(size, pad_len, end - start)
        stats = BatchStats(bucket=batch.bucket, bound=self._buckets[batch.bucket].bound, size=size,
                           pad_len=pad_len, real_tokens=batch.real_tokens, padded_tokens=size * pad_len,
                           queue_wait_s=[start - it.t_submit for it in batch.items], backend_s=end - start,
                           merged=batch.merged)
        self._callback("on_complete", self._on_complete, seqs, out, stats)

    @staticmethod
    def _callback(name: str, callback: Callable[..., None], seqs: Sequence[int], *args: object) -> None:
        """Hands a batch to the caller. The callback is what takes the batch's records out of
        flight (the worker: its output stage), so one that raises strands them: their offsets
        never finish and commits (or an exactly-once transaction) wait behind them for good.
        Logging it and going on, as this did, left the worker running with a stalled commit point
        until /healthz's stall timeout; a bug there is a thread failure like any other."""
        try:
            callback(seqs, *args)
        except WorkerError:
            raise  # already the user's one line
        except Exception as exc:
            raise ThreadDiedError(
                f"thread {threading.current_thread().name}: the {name} callback raised for a batch of {len(seqs)} "
                f"items: {exc!r}; their records can never finish, so nothing past them is committed") from exc
