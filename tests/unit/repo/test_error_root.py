"""One exception root: every error a user can read derives from KeywordEmbedderError, and the
commands catch that root (or one of its subclasses) rather than tuples of unrelated types."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

from worker.core.errors import KeywordEmbedderError
from tests.conftest import ROOT

PACKAGES = ("worker", "engines")

# Exceptions that never reach a user: control flow inside one module, each caught where it is
# raised's caller. Anything else defined in the packages must derive from the root.
INTERNAL = {
    "worker.backends.base.PartialBatchError": "caught by the output stage: dead letters + embeddings",
    "worker.ledger.offsets.OffsetWentBack": "caught by intake: the partition's state is reset",
    "worker.ledger.offsets.Refetched": "caught by intake: the record is skipped",
    "worker.kafka.preflight._Unreachable": "caught by the preflight's retry loop",
    "worker.backfill.cluster_calls.Retriable": "caught by the backfill's retry loop (Retry.run); BackfillError past its bound",
    "worker.backfill.cluster_calls.Busy": "caught by the backfill's retry loop; GroupBusyError past its bound",
    "worker.operations.stop_signals.StopDuringStartup": "a stop request (BaseException), not an error",
}

# What a command may catch that is not an error for the user to read: control flow.
NOT_ERRORS = {
    "KeyboardInterrupt": "Ctrl-C ends a read or a publish",
    "BufferError": "librdkafka's queue is full: poll, then produce again",
    "orjson.JSONDecodeError": "a record that is not JSON is shown as text",
    "subprocess.TimeoutExpired": "a demo worker that does not stop is killed",
    "urllib.error.HTTPError": "a probe's non-200 answer is read, not raised",
    "OSError": "a probe that does not answer yet",
    "BaseException": "run: a stop signal that landed inside a C call during start-up",
}


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        pkg = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}."):
            names.append(info.name)
    return names


def _defined_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # an optional extra (tensorrt, the GPU bindings) not installed
            if exc.name and exc.name.split(".")[0] in PACKAGES:
                raise
            continue
        for attr, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
                found[f"{name}.{attr}"] = obj
    return found


def test_every_error_a_user_can_read_derives_from_the_one_root() -> None:
    found = _defined_exceptions()
    # The ones the issue named, found and walked (not skipped as an import that failed).
    for name in ("worker.formats.keyword_files.KeywordFileError", "worker.benchmark.errors.BenchError",
                 "worker.batching.bucketer.BucketerError", "worker.embedding_cache.CacheError",
                 "worker.batching.cost_model.CostModelError",
                 "worker.core.vectors.VectorError", "engines.quantize_int8.QuantizeError",
                 "engines.build_engine.EngineBuildError", "engines.onnx_export.graph.ExportError",
                 "worker.settings.schema.SettingsError", "worker.embedder.EmbedderError"):
        assert name in found, name
    outside = sorted(name for name, cls in found.items()
                     if not issubclass(cls, KeywordEmbedderError) and name not in INTERNAL)
    assert outside == [], f"errors outside the KeywordEmbedderError root: {outside}"
    assert set(INTERNAL) <= set(found), "an INTERNAL entry names a class that no longer exists"


def test_errors_keep_the_builtin_type_callers_caught_before() -> None:
    from engines.onnx_export.graph import ExportError
    from worker.batching.bucketer import BucketerError
    from worker.formats.keyword_files import KeywordFileError

    # Library callers that caught ValueError / RuntimeError still do.
    assert issubclass(KeywordFileError, ValueError) and issubclass(ExportError, RuntimeError)
    assert issubclass(BucketerError, RuntimeError)


def _handler_names(node: ast.expr | None) -> list[str]:
    if node is None:
        return ["<bare>"]
    if isinstance(node, ast.Tuple):
        return [n for elt in node.elts for n in _handler_names(elt)]
    return [ast.unparse(node)]


def _command_handlers() -> list[tuple[str, int, list[str]]]:
    out = []
    for path in sorted((ROOT / "worker" / "commands").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ExceptHandler):
                out.append((path.name, node.lineno, _handler_names(node.type)))
    return out


def _resolve(name: str) -> type[BaseException] | None:
    for module in ("worker.core.errors", "worker.core.model", "worker.core.profiles", "worker.settings.schema",
                   "worker.formats.keyword_files", "engines.build_engine", "engines.onnx_export.graph",
                   "worker.benchmark.errors", "worker.operations.stop_signals"):
        cls = getattr(importlib.import_module(module), name, None)
        if cls is not None:
            return cls
    return None


def test_every_except_in_the_commands_names_the_root_or_a_subclass_once() -> None:
    handlers = _command_handlers()
    assert len(handlers) > 10  # the walk found the commands' handlers
    for file, line, names in handlers:
        errors = [n for n in names if n not in NOT_ERRORS]
        where = f"worker/commands/{file}:{line} except {', '.join(names)}"
        assert "<bare>" not in names and "Exception" not in names, where
        assert "ValueError" not in names and "RuntimeError" not in names, where
        if errors:
            # One type: the root or one subclass of it (a tuple of them is the root, caught once).
            assert len(names) == 1, where
            cls = _resolve(errors[0])
            if errors[0] == "StopDuringStartup":
                continue  # the stop, answered with exit 0
            assert cls is not None and issubclass(cls, KeywordEmbedderError), where


@pytest.mark.parametrize("argv", [["embed", "x", "--batch-size", "0"]])
def test_the_cli_turns_a_root_error_into_one_line_and_its_exit_code(argv: list[str],
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import main

    assert main(argv) == 1  # embed's code for a bad option, as before
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["keyword-embedder embed: Embedder: batch_size must be >= 1, got 0"]


def test_an_error_no_command_catches_is_one_line_and_exit_1(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from worker.batching.cost_model import CostModelError
    from worker.cli import main
    import worker.commands.settings as settings_command

    def fails(args: object) -> int:
        raise CostModelError("too few samples to fit the prices (3 of 7)")

    monkeypatch.setattr(settings_command, "main", fails)
    assert main(["settings"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "keyword-embedder settings: too few samples to fit the prices (3 of 7)"]


@pytest.mark.parametrize("command", ["consume", "produce"])
def test_a_bad_client_setting_is_one_line_and_exit_2(command: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import main

    io = ["--output", str(tmp_path / "out.jsonl")] if command == "consume" else ["--input", str(tmp_path / "in.tsv")]
    assert main([command, "--bootstrap-servers", "127.0.0.1:1", "--topic", "t", *io, "--kafka-config", "acks"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"keyword-embedder {command}: ") and "expected key=value" in line
