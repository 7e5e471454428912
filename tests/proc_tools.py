"""A process as /proc shows it, for the tests that watch a supervisor and its children (the kernel's
own view: no psutil in the dependencies)."""

from __future__ import annotations

from pathlib import Path


def _stat_fields(path: Path) -> list[str]:
    # The command name, in parentheses, may hold spaces and ')': the fields start after the last ')'.
    return path.read_text().rsplit(")", 1)[1].split()


def children_of(pid: int) -> list[int]:
    """The PIDs whose parent is `pid` now."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = _stat_fields(stat)
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        return _stat_fields(Path(f"/proc/{pid}/stat"))[0] != "Z"
    except OSError:
        return False
