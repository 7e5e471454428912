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
from worker.core.errors import KeywordEmbedderError

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
    "backfill": ("backfill", "Embed a range of the input topic's history into an output topic, then exit "
                             "(resumable; for a model change: docs/cutover.md)."),
    "demo": ("demo", "End-to-end demo against a running broker: topics, two workers, publish, read back, summary."),
    "settings": ("settings", "Print the settings reference or the effective settings."),
    "distill-static": ("distill_static", "Make a model2vec-format static model from a dense one (its vocabulary "
                                         "through the worker's backend, PCA, Zipf weights; no torch)."),
}


# Commands that run the pipeline: their stop signals are handled from the first line.
SIGNALLED = ("run", "backfill")


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
    if name in SIGNALLED:
        # Before the command's heavy imports: as PID 1 a signal without a handler is dropped.
        from worker.operations.stop_signals import StopDuringStartup, StopSignals, startup_stopped_message

        signals = StopSignals()
        try:
            return _command(name, available[name], rest, signals)
        except StopDuringStartup as stop:
            if name != "run":  # a backfill stopped before it began is not done: not 0
                print(f"keyword-embedder {name}: stopped by {stop} during start-up", file=sys.stderr)
                return 130
            print(startup_stopped_message(str(stop)), file=sys.stderr)
            return 0
    return _command(name, available[name], rest, None)


# The words a boolean flag's value may be spelt with (as in the KWE_* variables and TOML).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def bool_words(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """`argv` with `--x true` / `--x=false` spelt `--x` / `--no-x`, for the parser's --x/--no-x flags.

    The flags are argparse's BooleanOptionalAction (no value); the worded spelling is what the
    settings took before, and what scripts and the KWE_* variables use. A word other than a
    boolean after `--x` is left alone: it is the next argument (a positional, say).
    """
    flags: dict[str, str] = {}
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of its actions
        if isinstance(action, argparse.BooleanOptionalAction):
            positive = [o for o in action.option_strings if not o.startswith("--no-")]
            negative = next((o for o in action.option_strings if o.startswith("--no-")), None)
            for option in positive:
                if negative is not None:
                    flags[option] = negative
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        option, eq, word = arg.partition("=")
        if option in flags:
            if not eq and i + 1 < len(argv) and argv[i + 1].lower() in TRUE_WORDS + FALSE_WORDS:
                word, i = argv[i + 1], i + 1
            elif not eq:
                word = "true"
            if word.lower() in TRUE_WORDS:
                arg = option
            elif word.lower() in FALSE_WORDS:
                arg = flags[option]
        out.append(arg)
        i += 1
    return out


def _command(name: str, entry: tuple[str, str], rest: list[str], signals: Any) -> int:
    module = importlib.import_module(f"worker.commands.{entry[0]}")
    parser = argparse.ArgumentParser(prog=f"keyword-embedder {name}", description=entry[1])
    module.configure(parser)
    try:
        args = parser.parse_args(bool_words(parser, rest))
        args.command_argv = list(rest)  # as given: `run --processes N` starts its processes with it
        if signals is not None:
            return int(module.main(args, signals) or 0)
        return int(module.main(args) or 0)
    except KeyboardInterrupt:
        return 130
    except KeywordEmbedderError as exc:
        # What a command did not catch itself: the one line the error was written for, and its
        # exit code (2 for a setting, else 1), never a traceback.
        print(f"keyword-embedder {name}: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
