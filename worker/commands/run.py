"""`keyword-embedder run`: join the consumer group and embed until SIGTERM/SIGINT.

Signals are handled from the first line: a stop requested while the model and backend load
ends start-up at once (exit 0); once the worker runs, the first signal drains and commits
within shutdown_timeout_s, a second one aborts. One of a supervisor's processes (`--processes N`)
also stops when the supervisor dies (worker/operations/supervisor.py, `watch_supervisor`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import structlog

from worker.operations.logs import configure_logging
from worker.operations.stop_signals import StopDuringStartup, StopSignals, startup_stopped_message
from worker.operations.supervisor import ENV_PROCESS, watch_supervisor
from worker.settings.loader import add_setting_flags, load_settings


def configure(parser: argparse.ArgumentParser) -> None:
    add_setting_flags(parser)


def main(args: argparse.Namespace, signals: StopSignals | None = None) -> int:
    # Installed by worker.cli before this module's imports; here only when called directly.
    signals = signals if signals is not None else StopSignals()
    try:
        watch_supervisor(os.environ)
        return _main(args, signals)
    except StopDuringStartup as stop:
        print(startup_stopped_message(str(stop)), file=sys.stderr)
        return 0
    except BaseException:
        # A signal that landed inside a C call (librdkafka) surfaces as another exception
        # (a SystemError from a callback): start-up was stopped, not broken.
        name = signals.stopped_during_startup()
        if name is None:
            raise
        print(startup_stopped_message(name), file=sys.stderr)
        return 0


def _main(args: argparse.Namespace, signals: StopSignals) -> int:
    from worker.core.errors import KeywordEmbedderError

    log = structlog.get_logger("worker.run")
    try:
        settings = _checked_settings(args)
        processes = process_count(settings)
        if processes > 1:
            return _supervise(args, settings, processes, signals)
        assembled, metrics = _start(settings)
    except KeywordEmbedderError as exc:
        if signals.stopped_during_startup():
            raise StopDuringStartup(signals.requested) from None  # the stop, not a failure
        # Every start-up failure (a setting, the Kafka check, the model, profile or backend):
        # one line, exit 2.
        if structlog.is_configured():  # not before the settings that say how to log are read
            log.error("cannot start the worker", error=str(exc))
        print(f"keyword-embedder run: {exc}", file=sys.stderr)
        return 2
    pipeline = assembled.pipeline
    signals.on_stop = pipeline.request_stop
    from worker.operations.health import Readiness
    from worker.operations.probes import run_served
    from worker.operations.supervisor import inherited_metrics_socket

    # A standby member (nothing assigned while the group has more members than partitions) is ready.
    ready = Readiness(pipeline.ready, metrics.last_rebalance, standby_after_s(settings))
    try:
        code = run_served(pipeline, metrics, settings.metrics_host, settings.metrics_port, log=log, ready=ready,
                          sock=inherited_metrics_socket(os.environ))
    finally:
        assembled.close()
    if code == 1 and pipeline.latch.error is not None:
        print(f"keyword-embedder run: {pipeline.latch.error}", file=sys.stderr)
    if not pipeline.left_group or pipeline.backend_calls_running:
        # librdkafka is still inside close(), or a dispatcher inside a backend call: interpreter
        # teardown would wait on the first again, and abort under the second (the runtime's
        # threads destroyed while running). Everything is committed by now.
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """Exits without the interpreter's teardown (nothing is committed in it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _checked_settings(args: argparse.Namespace) -> Any:
    """Settings and the Kafka check: raises a KeywordEmbedderError on what stops start-up."""
    settings = load_settings(args)
    from worker.kafka.client_config import client_config, secret_values

    # Read the config and password files now: a bad one stops the worker before the model loads.
    client_config(settings)
    if settings.processing_guarantee == "exactly-once":
        from worker.ledger.exactly_once.loss_bound import check_session

        check_session(settings)  # a session too long for the transaction timeout; the warning comes later
    configure_logging(settings.log_format, settings.log_level, secrets=secret_values(settings))
    if os.environ.get(ENV_PROCESS):  # one of a supervisor's processes: its lines say which
        structlog.contextvars.bind_contextvars(process=int(os.environ[ENV_PROCESS]))

    if settings.interpreter_cpu.isdigit():
        from worker.core.os_threads import allowed_cpus

        if int(settings.interpreter_cpu) not in (cpus := allowed_cpus()):
            from worker.settings.schema import SettingsError

            raise SettingsError(f"setting 'interpreter_cpu': CPU {settings.interpreter_cpu} is not one this "
                                f"process may run on ({', '.join(map(str, cpus))})")

    # Before the broker is asked anything: a backend that cannot be had here (an extra not
    # installed, no GPU visible, no plan) stops the worker with its one line, with or without a
    # broker. Cheap: find_spec and the driver's device nodes, nothing imported.
    from worker.backend_choice.select import choose_backend

    choose_backend(settings)

    # Before the model loads: a missing topic or permission stops the worker within seconds.
    from worker.kafka.client_config import admin_config
    from worker.kafka.preflight import check_topics

    check_topics(admin_config(settings), settings)
    return settings


