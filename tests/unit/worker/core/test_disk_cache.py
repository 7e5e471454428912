"""What is kept on disk (worker/core/disk_cache.py): where, under which name, and written so that a
reader never sees half a file and a failed write leaves nothing behind."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from worker.core import disk_cache
from worker.core.disk_cache import (cache_dir, cache_root, key_of, locked, read_json, read_or_measure,
                                    write_atomic, write_json_atomic)


def test_the_cache_root_is_the_env_setting_else_the_xdg_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "kwe"))
    assert cache_root() == tmp_path / "kwe"
    assert cache_dir("onnx") == tmp_path / "kwe" / "onnx"
    monkeypatch.delenv("KWE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "keyword-embedder"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "keyword-embedder"


def test_a_key_depends_on_the_parts_not_their_order() -> None:
    assert key_of({"a": 1, "b": [2, 3]}) == key_of({"b": [2, 3], "a": 1})
    assert key_of({"a": 1}) != key_of({"a": 2})
    assert key_of({"p": Path("/x")}) == key_of({"p": "/x"})  # what JSON cannot say is its str
    assert len(key_of({"a": 1})) == 24 and len(key_of({"a": 1}, length=12)) == 12


def test_an_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "kept.json"
    write_json_atomic(path, {"v": 1})
    write_json_atomic(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 2}
    assert sorted(p.name for p in path.parent.iterdir()) == ["kept.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask, "the usual mode, not mkstemp's 0600"


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path: Path) -> None:
    path = tmp_path / "kept.bin"
    path.write_bytes(b"old")

    def half_then_fail(tmp: Path) -> None:
        tmp.write_bytes(b"ne")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomic(path, half_then_fail)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["kept.bin"], "the temporary file was left behind"


def test_read_or_measure_measures_once_then_reads(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    calls: list[int] = []

    def measure() -> list[int]:
        calls.append(1)
        return [1, 2, 3]

    def parse(data: dict) -> list[int]:
        return [int(x) for x in data["values"]]

    def dump(v: list[int]) -> dict:
        return {"values": v}

    assert read_or_measure(path, parse, measure, dump, what="test") == ([1, 2, 3], False)
    assert read_or_measure(path, parse, measure, dump, what="test") == ([1, 2, 3], True)
    assert len(calls) == 1
    assert read_or_measure(path, parse, measure, dump, what="test", remeasure=True) == ([1, 2, 3], False)
    assert len(calls) == 2


def test_an_unreadable_file_is_measured_again_and_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text('{"values": [1, ')  # half a file, from before atomic writes
    assert read_json(path, lambda d: d["values"], what="test") is None
    value, cached = read_or_measure(path, lambda d: d["values"], lambda: [7], lambda v: {"values": v}, what="test")
    assert (value, cached) == ([7], False)
    assert json.loads(path.read_text()) == {"values": [7]}
    assert read_json(tmp_path / "missing.json", lambda d: d, what="test") is None


def test_a_value_that_cannot_be_kept_is_still_returned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(path: Path, data: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(disk_cache, "write_json_atomic", refuse)
    assert read_or_measure(tmp_path / "m.json", lambda d: d, lambda: [1], lambda v: v, what="test") == ([1], False)


def test_the_lock_lets_one_maker_in_at_a_time(tmp_path: Path) -> None:
    lock = tmp_path / "deep" / ".x.lock"
    inside: list[int] = []
    overlaps: list[int] = []

    def maker(n: int) -> None:
        with locked(lock):
            inside.append(n)
            if len(inside) > 1:
                overlaps.append(n)
            time.sleep(0.05)
            inside.remove(n)

    threads = [threading.Thread(target=maker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not overlaps
