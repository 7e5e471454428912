"""Everything the project keeps on disk between runs, in one place: where (the cache root), under
which name (cache keys), and how (read what is there or measure it, write atomically, one writer
at a time).

What is kept, each in a folder of the cache root ($KWE_CACHE_DIR, else $XDG_CACHE_HOME or
~/.cache, then keyword-embedder/):
- onnx/            the ONNX exports (engines/onnx_export/export.py)
- cost-models/     the measured price of a backend call (worker/batching/calibration.py)
- backend-choice/  the CPU backend `auto` picked, with its trials (worker/backend_choice/auto.py)
- openvino/        OpenVINO's compiled blobs (worker/backends/openvino.py)
- models/          model folders unpacked from split packages (worker/commands/models.py)

Two workers starting together on one machine share these files: a reader sees the old file or
the new, never half of one (`write_atomic`), and an expensive file is made once (`locked`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import structlog

ENV_CACHE_DIR = "KWE_CACHE_DIR"

log = structlog.get_logger(__name__)
T = TypeVar("T")


def cache_root() -> Path:
    """The project's user cache: $KWE_CACHE_DIR, else $XDG_CACHE_HOME (or ~/.cache)/keyword-embedder."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "keyword-embedder"


def cache_dir(kind: str) -> Path:
    """The folder of one kind of kept file (`onnx`, `cost-models`, ...) under the cache root."""
    return cache_root() / kind


def key_of(parts: Mapping[str, Any], length: int = 24) -> str:
    """A file name for these key parts: the hash of their JSON (sorted keys; anything JSON cannot
    say is written as its str). Equal parts give the same name on every machine."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Holds an exclusive lock on `lock_path` (created if missing): concurrent makers of one file
    (two workers starting together) take turns, and the second finds the first one's file."""
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a fresh file beside `path`, then renamed over it: readers see the old file
    or the new, never half. The temporary file is removed when anything fails (OSError is raised
    to the caller, who says what was not kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        # mkstemp creates 0600; a cache file should get the usual umask-based mode.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)  # atomic on POSIX
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, default=str)))


def read_json(path: Path, parse: Callable[[Any], T], *, what: str) -> T | None:
    """`parse` of the JSON at `path`; None when there is none, or when it cannot be read or parsed
    (logged: the caller measures again and overwrites it)."""
    try:
        return parse(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - any file that does not parse is measured again
        log.warning(f"{what} cache unreadable; measuring again", path=str(path), error=str(exc))
        return None


def read_or_measure(path: Path, parse: Callable[[Any], T], measure: Callable[[], T],
                    dump: Callable[[T], Any], *, what: str, remeasure: bool = False) -> tuple[T, bool]:
    """(value, from_cache): the kept value at `path` if it parses, else `measure()`, then kept
    (`dump` gives its JSON). A value that cannot be kept is still returned (logged)."""
    if not remeasure:
        found = read_json(path, parse, what=what)
        if found is not None:
            return found, True
    value = measure()
    try:
        write_json_atomic(path, dump(value))
    except OSError as exc:
        log.warning(f"{what} not cached", path=str(path), error=str(exc))
    return value, False
