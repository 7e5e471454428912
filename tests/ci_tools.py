"""What a test does when a tool or data set that .ci/run installs is missing.

Under CI it must be there (.ci/run installs it) unless .ci/run said why it could not install it
(an environment variable holding the reason); elsewhere a developer is told how to get it.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def missing(what: str, *, ci_step: str, hint: str, unavailable_env: str | None = None) -> NoReturn:
    """Skip (the reason .ci/run gave, or `hint` outside CI) or, under CI, fail: `ci_step` must run first."""
    unavailable = os.environ.get(unavailable_env) if unavailable_env else None
    if unavailable:
        pytest.skip(f"{what}: {unavailable}")
    if os.environ.get("CI"):
        pytest.fail(f"{what}: .ci/run must {ci_step} first")
    pytest.skip(f"{what}: {hint}")
