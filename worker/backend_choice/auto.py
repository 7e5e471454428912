"""`backend = auto` on CPU: measure the candidates on this machine, gate each against fp32, keep the fastest.

Candidates: ONNX Runtime fp32 (the reference, always there); OpenVINO bf16 only where the CPU
reports bf16 matrix units (`amx_bf16` or `avx512_bf16` in /proc/cpuinfo: elsewhere the hint buys
nothing, so it is never offered); OpenVINO f32. OpenVINO candidates need the `openvino` extra;
without it auto keeps ONNX Runtime and says so.

Each candidate embeds the shipped golden texts (gate_texts.json, the texts of
tests/data/golden/dev.jsonl) and is refused unless every row keeps cos >= GATE_MIN_COS to the
fp32 reference and its norm within GATE_NORM_TOL of the reference's; the refusal and its numbers
are logged. A sparse model's rows are held to the sparse parity rule instead (`check_sparse_gate`:
every vocabulary weight within 1e-4 x its value + 1e-5 of the fp32 reference's, so the same
non-zero indices), the rule its output is checked against sentence-transformers by. The passing candidates are then timed on a few shapes, in alternating rounds (every
candidate once per round, so a burst of load elsewhere lands on all of them), within BUDGET_S.
A candidate must beat ONNX Runtime by MARGIN to replace it, so noise never swaps a tie.

The result is cached like the cost model (worker/batching/calibration.py: same key scheme and cache
root), keyed by the model, the backend versions, the CPU model and flags, and the thread layout:
a warm start reads the choice and opens only the chosen backend.

Runs once, on the thread that starts the worker (or builds an Embedder), before any context exists.

Over 400 lines because the choice is one procedure (candidates, gate, timing, the pick, its cache)
that reads best in order; its steps are small pure functions, tested one by one.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import structlog

from worker.backends.base import Backend, OvPrecision
from worker.core.disk_cache import cache_dir, read_json, write_json_atomic

log = structlog.get_logger(__name__)

GATE_MIN_COS = 0.9999
GATE_NORM_TOL = 1e-4
# Shapes a trickle and a backlog both make on the CPU profile (rows x padded length).
SHAPES: tuple[tuple[int, int], ...] = ((1, 8), (8, 8), (32, 10), (64, 16))
ROUNDS = 3
BUDGET_S = 3.0
MARGIN = 0.03  # a candidate must be >= 3% faster (geometric mean over SHAPES) to replace ONNX Runtime
GATE_BATCH = 16
# Bump when the candidates, the gate or the timing change: old choices are then ignored.
VERSION = 2
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
GATE_TEXTS = Path(__file__).with_name("gate_texts.json")

CpuBackendName = Literal["onnxruntime", "openvino"]


@dataclass(frozen=True)
class Candidate:
    backend: CpuBackendName
    precision: Literal["fp32", "bf16", "f32", "int8"]

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.precision}"

    @property
    def ov_precision(self) -> OvPrecision:
        return "bf16" if self.precision == "bf16" else "f32"


REFERENCE = Candidate("onnxruntime", "fp32")


@dataclass
class Trial:
    """One candidate's gate result and timings (ms per shape, geometric mean, ratio to the reference)."""

    label: str
    passed: bool
    reason: str
    min_cos: float = 1.0
    max_norm_diff: float = 0.0
    ms: dict[str, float] = field(default_factory=dict)
    geomean_ms: float = 0.0
    speedup: float = 1.0  # reference geomean / this geomean


@dataclass
class CpuChoice:
    candidate: Candidate
    reason: str
    trials: list[Trial]
    cached: bool
    seconds: float

    def table(self) -> str:
        """The candidate table `bench --calibrate` prints."""
        shapes = [f"{r}x{n}" for r, n in SHAPES]
        lines = ["  candidate          gate   min cos    " + "  ".join(f"{s:>8}" for s in shapes) + "   geomean  speed-up"]
        for t in self.trials:
            cells = "  ".join(f"{t.ms[s]:8.2f}" if s in t.ms else f"{'-':>8}" for s in shapes)
            chosen = "  <- chosen" if t.label == self.candidate.label else ""
            lines.append(f"  {t.label:17s}  {'pass' if t.passed else 'FAIL'}   {t.min_cos:.6f}  {cells}  "
                         f"{t.geomean_ms:8.2f}  {t.speedup:7.2f}x{chosen}")
            if not t.passed:
                lines.append(f"      refused: {t.reason}")
        return "\n".join(lines)


def read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags(cpuinfo: Callable[[], str] = read_cpuinfo) -> frozenset[str]:
    """The CPU's feature flags (the first `flags` line of /proc/cpuinfo); empty where unreadable."""
    for line in cpuinfo().splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_bf16_units(flags: frozenset[str]) -> bool:
    return any(f in flags for f in BF16_FLAGS)


