"""backend = auto on CPU (worker/backend_choice/auto.py): the gate, the candidates a CPU gets, the cache, and
explicit choices that cannot be had. Fake backends on a fake clock (tests/fakes/backends.py); the real
OpenVINO backend's parity is in tests/unit/worker/test_embedder_parity.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from worker.core.errors import BackendError
from tests.conftest import DATA
from tests.fakes.backends import FakeClock, FakeCpuBackend
from worker.backend_choice import auto
from worker.backend_choice.auto import Candidate
from worker.backend_choice.select import choose_backend
from worker.settings.schema import Settings

BF16 = frozenset({"fpu", "avx512f", "avx512_bf16", "avx512_vnni"})
AVX2 = frozenset({"fpu", "avx2", "fma"})
KEY = {"model": "m", "threads": 1, "dispatchers": 2}
TOKENS = [np.array([101, 1000 + i, *([7] * (i % 9)), 102]) for i in range(40)]


def _bent(rows: np.ndarray) -> np.ndarray:
    """Rows turned by ~0.02 rad: cos 0.9998, outside the 0.9999 gate."""
    out = rows.copy()
    out[:, 0] += 0.02
    return out / np.linalg.norm(out, axis=1, keepdims=True)


class Opener:
    """Opens fake candidates (ms per padded token each) and records what was opened."""

    def __init__(self, speeds: dict[str, float], distort: dict[str, object] | None = None) -> None:
        self.clock = FakeClock()
        self.speeds = speeds
        self.distort = distort or {}
        self.opened: list[str] = []
        self.backends: dict[str, FakeCpuBackend] = {}

    def __call__(self, cand: Candidate) -> FakeCpuBackend:
        self.opened.append(cand.label)
        kw = {"distort": self.distort[cand.label]} if cand.label in self.distort else {}
        b = FakeCpuBackend(cand.backend, self.clock, self.speeds[cand.label], **kw)  # type: ignore[arg-type]
        self.backends[cand.label] = b
        return b


SPEEDS = {"onnxruntime/fp32": 1.0, "openvino/bf16": 0.5, "openvino/f32": 1.1}


def _choose(opener: Opener, tmp_path: Path, *, flags: frozenset[str] = BF16, ov: bool = True,
            key: dict | None = None) -> tuple[auto.CpuChoice, FakeCpuBackend]:
    choice, backend = auto.choose(key or KEY, opener, lambda: TOKENS, flags=flags, ov_available=ov,
                                  cache_dir=tmp_path, clock=opener.clock)
    return choice, backend  # type: ignore[return-value]


def test_cpu_flags_are_read_from_cpuinfo() -> None:
    text = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16 avx512_vnni\n\nflags : other\n"
    flags = auto.cpu_flags(lambda: text)
    assert {"avx512_bf16", "avx512_vnni", "avx2"} <= flags and "other" not in flags
    assert auto.has_bf16_units(flags) and auto.has_bf16_units(frozenset({"amx_bf16"}))
    assert not auto.has_bf16_units(AVX2) and auto.cpu_flags(lambda: "") == frozenset()


def test_fastest_passing_candidate_is_kept(tmp_path: Path) -> None:
    opener = Opener(SPEEDS)
    choice, backend = _choose(opener, tmp_path)
    assert choice.candidate == Candidate("openvino", "bf16") and backend is opener.backends["openvino/bf16"]
    assert not choice.cached and "openvino/bf16 2.00x" in choice.reason
    # The others were opened, gated, timed and closed; the chosen one stays open.
    assert opener.opened == ["onnxruntime/fp32", "openvino/bf16", "openvino/f32"]
    assert opener.backends["onnxruntime/fp32"].closed and opener.backends["openvino/f32"].closed
    assert not backend.closed
    assert "<- chosen" in choice.table() and "openvino/f32" in choice.table()


def test_a_candidate_refused_by_the_gate_is_not_chosen_however_fast(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    opener = Opener({**SPEEDS, "openvino/bf16": 0.1}, distort={"openvino/bf16": _bent})
    choice, _ = _choose(opener, tmp_path)
    assert choice.candidate == auto.REFERENCE
    refused = next(t for t in choice.trials if t.label == "openvino/bf16")
    assert not refused.passed and "min cos" in refused.reason and refused.min_cos < 0.9999
    assert opener.backends["openvino/bf16"].closed
    assert "refused: min cos" in choice.table()
    assert "refused by the parity gate" in capsys.readouterr().out  # the log says why


def test_the_gate_checks_norms_too() -> None:
    rows = np.eye(4, dtype=np.float32)
    ok, reason, min_cos, diff = auto.check_gate(rows * 1.001, rows)
    assert not ok and "norm" in reason and min_cos == pytest.approx(1.0, abs=1e-6) and diff == pytest.approx(1e-3, abs=1e-6)
    assert auto.check_gate(rows, rows)[0]
    assert auto.check_gate(np.zeros_like(rows), np.zeros_like(rows))[0]  # all-zero rows agree
    # Beyond unit length the norm check is relative: 1e-5 of a norm of 40 passes.
    assert auto.check_gate(rows * 40 * (1 + 1e-5), rows * 40)[0]
    assert not auto.check_gate(np.full_like(rows, np.nan), rows)[0]


def test_a_tie_keeps_onnxruntime(tmp_path: Path) -> None:
    opener = Opener({"onnxruntime/fp32": 1.0, "openvino/bf16": 0.99, "openvino/f32": 1.0})
    choice, _ = _choose(opener, tmp_path)
    assert choice.candidate == auto.REFERENCE and "only 1.01x" in choice.reason


def test_cache_hit_and_miss(tmp_path: Path) -> None:
    first = Opener(SPEEDS)
    choice, _ = _choose(first, tmp_path)
    assert not choice.cached and len(list(tmp_path.glob("*.json"))) == 1
    # Same key: read from the cache, only the chosen backend is opened, nothing is run.
    again = Opener(SPEEDS)
    hit, backend = _choose(again, tmp_path)
    assert hit.cached and hit.candidate == choice.candidate and again.opened == ["openvino/bf16"]
    assert backend.calls == [] and [t.label for t in hit.trials] == [t.label for t in choice.trials]
    # Another thread layout, or another CPU's flags: measured again.
    for key, flags in ((dict(KEY, threads=2), BF16), (KEY, BF16 | {"amx_bf16"})):
        miss = Opener(SPEEDS)
        measured, _ = _choose(miss, tmp_path, key=key, flags=flags)
        assert not measured.cached and len(miss.opened) == 3
    # An unreadable cache file is measured again, not fatal.
    for path in tmp_path.glob("*.json"):
        path.write_text("{not json")
    broken = Opener(SPEEDS)
    assert not _choose(broken, tmp_path)[0].cached
    rewritten = [p for p in tmp_path.glob("*.json") if p.read_text() != "{not json"]
    assert len(rewritten) == 1 and json.loads(rewritten[0].read_text())["choice"] == "openvino/bf16"


def test_a_cpu_without_bf16_units_is_never_offered_openvino_bf16(tmp_path: Path) -> None:
    found, notes = auto.candidates(AVX2, ov_available=True)
    assert [c.label for c in found] == ["onnxruntime/fp32", "openvino/f32"]
    assert "none of amx_bf16, avx512_bf16" in notes[0]
    opener = Opener(SPEEDS)
    choice, _ = _choose(opener, tmp_path, flags=AVX2)
    assert "openvino/bf16" not in opener.opened
    # OpenVINO f32 is slower here: ONNX Runtime kept, and the reason says why bf16 was not tried.
    assert choice.candidate == auto.REFERENCE and "openvino/bf16 not offered" in choice.reason


def test_missing_openvino_extra_falls_back_to_onnxruntime_and_says_so(tmp_path: Path) -> None:
    opener = Opener(SPEEDS)
    choice, backend = _choose(opener, tmp_path, ov=False)
    assert choice.candidate == auto.REFERENCE and opener.opened == ["onnxruntime/fp32"]
    assert "pip install 'keyword-embedder[openvino]'" in choice.reason
    assert backend.calls == [] and list(tmp_path.iterdir()) == []  # one candidate: nothing measured


def test_int8_is_onnxruntime_only() -> None:
    found, _ = auto.candidates(BF16, ov_available=True, int8=True)
    assert found == [Candidate("onnxruntime", "int8")]


def test_timing_is_bounded_by_the_budget() -> None:
    clock = FakeClock()
    slow = FakeCpuBackend("onnxruntime", clock, ms_per_token=1000.0)  # 8 s for the 1x8 shape alone
    ms = auto.time_candidates({"x": slow.create_context(0).run}, TOKENS, rounds=50, budget_s=1.0, clock=clock)
    assert set(ms["x"]) == {f"{r}x{n}" for r, n in auto.SHAPES}
    assert len(slow.calls) == 2 * len(auto.SHAPES)  # one warm-up and one timed round, then the budget


def test_explicit_openvino_without_the_extra_is_one_line_with_the_install_first() -> None:
    with pytest.raises(BackendError) as err:
        choose_backend(Settings(backend="openvino"), find_spec=lambda name: None)
    message = str(err.value)
    assert message.startswith("backend 'openvino' needs the openvino extra: pip install 'keyword-embedder[openvino]'")
    assert "\n" not in message
    # auto on the same machine: ONNX Runtime, measured against nothing.
    choice = choose_backend(Settings(backend="auto"), find_spec=lambda name: None, has_gpu=lambda: False)
    assert choice.backend == "onnxruntime" and choice.measure_cpu


def test_bench_with_an_unavailable_backend_exits_2_with_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import main

    monkeypatch.setitem(sys.modules, "openvino", None)  # the extra is not installed
    assert main(["bench", "--calibrate", "--backend", "openvino"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'keyword-embedder[openvino]'" in err


def test_gate_texts_are_the_golden_texts() -> None:
    golden = DATA / "golden" / "dev.jsonl"
    texts = [json.loads(line)["text"] for line in golden.read_text(encoding="utf-8").splitlines()]
    assert auto.gate_texts() == texts
