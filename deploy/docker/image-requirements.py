"""Build-time helper for the Dockerfiles: check the interpreter, then list what to pre-install.

    python3 image-requirements.py pyproject.toml [--extra gpu] [--exclude tensorrt]

1. Exits 1 with one clear message when this Python is older than pyproject.toml's
   `requires-python` (read with a regular expression: the check has to work on interpreters too
   old for tomllib, which is exactly when it fails).
2. Prints, one per line, the build backend (`build-system.requires`) and the runtime
   dependencies (plus the named extras, minus the excluded names), so that the Dockerfiles can
   install every dependency in a layer of its own *before* the source is copied: a code change
   then rebuilds only the last, small layer. Versions come from constraints.txt (PIP_CONSTRAINT).

It reads only pyproject.toml and imports nothing outside the standard library.
"""

from __future__ import annotations

import re
import sys


def required_python(text: str) -> tuple[int, int]:
    m = re.search(r'^requires-python\s*=\s*">=\s*(\d+)\.(\d+)"', text, re.M)
    if not m:
        raise SystemExit("image-requirements: pyproject.toml has no requires-python = \">=X.Y\" line")
    return int(m[1]), int(m[2])


def check_python(text: str, version: tuple[int, int] | None = None) -> None:
    have = version or sys.version_info[:2]
    need = required_python(text)
    if tuple(have) < need:
        raise SystemExit(
            f"image-requirements: this base image has Python {have[0]}.{have[1]}, but keyword-embedder "
            f"requires Python >= {need[0]}.{need[1]} (pyproject.toml requires-python). Use a base image "
            "with a newer Python (for the GPU image: an NGC TensorRT tag of 25.01 or later).")


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requirements(text: str, extras: list[str], exclude: list[str]) -> list[str]:
    import tomllib  # only after check_python: present on every Python this package supports

    data = tomllib.loads(text)
    reqs = list(data["build-system"]["requires"]) + list(data["project"]["dependencies"])
    optional = data["project"].get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"image-requirements: pyproject.toml has no extra {extra!r} "
                             f"(it has: {', '.join(sorted(optional))})")
        reqs += optional[extra]
    dropped = {e.lower().replace("_", "-") for e in exclude}
    return [r for r in reqs if _name(r) not in dropped]


def main(argv: list[str]) -> int:
    args = list(argv)
    extras: list[str] = []
    exclude: list[str] = []
    paths: list[str] = []
    while args:
        arg = args.pop(0)
        if arg in ("--extra", "--exclude") and args:
            (extras if arg == "--extra" else exclude).append(args.pop(0))
        elif arg.startswith("-"):
            raise SystemExit(f"image-requirements: unknown option {arg}")
        else:
            paths.append(arg)
    if len(paths) != 1:
        raise SystemExit("usage: image-requirements.py pyproject.toml [--extra NAME] [--exclude NAME]")
    with open(paths[0], encoding="utf-8") as f:
        text = f.read()
    check_python(text)
    print("\n".join(requirements(text, extras, exclude)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
