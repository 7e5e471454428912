"""Helpers shared by the deploy/ tests: settings from KWE_* variables, Dockerfile parsing, kustomize."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.ci_tools import missing
from worker.settings.loader import env_name, load_settings
from worker.settings.schema import Settings, setting_fields

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SETTING_ENV = {env_name(f.name) for f in setting_fields()}
INPUT_PARTITIONS = 6
# What a grace period must leave on top of shutdown_timeout_s: the worker's deadline covers the
# drain, flush, commit and group leave; after it the metrics server stops, logs flush and the
# interpreter exits, and the runtime's SIGKILL must not land in the middle of that.
SHUTDOWN_MARGIN_S = 10.0


def yaml_docs(text: str) -> list[Any]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def duration_s(text: str) -> float:
    """A compose duration ('40s', '1m30s') in seconds."""
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    assert m and text, f"unreadable duration {text!r}"
    return int(m[1] or 0) * 60 + float(m[2] or 0)


def settings_from_env(env: dict[str, Any]) -> Settings:
    """The worker's settings from KWE_* variables, by the worker's own loader.

    Fails on a name that is not a setting, and on a value the worker would refuse at start.
    """
    kwe = {k: v for k, v in env.items() if k.startswith("KWE_")}
    unknown = sorted(set(kwe) - SETTING_ENV)
    assert not unknown, f"not settings: {unknown} (see docs/settings.md)"
    return load_settings(None, env={k: str(v) for k, v in kwe.items()})


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        op, _, args = pending.partition(" ")
        out.append((op.upper(), args.strip()))
        pending = ""
    return out


def dockerfile_env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for op, args in instructions:
        if op == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def kustomize_command() -> list[str] | None:
    """The kustomize to render with: $KUSTOMIZE, `make tools`' .tools/bin/kustomize, or PATH."""
    given = os.environ.get("KUSTOMIZE")
    if given:
        return [given]
    local = ROOT / ".tools" / "bin" / "kustomize"
    if local.is_file():
        return [str(local)]
    found = shutil.which("kustomize")
    return [found] if found else None


def kustomize_build(path: Path, *extra: str) -> list[dict[str, Any]]:
    cmd = kustomize_command()
    if cmd is None:
        # CI installs it (.ci/run: make tools); a developer without Go is told how.
        missing("kustomize not found", ci_step="run `make tools`",
                hint="run `make tools` (needs Go) to render deploy/k8s")
    out = subprocess.run([*cmd, "build", *extra, str(path)], capture_output=True, text=True)
    assert out.returncode == 0, f"kustomize build {path} failed:\n{out.stderr}"
    return yaml_docs(out.stdout)