def _start(settings: Any) -> tuple[Any, Any]:
    """The model, the backend and the wired pipeline."""
    from worker.app import build_pipeline
    from worker.operations.metrics import Metrics

    metrics = Metrics()
    # A stop still running EXIT_GRACE_S past its deadline (a librdkafka call that never returns)
    # ends in exit_now, so the process exits within shutdown_timeout_s + 2 s (worker/pipeline.py).
    # One of a supervisor's processes: its interpreter_cpu is the supervisor's pick (worker/app.py plans the hold).
    return build_pipeline(settings, metrics=metrics, on_overrun=exit_now,
                          supervised=bool(os.environ.get(ENV_PROCESS))), metrics


def _on_gpu(settings: Any, gpu: bool | None) -> bool:
    from worker.backend_choice.select import gpu_present

    return settings.backend in ("tensorrt", "torch") or (settings.backend == "auto" and
                                                         (gpu_present() if gpu is None else gpu))


def process_count(settings: Any, *, gpu: bool | None = None, cores: int | None = None) -> int:
    """`processes` as a number: 'auto' is half the cores up to 8 where a GPU embeds (the host path is
    the limit there), else 1 (on CPU the model's own threads take the cores)."""
    if settings.processes != "auto":
        return int(settings.processes)
    from worker.backend_choice.select import usable_cores

    return max(1, min(8, (cores or usable_cores()) // 2)) if _on_gpu(settings, gpu) else 1


def interpreter_cpus(settings: Any, processes: int, *, gpu: bool | None = None,
                     cpus: list[int] | None = None) -> list[int] | None:
    """Under a supervisor, each process's `interpreter_cpu` (process i: the ith CPU of the machine's
    set, in turn), or None: the processes keep the setting as given. 'auto' holds them only on a GPU
    backend: on CPU the model's own threads, some started later by the held ones, need the cores."""
    if processes <= 1 or settings.interpreter_cpu != "auto" or not _on_gpu(settings, gpu):
        return None
    from worker.core.os_threads import allowed_cpus

    machine = cpus if cpus is not None else allowed_cpus()
    return [machine[i % len(machine)] for i in range(processes)]


def standby_after_s(settings: Any) -> float:
    """How long an empty assignment must stand before the member counts as a standby: longer than
    a cooperative rebalance's second round takes to come (the other members' revocations, each up
    to revoke_timeout_s, then a heartbeat and a join), which gives a joining member its partitions."""
    from worker.operations.health import STANDBY_MARGIN_S

    return float(settings.revoke_timeout_s) + STANDBY_MARGIN_S


def _supervise(args: argparse.Namespace, settings: Any, processes: int, signals: StopSignals) -> int:
    import socket

    from worker.operations.probes import MetricsServer
    from worker.operations.supervisor import Supervisor

    supervisor = Supervisor(list(getattr(args, "command_argv", [])), processes,
                            member_id=settings.member_id or socket.gethostname(), metrics=bool(settings.metrics_port),
                            shutdown_timeout_s=settings.shutdown_timeout_s,
                            interpreter_cpus=interpreter_cpus(settings, processes))
    signals.on_stop = supervisor.request_stop
    server = None
    if settings.metrics_port:
        # Bound before any child starts: a port in use stops the machine with nothing to stop.
        server = MetricsServer(supervisor, settings.metrics_host, settings.metrics_port, supervisor.ready,
                               supervisor.live)
        server.start()
        structlog.get_logger("worker.run").info("metrics served", processes=processes,
                                                 url=f"http://{settings.metrics_host}:{server.port}/metrics")
    try:
        supervisor.start()
        code = supervisor.run()
    finally:
        if server is not None:
            server.stop()
    if supervisor.failed is not None:
        print(f"keyword-embedder run: worker process {supervisor.failed.index} exited with "
              f"{supervisor.failed.code}; the others were stopped", file=sys.stderr)
    killed = [c.index for c in supervisor.children if c.killed]
    if killed:
        print(f"keyword-embedder run: worker process(es) {', '.join(map(str, killed))} did not stop within "
              f"{supervisor.kill_after_s:g} s and were killed (SIGKILL)",
              file=sys.stderr)
    return code
