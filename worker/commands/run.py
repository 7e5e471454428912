"""`keyword-embedder run`: join the consumer group and embed until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

import structlog

from worker.config import SettingsError, add_setting_flags, load_settings
from worker.logs import configure_logging


def configure(parser: argparse.ArgumentParser) -> None:
    add_setting_flags(parser)


def main(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args)
    except SettingsError as exc:
        print(f"keyword-embedder run: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    log = structlog.get_logger("worker.run")

    from kwe_core.errors import BackendError
    from kwe_core.model import ModelError
    from kwe_core.profiles import ProfileError
    from worker.app import build_pipeline
    from worker.metrics import Metrics, MetricsServer

    metrics = Metrics() if settings.metrics_port else None
    try:
        assembled = build_pipeline(settings, metrics=metrics)
    except (ModelError, BackendError, ProfileError) as exc:
        log.error("cannot start the worker", error=str(exc))
        print(f"keyword-embedder run: {exc}", file=sys.stderr)
        return 2

    pipeline = assembled.pipeline

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("stop requested", signal=signal.Signals(signum).name)
        pipeline.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    server = None
    if metrics is not None:
        server = MetricsServer(metrics, settings.metrics_host, settings.metrics_port, pipeline.ready)
        server.start()
        log.info("metrics served", url=f"http://{settings.metrics_host}:{server.port}/metrics")
    try:
        return pipeline.run()
    finally:
        if server is not None:
            server.stop()
        assembled.close()
