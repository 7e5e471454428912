"""`keyword-embedder backfill`: embed a range of the input topic's history into an output topic, and exit.

The range runs from `--from` (the log start, an offset, or a timestamp) to each partition's end
when the backfill first started; records that arrive later are left to the live group. It runs in
a consumer group of its own (`--group-id`, default `<output topic>-backfill`), committed as it goes,
so a restart with the same arguments resumes where the last run stopped and ends where the first
would have (worker/backfill/range.py). The pipeline is `run`'s (worker/app.py): the same model,
batching, guarantees (`--processing-guarantee`) and dead letters; `--max-rate` caps how fast it
reads, so a shared machine keeps room for the live group.

Exit codes: 0 once the whole range is done (also when an earlier run finished it); 130 when stopped
(SIGTERM/SIGINT: it drains, commits and says what is left; rerun to resume); 1 on a fatal error;
2 when it cannot start (a setting, the cluster, the model).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

import structlog

from worker.operations.logs import configure_logging
from worker.operations.stop_signals import StopDuringStartup, StopSignals
from worker.settings.loader import add_setting_flags, load_settings
from worker.settings.schema import setting_fields

PROG = "keyword-embedder backfill"
# The exit code of a backfill stopped before the end of its range (as a shell's for SIGINT).
STOPPED = 130
# How long the summary after a stop or a failure tries to read what is left from the group (the
# pipeline has stopped by then; past it, what the gate saw last).
LEFT_READ_S = 10.0


def configure(parser: argparse.ArgumentParser) -> None:
    # Every setting of `run` but the group: KWE_GROUP_ID and the config file's group_id name the
    # live group, which a backfill must never join.
    add_setting_flags(parser, only=[f.name for f in setting_fields() if f.name != "group_id"])
    parser.add_argument("--from", dest="origin", default="beginning", metavar="WHERE",
                        help="Where the range begins in every partition: 'beginning' (the log start, default), an "
                             "offset (1200), epoch milliseconds (1717171717000ms) or an ISO 8601 timestamp "
                             "(2026-05-01T00:00:00Z: the first record at or after it). It ends at each partition's "
                             "end when the backfill first started.")
    parser.add_argument("--group-id", "--group", dest="backfill_group", default="", metavar="GROUP",
                        help="The backfill's own consumer group (default: <output topic>-backfill); its range is "
                             "kept in GROUP-range. Rerun with the same group and --from to resume.")
    parser.add_argument("--max-rate", type=float, default=0.0, metavar="R",
                        help="Read at most R keywords per second (a token bucket on consumption), to leave room "
                             "for the live group; 0: as fast as the worker embeds.")
    parser.add_argument("--live-group", default="", metavar="GROUP",
                        help="The new model's live group: the range ends where it begins (its committed offsets), "
                             "and where it has none yet it gets the range's end as its start, so no record is "
                             "embedded by both and none by neither. Give it at the first start, before GROUP runs "
                             "(docs/cutover.md).")
    parser.add_argument("--capture-only", action="store_true",
                        help="Capture and keep the range (and hand its end to --live-group), print it, and exit 0 "
                             "without embedding; the same command without it then embeds the range.")
    parser.add_argument("--no-progress", action="store_true", help="No progress bar (or progress log lines).")


def main(args: argparse.Namespace, signals: StopSignals | None = None) -> int:
    signals = signals if signals is not None else StopSignals()
    try:
        return _main(args, signals)
    except StopDuringStartup as stop:
        print(f"{PROG}: stopped by {stop} during start-up; nothing was embedded, rerun to start", file=sys.stderr)
        return STOPPED
    except BaseException:
        name = signals.stopped_during_startup()  # a signal that surfaced as another exception
        if name is None:
            raise
        print(f"{PROG}: stopped by {name} during start-up; nothing was embedded, rerun to start", file=sys.stderr)
        return STOPPED


def _main(args: argparse.Namespace, signals: StopSignals) -> int:
    from worker.core.errors import KeywordEmbedderError

    log = structlog.get_logger("worker.backfill")
    if args.max_rate < 0:
        print(f"{PROG}: --max-rate must be >= 0", file=sys.stderr)
        return 2
    try:
        settings, plan, cluster = _start(args)
    except KeywordEmbedderError as exc:
        if signals.stopped_during_startup():
            raise StopDuringStartup(signals.requested) from None
        if structlog.is_configured():
            log.error("cannot start the backfill", error=str(exc))
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    from worker.backfill.progress import Outcome, summary

    if plan.complete or args.capture_only:
        summary(Outcome(plan, plan.range.total - sum(plan.left.values()), 0, 0, 0, 0.0, plan.left,
                        "--capture-only" if args.capture_only else None),
                group=settings.group_id, output_topic=settings.output_topic)
        return 0
    return _run(args, settings, plan, cluster, signals)


def _start(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """Settings, the cluster check, the range and where it resumes: a KeywordEmbedderError on what stops start-up."""
    from worker.backfill.group_offsets import GroupOffsets, empty_group_wait_s
    from worker.backfill.range import FromSpec, Kafka, open_range, prepare
    from worker.kafka.client_config import admin_config, client_config, secret_values
    from worker.kafka.client_config import consumer_config
    from worker.kafka.preflight import check_topics
    from worker.settings.schema import SettingsError

    origin = FromSpec.parse(args.origin)
    settings = load_settings(args)
    group = args.backfill_group or f"{settings.output_topic}-backfill"
    if group == settings.group_id:
        raise SettingsError(f"--group-id {group!r} is the live group's (group_id): a backfill needs a group of its "
                            f"own; leave --group-id out for {settings.output_topic}-backfill")
    settings = dataclasses.replace(settings, group_id=group)
    client_config(settings)
    configure_logging(settings.log_format, settings.log_level, secrets=secret_values(settings))
    check_topics(admin_config(settings), settings)

    from confluent_kafka.admin import AdminClient

    if args.live_group == group:
        raise SettingsError(f"--live-group {args.live_group!r} is the backfill's own group")
    # A killed run's member stays in the group for its session: the one its consumer runs with.
    kafka = Kafka(AdminClient(admin_config(settings)), GroupOffsets(admin_config(settings)),
                  empty_wait_s=empty_group_wait_s(consumer_config(settings)))
    try:
        rng, kept = open_range(kafka, group, settings.input_topic, origin, live_group=args.live_group)
        plan = prepare(kafka, group, rng)
    finally:
        kafka.groups.close()
    structlog.get_logger("worker.backfill").info(
        "backfill range", topic=rng.topic, group=group, origin=rng.origin, kept=kept, offsets=rng.total,
        done_before=plan.done_before, left=sum(plan.left.values()),
        partitions={p.partition: [p.start, p.end] for p in rng.parts})
    if origin.kind == "offset" and rng.total == 0 and rng.parts and origin.value >= max(p.end for p in rng.parts) > 0:
        print(f"{PROG}: --from {args.origin} is past every partition's end: nothing to embed (epoch milliseconds "
              f"are written {args.origin}ms)", file=sys.stderr)
    return settings, plan, admin_config(settings)


def _run(args: argparse.Namespace, settings: Any, plan: Any, cluster: dict[str, Any], signals: StopSignals) -> int:
    from worker.app import build_pipeline
    from worker.backfill.gate import RangeGate
    from worker.backfill.progress import Outcome, Progress, summary
    from worker.backfill.rate import TokenBucket
    from worker.core.errors import KeywordEmbedderError
    from worker.operations.metrics import Metrics
    from worker.operations.probes import run_served
    from worker.commands.run import exit_now

    log = structlog.get_logger("worker.backfill")
    metrics = Metrics()
    progress = Progress(plan, enabled=not args.no_progress)
    limiter = TokenBucket(args.max_rate) if args.max_rate else None
    gates: list[RangeGate] = []

    def gate(consumer: Any, tracker: Any) -> RangeGate:
        gates.append(RangeGate(plan, consumer, tracker, limiter=limiter, on_progress=progress.update))
        return gates[-1]

    try:
        # As run's: a stop stuck in librdkafka past its deadline exits within shutdown_timeout_s + 2 s.
        assembled = build_pipeline(settings, metrics=metrics, gate=gate, on_overrun=exit_now)
    except KeywordEmbedderError as exc:
        progress.close()
        if signals.stopped_during_startup():
            raise StopDuringStartup(signals.requested) from None
        log.error("cannot start the backfill", error=str(exc))
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    pipeline = assembled.pipeline
    stopped: list[bool] = []

    def stop() -> None:
        stopped.append(True)
        pipeline.request_stop()

    signals.on_stop = stop
    try:
        code = run_served(pipeline, metrics, settings.metrics_host, settings.metrics_port, log=log)
    finally:
        assembled.close()
        progress.close()
    [range_gate] = gates
    embedded, dead_lettered = pipeline.outcomes()
    left = {} if range_gate.complete else _left(cluster, settings.group_id, plan, range_gate.left())
    summary(Outcome(plan, plan.range.total - sum(left.values()), embedded, dead_lettered, range_gate.dropped,
                    range_gate.busy_seconds(), left, "a stop signal" if stopped else None),
            group=settings.group_id, output_topic=settings.output_topic)
    if code == 1 and pipeline.latch.error is not None:
        print(f"{PROG}: {pipeline.latch.error}", file=sys.stderr)
    elif range_gate.complete:
        code = 0
    else:
        code = STOPPED if stopped else 1
    log.info("backfill ended", complete=range_gate.complete, exit_code=code)
    if not pipeline.left_group or pipeline.backend_calls_running:
        # As `run`: librdkafka still inside close(), or a dispatcher inside a backend call, would
        # hold or abort interpreter teardown; everything is committed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _left(cluster: dict[str, Any], group: str, plan: Any, seen: dict[int, int]) -> dict[int, int]:
    """What is left of the range by the group's committed offsets: what the next run resumes from
    (what the gate saw last is a fallback when the cluster does not answer within LEFT_READ_S)."""
    from worker.backfill.cluster_calls import Retry
    from worker.backfill.group_offsets import GroupOffsets
    from worker.backfill.range import plan as resume_plan
    from worker.core.errors import KeywordEmbedderError

    groups = GroupOffsets(cluster, Retry(bound_s=LEFT_READ_S, attempt_timeout_s=LEFT_READ_S))
    try:
        committed = groups.committed(group, plan.range.topic, [p.partition for p in plan.range.parts])
    except KeywordEmbedderError as exc:  # BackfillError: the cluster did not answer
        structlog.get_logger("worker.backfill").warning("cannot read what is left; as last seen", error=str(exc))
        return seen
    finally:
        groups.close()
    return dict(resume_plan(plan.range, {p: off for p, (off, _) in committed.items()}).left)