def openvino_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("openvino") is not None
    except (ImportError, ValueError):
        return False


def candidates(flags: frozenset[str], *, ov_available: bool, int8: bool = False) -> tuple[list[Candidate], list[str]]:
    """The candidates this machine gets, and why the others are left out."""
    if int8:
        return [Candidate("onnxruntime", "int8")], ["precision = int8 runs the quantized ONNX Runtime graph"]
    notes: list[str] = []
    found = [REFERENCE]
    if not ov_available:
        notes.append("openvino extra not installed (pip install 'keyword-embedder[openvino]'): "
                     "kept onnxruntime")
        return found, notes
    if has_bf16_units(flags):
        found.append(Candidate("openvino", "bf16"))
    else:
        notes.append(f"CPU reports none of {', '.join(BF16_FLAGS)}: openvino/bf16 not offered")
    found.append(Candidate("openvino", "f32"))
    return found, notes


def gate_texts() -> list[str]:
    return list(json.loads(GATE_TEXTS.read_text(encoding="utf-8")))


def gate_token_ids(model: Any) -> list[np.ndarray]:
    """The gate texts as the model's token ids (a ModelInfo; cut at its max sequence length)."""
    from worker.intake.tokenize import KeywordTokenizer

    return [enc.ids for enc in KeywordTokenizer.from_model(model).encode(gate_texts())]


def layout_key(model: Any, *, onnx_path: str | Path | None, threads: int, dispatchers: int,
               spinning: bool) -> dict[str, Any]:
    """The model's files and the thread layout: what a cached choice depends on besides the machine."""
    weights = model.weights_path.stat()
    return {"model": str(model.model_dir), "weights": [weights.st_size, weights.st_mtime_ns],
            "onnx": str(onnx_path or ""), "threads": threads, "dispatchers": dispatchers, "spinning": spinning}


def gate_batches(token_ids: Sequence[Sequence[int]], batch: int = GATE_BATCH) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """(row indices, ids, mask) batches of the gate texts, sorted by length, each padded to its longest,
    and cut where padding would double a batch's real tokens (the long edge rows run alone)."""
    from worker.batching.padding import length_batches, pad_batch

    groups = length_batches([len(t) for t in token_ids], batch)
    out = []
    for rows in groups:
        ids, mask = pad_batch([token_ids[i] for i in rows])
        out.append((rows, ids, mask))
    return out


def embed_batches(run: Callable[[np.ndarray, np.ndarray], np.ndarray],
                  batches: Sequence[tuple[list[int], np.ndarray, np.ndarray]], n: int, dim: int) -> np.ndarray:
    out = np.zeros((n, dim), dtype=np.float32)
    for rows, ids, mask in batches:
        out[rows] = run(ids, mask)
    return out


