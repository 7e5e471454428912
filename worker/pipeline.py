"""The worker's run: start, the poll loop, drain and shutdown of intake -> bucketer -> output, wired
by `worker.app.wire_pipeline` (the one assembly place; this module builds nothing).

Threads and what each one owns:
- the poll thread (the caller of `Pipeline.run`): the group member (consume, pause/resume,
  rebalance callbacks), intake (decode, validate, tokenize, submit) and the committer.
- the bucketer's former and dispatcher threads: bucket state, one backend context each.
- the output thread (`OutputStage`): encodes finished batches and produces them.
- the delivery thread (`OutputProducer`): serves delivery callbacks, which acknowledge.
- the metrics server thread, when enabled (reads only).
Cross-thread state: the in-flight table (one lock), each partition's offsets (one lock each),
and the fatal latch, which every thread reports to and the poll thread watches.

Delivery (processing_guarantee) is a `Delivery` (worker/ledger/guarantees.py), called at fixed points of
the loop; this module never asks which guarantee runs. At-least-once (default): an input offset
is committed only after its output (or its dead-letter record) is acknowledged, and never past
a partition's lowest unfinished offset. Exactly-once: outputs, dead letters and offsets commit
in one transaction, closed only once nothing consumed into it is in flight.
A fatal error anywhere stops the worker with that error and exit code 1; nothing past the
failed record is committed. Shutdown (SIGTERM) drains, flushes, commits, leaves the group and stops
within one `Deadline` (shutdown_timeout_s), which every step re-reads; a second signal aborts and
shortens it to 2 s. What still runs EXIT_GRACE_S past it (a leave parked by the coordinator, a
librdkafka call no bound reaches) is abandoned: `on_overrun` exits the process, committing no more.

A bounded run (`keyword-embedder backfill`) adds a `PollGate` (worker/backfill/gate.py), on the poll
thread: how many records a turn may take (its rate limit), which consumed records are processed
(those within its range), and when its work is done, which stops the pipeline as a SIGTERM does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import structlog

from worker.core.interpreter_hold import HoldPlan, InterpreterHold
from worker.core.os_threads import current_cpu, thread_affinities
from worker.deadline import Deadline, Overrun
from worker.ledger.acks import Acknowledger
from worker.ledger.guarantees import Delivery
from worker.ledger.inflight import InFlightTable
from worker.errors import ThreadDiedError, WorkerError
from worker.intake.flow import FlowControl
from worker.intake.stage import Intake
from worker.ledger.committer import Committer
from worker.kafka.consumer import GroupMember
from worker.kafka.producer import OutputProducer
from worker.latch import FatalLatch
from worker.operations.health import Liveness
from worker.operations.metrics import Metrics
from worker.output.stage import OutputStage
from worker.output.tracing import BatchSpans
from worker.settings.schema import Settings

if TYPE_CHECKING:
    from confluent_kafka import Message

    from worker.batching.bucketer import Bucketer

log = structlog.get_logger(__name__)

# Of the shutdown deadline, what is kept back after draining for flush + final commit, after
# those for leaving the group, and after leaving for the delivery thread's stop and the spans.
AFTER_DRAIN_S = 6.0
LEAVE_S = 3.0
AFTER_LEAVE_S = 1.0
# Past the deadline by this, the process exits whatever still runs (`on_overrun`): with the exit
# itself, a stop ends within shutdown_timeout_s + 2 s (docs/operating.md, "Stopping").
EXIT_GRACE_S = 1.5
# A second stop request: everything still running gets at most this long.
ABORT_S = 2.0
# At the in-flight bound intake holds (consumes nothing, partitions not paused) while room comes
# back, checking every HOLD_STEP_S; held this long, it pauses the partitions (a slow or stuck
# stage: a paused member serves the group). Rebalance callbacks wait out a hold at most.
HOLD_S = 2.0
HOLD_STEP_S = 0.005
HOLD_LOG_S = 10.0


class PollGate(Protocol):
    """What a bounded run adds to the poll loop (a backfill: worker/backfill/gate.py); `run` has none."""

    def room(self, want: int) -> int:
        """How many records this turn may consume, at most `want` (0: none this turn)."""
        ...

    def admit(self, msgs: Sequence[Message]) -> list[Message]:
        """The consumed records to process; the rest are dropped before intake (never tracked)."""
        ...

    def finished(self) -> bool:
        """True once the run's work is done and committed: the pipeline then stops as on SIGTERM."""
        ...


