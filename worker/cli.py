"""`keyword-embedder` command line: one subcommand per module under worker/commands/.

Subcommands are imported only when chosen, so `--help` stays fast and a CPU
install never touches onnxruntime, let alone tensorrt, to print usage.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from typing import Any

from worker import __version__

# name -> (module under worker.commands, one-line summary)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run", "Run the worker: consume keywords, embed them, produce embeddings (commit-after-write)."),
    "produce": ("produce", "Publish keywords from a TSV (id<TAB>text) or JSONL file to a topic."),
    "consume": ("consume", "Read records from a topic into a JSONL file."),
    "embed": ("embed", "Embed texts offline (no Kafka) and print or save the vectors."),
    "bench": ("bench", "Offline benchmark: monolithic vs bucketed vs sorted batching, with latency."),
    "export-onnx": ("export_onnx", "Export a model folder (bert, roberta, xlm-roberta, distilbert, mpnet) to ONNX without torch."),
    "models": ("models", "List the encoder families and what was verified for each (--check reruns the checks)."),
    "build-engine": ("build_engine", "Build a multi-profile TensorRT plan from the ONNX export (needs a GPU)."),
    "demo": ("demo", "End-to-end demo against a running broker: topics, two workers, publish, read back, summary."),
    "settings": ("settings", "Print the settings reference or the effective settings."),
}


def _available() -> dict[str, tuple[str, str]]:
    found = {}
    for name, (module, summary) in SUBCOMMANDS.items():
        if importlib.util.find_spec(f"worker.commands.{module}") is not None:
            found[name] = (module, summary)
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keyword-embedder",
        description="Streaming Kafka worker that turns search keywords into sentence embeddings.",
    )
    parser.add_argument("--version", action="version", version=f"keyword-embedder {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, summary) in _available().items():
        sub.add_parser(name, help=summary, description=summary, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    available = _available()
    if not argv or argv[0] not in available:
        parser = build_parser()
        if not argv:
            parser.print_help()
            return 2
        parser.parse_args(argv)  # prints --help/--version or the error for an unknown command
        return 2
    name, rest = argv[0], argv[1:]
    if name == "run":
        # Before the command's heavy imports: as PID 1 a signal without a handler is dropped.
        from worker.stop_signals import StopDuringStartup, StopSignals, startup_stopped_message

        signals = StopSignals()
        try:
            return _command(name, available[name], rest, signals)
        except StopDuringStartup as stop:
            print(startup_stopped_message(str(stop)), file=sys.stderr)
            return 0
    return _command(name, available[name], rest, None)


def _command(name: str, entry: tuple[str, str], rest: list[str], signals: Any) -> int:
    module = importlib.import_module(f"worker.commands.{entry[0]}")
    parser = argparse.ArgumentParser(prog=f"keyword-embedder {name}", description=entry[1])
    module.configure(parser)
    try:
        args = parser.parse_args(rest)
        if signals is not None:
            return int(module.main(args, signals) or 0)
        return int(module.main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