def check_gate(ours: np.ndarray, ref: np.ndarray) -> tuple[bool, str, float, float]:
    """(passed, reason, min cos, max |norm - reference norm|) of a candidate's rows against the reference's."""
    norms, ref_norms = np.linalg.norm(ours, axis=1), np.linalg.norm(ref, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = (ours * ref).sum(1) / (norms * ref_norms)
    # Two zero rows agree (a model whose output can be all zeros); NaN or inf never does.
    cos = np.where((norms == 0) & (ref_norms == 0), 1.0, cos)
    cos = np.where(np.isfinite(cos), cos, -1.0)
    min_cos = float(cos.min()) if len(cos) else 1.0
    # Relative beyond unit length: a model that does not normalise has norms of tens.
    norm_diff = np.abs(norms - ref_norms) / np.maximum(ref_norms, 1.0)
    max_diff = float(np.nan_to_num(norm_diff, nan=np.inf).max()) if len(norm_diff) else 0.0
    if min_cos < GATE_MIN_COS:
        worst = int(np.argmin(cos))
        return False, f"min cos {min_cos:.6f} < {GATE_MIN_COS} (gate row {worst})", min_cos, max_diff
    if max_diff > GATE_NORM_TOL:
        return False, f"a norm differs by {max_diff:.2e} > {GATE_NORM_TOL:g} from the fp32 reference", min_cos, max_diff
    return True, "passed", min_cos, max_diff


def check_sparse_gate(ours: np.ndarray, ref: np.ndarray) -> tuple[bool, str, float, float]:
    """check_gate for a sparse model's [N, V] rows: every weight within worker.core.sparse's parity
    rule of the reference's (min cos and the largest |difference| are reported beside it)."""
    from worker.core.sparse import compare

    match = compare(ours, ref)
    _, _, min_cos, _ = check_gate(ours, ref)
    if not match.ok:
        return False, (f"a weight differs by {match.worst:.2f}x the sparse tolerance ({match.rtol:g} x |w| + "
                       f"{match.atol:g}; max |diff| {match.max_abs:.2e}, {match.support_differs} rows with other "
                       f"non-zero indices)"), min_cos, match.max_abs
    return True, "passed", min_cos, match.max_abs


Gate = Callable[[np.ndarray, np.ndarray], tuple[bool, str, float, float]]


def _feeds(shapes: Sequence[tuple[int, int]],
           token_ids: Sequence[Sequence[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batches of each shape made of the model's own tokens (the gate texts'), so any vocabulary fits:
    each row starts and ends with a gate row's first and last (special) tokens."""
    pool = np.concatenate([np.asarray(t[1:-1], dtype=np.int64) for t in token_ids if len(t) > 2] or
                          [np.asarray(token_ids[0], dtype=np.int64)])
    first, last = int(token_ids[0][0]), int(token_ids[0][-1])
    rng = np.random.default_rng(0)
    feeds = []
    for rows, length in shapes:
        ids = rng.choice(pool, size=(rows, length))
        ids[:, 0], ids[:, -1] = first, last
        feeds.append((ids, np.ones_like(ids)))
    return feeds


def time_candidates(runs: dict[str, Callable[[np.ndarray, np.ndarray], Any]],
                    token_ids: Sequence[Sequence[int]], *, shapes: Sequence[tuple[int, int]] = SHAPES, rounds: int = ROUNDS, budget_s: float = BUDGET_S,
                    clock: Callable[[], float] = time.perf_counter) -> dict[str, dict[str, float]]:
    """Median ms per shape of each candidate, timed in alternating rounds after one warm-up each; stops at the budget
    once every candidate has a time for every shape."""
    feeds = _feeds(shapes, token_ids)
    names = [f"{r}x{n}" for r, n in shapes]
    for run in runs.values():
        for ids, mask in feeds:
            run(ids, mask)
    times: dict[str, dict[str, list[float]]] = {c: {s: [] for s in names} for c in runs}
    start = clock()
    for k in range(rounds):
        if k and clock() - start > budget_s:
            break
        order = list(runs) if k % 2 == 0 else list(reversed(runs))
        for label in order:
            for name, (ids, mask) in zip(names, feeds):
                t0 = clock()
                runs[label](ids, mask)
                times[label][name].append(clock() - t0)
    return {c: {s: 1000.0 * float(np.median(ts)) for s, ts in per.items() if ts} for c, per in times.items()}


def geomean(values: Sequence[float]) -> float:
    return float(math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values))) if values else 0.0


def pick(trials: Sequence[Trial], *, margin: float = MARGIN) -> tuple[str, str]:
    """(label, reason): the fastest passing candidate, where it beats the reference by `margin`."""
    ref = next(t for t in trials if t.label == REFERENCE.label)
    best = min((t for t in trials if t.passed), key=lambda t: t.geomean_ms)
    if best.label == ref.label:
        others = [f"{t.label} {t.speedup:.2f}x" if t.passed else f"{t.label} refused ({t.reason})"
                  for t in trials if t.label != ref.label]
        return ref.label, "kept onnxruntime/fp32: fastest" + (f" ({'; '.join(others)})" if others else "")
    if best.speedup < 1.0 + margin:
        return ref.label, (f"kept onnxruntime/fp32: {best.label} only {best.speedup:.2f}x (needs >= "
                           f"{1 + margin:.2f}x to replace it)")
    return best.label, (f"{best.label} {best.speedup:.2f}x onnxruntime/fp32 (geometric mean over {len(best.ms)} "
                        f"shapes), parity gate passed (min cos {best.min_cos:.6f})")


OpenCandidate = Callable[[Candidate], Backend]


def calibrate(found: Sequence[Candidate], open_candidate: OpenCandidate,
              token_ids: Sequence[Sequence[int]], *, budget_s: float = BUDGET_S,
              clock: Callable[[], float] = time.perf_counter,
              gate: Gate = check_gate) -> tuple[list[Trial], dict[str, Backend]]:
    """Gate and time every candidate; the trials, and the backends still open (the passing ones)."""
    opened: dict[str, Backend] = {}
    trials: list[Trial] = []
    batches = gate_batches(token_ids)
    ref_rows: np.ndarray | None = None
    ctxs = {}
    try:
        for cand in found:
            try:
                backend = open_candidate(cand)
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot load is refused, not fatal
                if cand == REFERENCE:
                    raise
                trials.append(Trial(cand.label, False, f"cannot load: {exc}"))
                log.warning("backend candidate refused", candidate=cand.label, reason=f"cannot load: {exc}")
                continue
            ctx = backend.create_context(0)
            rows = embed_batches(ctx.run, batches, len(token_ids), backend.dim)
            if ref_rows is None:
                ref_rows = rows  # the first candidate is the fp32 reference: it passes by definition
                passed, reason, min_cos, max_diff = True, "the fp32 reference", 1.0, 0.0
            else:
                passed, reason, min_cos, max_diff = gate(rows, ref_rows)
            trials.append(Trial(cand.label, passed, reason, min_cos, max_diff))
            if not passed:
                log.warning("backend candidate refused by the parity gate", candidate=cand.label, reason=reason,
                            min_cos=round(min_cos, 6), max_norm_diff=max_diff)
                ctx.close()
                backend.close()
                continue
            opened[cand.label] = backend
            ctxs[cand.label] = ctx
        timed = time_candidates({label: ctx.run for label, ctx in ctxs.items()}, token_ids, budget_s=budget_s,
                                clock=clock)
    except BaseException:
        for ctx in ctxs.values():
            ctx.close()
        for b in opened.values():
            b.close()
        raise
    for ctx in ctxs.values():
        ctx.close()
    by_label = {t.label: t for t in trials}
    for label, ms in timed.items():
        by_label[label].ms = {k: round(v, 3) for k, v in ms.items()}
        by_label[label].geomean_ms = round(geomean(list(ms.values())), 3)
    ref = by_label[REFERENCE.label].geomean_ms if REFERENCE.label in by_label else 0.0
    for t in trials:
        t.speedup = round(ref / t.geomean_ms, 3) if t.passed and t.geomean_ms > 0 else 0.0
    return trials, opened


def default_cache_dir() -> Path:
    return cache_dir("backend-choice")


def choice_key(key_parts: dict[str, Any], found: Sequence[Candidate], flags: frozenset[str]) -> dict[str, Any]:
    """What a cached choice depends on besides calibration.cache_key's CPU model, cores and ORT version."""
    from worker.backends.openvino import version as ov_version

    return {**key_parts, "candidates": [c.label for c in found], "openvino": ov_version(),
            "cpu_flags": sorted(flags), "auto_version": VERSION, "shapes": SHAPES}


def _read_cached(path: Path, found: Sequence[Candidate]) -> tuple[Candidate, str, list[Trial]] | None:
    labels = {c.label: c for c in found}

    def parse(data: Any) -> tuple[Candidate, str, list[Trial]]:
        return labels[data["choice"]], str(data["reason"]), [Trial(**t) for t in data["trials"]]

    return read_json(path, parse, what="backend choice")


def choose(key_parts: dict[str, Any], open_candidate: OpenCandidate, token_ids: Callable[[], Sequence[Sequence[int]]],
           *, flags: frozenset[str] | None = None, ov_available: bool | None = None, int8: bool = False,
           cache_dir: Path | None = None, remeasure: bool = False,
           clock: Callable[[], float] = time.perf_counter, gate: Gate = check_gate) -> tuple[CpuChoice, Backend]:
    """The CPU backend for this machine and its open backend: from the cache, or measured (then cached)."""
    from worker.batching.calibration import cache_key

    t0 = time.monotonic()
    flags = cpu_flags() if flags is None else flags
    found, notes = candidates(flags, ov_available=openvino_available() if ov_available is None else ov_available,
                              int8=int8)
    if len(found) == 1:
        choice = CpuChoice(found[0], "; ".join(notes) or "only candidate", [], False, 0.0)
        return choice, open_candidate(found[0])
    path = (cache_dir or default_cache_dir()) / f"{cache_key(choice_key(key_parts, found, flags))}.json"
    cached = None if remeasure else _read_cached(path, found)
    if cached is not None:
        cand, reason, trials = cached
        backend = open_candidate(cand)
        return CpuChoice(cand, reason, trials, True, time.monotonic() - t0), backend
    trials, opened = calibrate(found, open_candidate, token_ids(), clock=clock, gate=gate)
    label, reason = pick(trials)
    if notes:
        reason = f"{reason}; {'; '.join(notes)}"
    backend = opened.pop(label)
    for other in opened.values():
        other.close()
    cand = next(c for c in found if c.label == label)
    try:
        write_json_atomic(path, {"key": choice_key(key_parts, found, flags), "choice": label, "reason": reason,
                                 "trials": [asdict(t) for t in trials]})
    except OSError as exc:
        log.warning("backend choice not cached", path=str(path), error=str(exc))
    return CpuChoice(cand, reason, trials, False, time.monotonic() - t0), backend