@dataclass(frozen=True)
class Stages:
    """What a Pipeline runs, wired by `worker.app.wire_pipeline` (the one assembly place)."""

    inflight: InFlightTable
    flow: FlowControl
    producer: OutputProducer
    acks: Acknowledger
    committer: Committer
    member: GroupMember
    delivery: Delivery
    output: OutputStage
    bucketer: Bucketer
    intake: Intake
    liveness: Liveness
    spans: BatchSpans | None
    gate: PollGate | None = None


class Shutdown:
    """The stop state the stages are built with: the fatal latch, the one `Deadline` and its views,
    the stop and abort requests. Made before the stages (they hold the latch and read the views),
    run by the Pipeline."""

    def __init__(self, settings: Settings) -> None:
        self.latch = FatalLatch()
        self.stop = threading.Event()
        self.abort = threading.Event()
        # The one shutdown deadline; its views end earlier by what later steps need.
        self.deadline = Deadline()
        self.drain_by = self.deadline.before(AFTER_DRAIN_S)
        self.commit_by = self.deadline.before(LEAVE_S)
        self.leave_by = self.deadline.before(AFTER_LEAVE_S)
        self._revoke_timeout_s = settings.revoke_timeout_s
        # How long a stop may take (shutdown_timeout_s): the deadline a stop request starts.
        self.timeout_s = settings.shutdown_timeout_s

    def revoke_wait_s(self) -> float:
        """How long a revocation waits for its partitions' records (none once stopping hard)."""
        if self.abort.is_set() or self.latch.is_set():
            return 0.0
        return min(self._revoke_timeout_s, self.drain_by.left())


class Pipeline:
    """Runs wired stages: start, the poll loop, drain and shutdown. It builds nothing."""

    def __init__(self, shutdown: Shutdown, stages: Stages, metrics: Metrics, *,
                 on_overrun: Callable[[int], None] | None = None, hold: HoldPlan | None = None,
                 identity: dict[str, str] | None = None) -> None:
        self.metrics = metrics
        self.latch = shutdown.latch
        self._timeout_s = shutdown.timeout_s
        self._stop, self._abort = shutdown.stop, shutdown.abort
        self.deadline, self._drain_by, self._commit_by = shutdown.deadline, shutdown.drain_by, shutdown.commit_by
        self._leave_by = shutdown.leave_by
        # Given by run and backfill: exits with the code, EXIT_GRACE_S past the deadline (None: not watched).
        self.on_overrun = on_overrun
        self._step = "running"  # the shutdown step under way, for the overrun's log line
        self.left_group = True
        self._inflight, self._flow, self._acks = stages.inflight, stages.flow, stages.acks
        self._producer, self._committer, self._member = stages.producer, stages.committer, stages.member
        self._delivery, self._output, self._bucketer = stages.delivery, stages.output, stages.bucketer
        self._intake, self._spans = stages.intake, stages.spans
        self._gate = stages.gate
        self.liveness = stages.liveness
        # Since when intake holds at the in-flight bound (poll thread; None: not holding), and the
        # holds since the last log line about them (one line per HOLD_LOG_S at most).
        self._held_since: float | None = None
        self._holds_unlogged = 0
        self._hold_logged_at = float("-inf")
        # Where the interpreter's threads are held (decided at build time; None: unheld), and the
        # hold that carries it out once the pipeline runs, moving them where the plan says (poll thread).
        self._hold_plan = hold
        self._interpreter: InterpreterHold | None = None
        # What the start log states beside the settings (the model, its fingerprint and precision),
        # given by the assembly (worker.app.build_pipeline).
        self.identity: dict[str, str] = identity if identity is not None else {}

    # ------------------------------------------------------------------ state for probes
    def ready(self) -> tuple[bool, dict[str, bool]]:
        checks = {"assigned": bool(self._committer.tracker.partitions()), "no_fatal_error": not self.latch.is_set()}
        return all(checks.values()), checks

    @property
    def backend_calls_running(self) -> bool:
        """After run(): a dispatcher was still inside a backend call when the bucketer stopped."""
        return bool(self._bucketer.stuck)

    def in_flight(self) -> int:
        return len(self._inflight)

    def uncommitted(self) -> int:
        return self._committer.uncommitted()

    def outcomes(self) -> tuple[int, int]:
        """(embedded, dead-lettered): inputs acknowledged so far."""
        return self._acks.embedded_count, self._acks.dead_lettered_count

    def request_stop(self) -> None:
        """First call: drain, commit and leave within shutdown_timeout_s. Second call: abort now."""
        if self._stop.is_set():
            self._abort.set()
            self._producer.interrupt()
            self.deadline.shorten(ABORT_S)
            log.warning("second stop request: aborting without draining")
            return
        self.deadline.start(self._timeout_s)
        self._stop.set()

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        """Runs until stopped; returns the process exit code (0, 1 on a fatal error, 130 aborted)."""
        if self.on_overrun is not None:
            Overrun(self.deadline, EXIT_GRACE_S, self._overran).start()
        try:
            # Inside the try: a bucketer that cannot create its backend contexts is a fatal
            # error like any other (exit 1, one line), and the shutdown below still runs.
            self._bucketer.start()
            self._output.start()
            self._producer.start()
            # Each stage states the settings it was built with.
            log.info("worker started", processing_guarantee=self._delivery.guarantee, group=self._member.group,
                     input_topic=self._member.topic, output_topic=self._output.topic,
                     dead_letter_topic=self._output.dead_letter_topic, max_in_flight=self._flow.max_records,
                     max_in_flight_bytes=self._flow.max_bytes, **self.identity)
            self._delivery.start()
            self._member.subscribe(self._member.topic, self._delivery)
            self._interpreter = self._hold_interpreter()
            while not self._stop.is_set() and not self.latch.is_set():
                self._poll_once()
            if not self.latch.is_set() and not self._abort.is_set():
                self._drain()
        except WorkerError as exc:
            self.latch.trip(exc)
        except Exception as exc:  # noqa: BLE001 - a bug on the poll thread stops the worker like any other
            self.latch.trip(ThreadDiedError(f"the poll thread failed: {exc!r}"))
            log.exception("poll thread failed")
        finally:
            # Stopping on a fatal error: the same deadline applies (a no-op after a stop request).
            self.deadline.start(self._timeout_s)
            self._shutdown()
            if self._interpreter is not None:
                self._interpreter.release()
        if self.latch.error is not None:
            log.error("worker stopped on a fatal error", error=str(self.latch.error))
        return self.exit_code()

    def exit_code(self) -> int:
        """0 stopped, 1 on a fatal error, 130 aborted (a second stop request)."""
        if self.latch.error is not None:
            return 1
        return 130 if self._abort.is_set() else 0

    def _overran(self) -> None:
        """EXIT_GRACE_S past the shutdown deadline and still not exited (the stop watch's thread)."""
        log.error("the stop overran its deadline: exiting without waiting for the rest", step=self._step,
                  shutdown_timeout_s=self._timeout_s, exit_code=self.exit_code())
        if self.on_overrun is not None:
            self.on_overrun(self.exit_code())

    def _poll_once(self) -> None:
        uncommitted = self._committer.uncommitted()
        pending = uncommitted if self._delivery.bound_counts == "uncommitted" else len(self._inflight)
        now = time.monotonic()
        if self._interpreter is not None:
            self._interpreter.check(now)  # one comparison but once a second
        self._flow.observe(now, self._acks.embedded_count + self._acks.dead_lettered_count,
                           busy=uncommitted > 0)
        pause = self._delivery.poll_step(flow_paused=self._flow.update(pending, self._inflight.bytes))
        # Intake stops (the bound, a transaction closing): True when the delivery brings the room
        # back without a pause (at least once: its commit at the bound), so intake holds. Paused,
        # the regular asynchronous commits free the room: no synchronous one blocks the poll thread.
        if pause is not None and not self._member.paused and self._delivery.relieve(self._flow.resume_at) \
                and self._hold(pending, pause):
            return
        self._held_since = None
        if pause is not None:
            self._member.set_paused(True, reason=pause)
        else:
            self._member.set_paused(False)
        self.metrics.set_in_flight(pending)
        room = self._flow.room(pending) if pause is None else 1
        if self._gate is not None and (room := self._gate.room(room)) == 0:
            return  # over the rate limit this turn (room waited for a token already)
        msgs = self._member.consume(room, 0.05)
        if self._gate is not None:
            msgs = self._gate.admit(msgs)
        if msgs:
            self._delivery.before_intake()
            self._intake.handle(msgs)
        if self._gate is not None and self._gate.finished() and not self._stop.is_set():
            log.info("the run's work is done: stopping")
            self.request_stop()

    def _hold_interpreter(self) -> InterpreterHold | None:
        """This thread and the kwe-* threads, all started by now, on one CPU, as the plan given at
        build time says (worker/core/interpreter_hold.py: `plan_hold`); the clients' and the
        runtimes' own threads, started before, keep the process's set. Returns the hold, which
        moves them when another process takes that CPU where the plan says so. A refusal costs
        speed, not correctness: logged, and the worker runs on unheld."""
        plan = self._hold_plan
        if plan is None:
            return None
        cpu = plan.cpu if plan.cpu is not None else current_cpu()
        if cpu is None:
            return None
        moves = plan.moves
        hold = InterpreterHold(list(plan.cpus), leave=plan.leave,
                               on_move=lambda old, new, loads: self._interpreter_moved(old, new, loads, hold.followers),
                               adaptive=moves, threads=thread_affinities)
        try:
            held = hold.start(cpu, time.monotonic())
        except OSError as exc:
            log.warning("interpreter threads not held on one CPU; they run where the OS puts them",
                        cpu=cpu, error=str(exc))
            return None
        self.metrics.set_interpreter_cpu(cpu)
        log.info("interpreter threads held on one CPU", cpu=cpu, threads=len(held), moves=plan.describe_moves())
        return hold

    @property
    def interpreter_cpu(self) -> tuple[int | None, bool]:
        """The CPU the interpreter's threads are held on (None: unheld), and whether the hold moves."""
        hold = self._interpreter
        return (None, False) if hold is None else (hold.cpu, hold.adaptive)

    def _interpreter_moved(self, previous: int, cpu: int, loads: Mapping[int, float], followers: int) -> None:
        self.metrics.set_interpreter_cpu(cpu)
        log.info("interpreter threads moved to a freer CPU", previous=previous, cpu=cpu,
                 foreign_load={str(c): round(v, 2) for c, v in sorted(loads.items())},
                 followers_so_far=followers)

    def _hold(self, pending: int, reason: str) -> bool:
        """Intake stopped (`reason`: the in-flight bound, a transaction closing) and the delivery
        able to end it: True when this turn holds (consumes nothing, waits a step) instead of
        pausing. A pause costs a backlog its prefetched records and up to a second before
        librdkafka fetches again; a hold keeps both, and room comes back from the other threads
        (acknowledgements) and the delivery (at least once: the commit of the finished work;
        exactly once does not hold). Only for HOLD_S at a time: longer means a slow or stuck stage,
        and a paused member serves the group meanwhile."""
        now = time.monotonic()
        if self._held_since is not None and now - self._held_since >= HOLD_S:
            return False
        if self._held_since is None:
            self._held_since = now
            self.metrics.count_intake_hold()
            self._holds_unlogged += 1
            if now - self._hold_logged_at >= HOLD_LOG_S:
                log.info("intake holds", reason=reason, holds=self._holds_unlogged, in_flight=pending,
                         limit=self._flow.limit)
                self._hold_logged_at, self._holds_unlogged = now, 0
        self.metrics.set_in_flight(pending)
        time.sleep(HOLD_STEP_S)
        return True

    # ------------------------------------------------------------------ shutdown
    def _drain(self) -> None:
        """Stop taking new keywords, finish what is in flight, commit it."""
        self._member.pause_all()
        self._step, start = "drain", time.monotonic()
        log.info("draining", in_flight=self.in_flight(), timeout_s=round(self._drain_by.left(), 3))
        while self.in_flight() and not self._drain_by.expired() and not self._abort.is_set() \
                and not self.latch.is_set():
            # Keep serving the group (heartbeats, commit callbacks) while paused.
            self._member.serve(0.05)
            self._delivery.drain_step()
        log.info("drained", in_flight=self.in_flight(), seconds=round(time.monotonic() - start, 3))

    def _shutdown(self) -> None:
        clean = not self._abort.is_set() and not self.latch.is_set()
        # Each step waits at most until its view of the one deadline (re-read: a second signal
        # shortens them all); a fatal error or an abort gives the batches under way 0.5 s at most.
        self._step = "batches and outputs"
        never_run = self._bucketer.stop(self._drain_by if clean else Deadline.after(0.5), drain=clean)
        self._output.stop(self._commit_by if clean else Deadline.after(0.5))
        if clean:
            unacked = self._producer.flush(self._commit_by)
            if unacked:
                log.warning("records still unacknowledged at the deadline", records=unacked)
        self._step = "final commit"
        self._delivery.finish(self._commit_by, self._member.serve, drained=clean, aborted=self._abort.is_set())
        self._step = "leave the group"
        self.left_group = self._member.close(self._leave_by)
        self._step = "delivery thread and spans"
        self._producer.stop(timeout_s=self.deadline.capped(1.0))
        if self._spans is not None:
            # Spans of what was produced, exported within what is left (a collector that is
            # down costs at most this, never the commit, which is done).
            self._spans.close(timeout_s=self.deadline.capped(2.0))
        log.info("worker stopped", consumed=self._intake.consumed, produced=self._acks.embedded_count,
                 dead_lettered=self._acks.dead_lettered_count, in_flight=self.in_flight(),
                 dropped_after_revoke=self._output.dropped, never_run=len(never_run or []),
                 left_group=self.left_group, processing_guarantee=self._delivery.guarantee,
                 **self._delivery.summary())
