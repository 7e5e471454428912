"""The whole benchmark: every policy, rounds in rotating order, paired ratios, the JSON report.

Policies run in one process on one backend, their order rotated round by round, and the
report gives per-round paired ratios (median and quartiles), which cancel most of the drift
of a shared, noisy machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from worker.backends.base import Backend
from worker.benchmark.load import run_open_loop
from worker.benchmark.policies import (
    DEFAULT_BATCH,
    DEFAULT_WINDOW,
    BucketedRun,
    BucketerOptions,
    PolicyRun,
    replay_direct,
    run_bucketed,
    run_monolithic,
    run_sorted,
)
from worker.benchmark.report import quartiles
from worker.core.profiles import Profile
from worker.intake.tokenize import Encoded


def round_order(names: Sequence[str], r: int) -> list[str]:
    """The order of round r of paired runs: rotated every round and reversed every other one, so
    that no configuration always runs first, last, or right after the same neighbour."""
    k = r % len(names)
    order = [*names[k:], *names[:k]]
    if r % 2:
        order.reverse()
    return order


@dataclass
class BenchConfig:
    dataset: str
    profile: Profile
    compare_profile: Profile | None
    rounds: int = 3
    batch_size: int = DEFAULT_BATCH
    window: int = DEFAULT_WINDOW
    options: BucketerOptions = BucketerOptions()
    latency: bool = True
    latency_seconds: float = 10.0
    latency_loads: tuple[float, ...] = (0.25, 0.5, 0.8)
    backend_desc: dict[str, Any] = field(default_factory=dict)
    input_desc: dict[str, Any] = field(default_factory=dict)  # e.g. lines skipped while reading


def run_benchmark(encoded: Sequence[Encoded], backend: Backend, cfg: BenchConfig,
                  log: Callable[[str], None] = lambda s: None, *,
                  baseline_backend: Backend | None = None) -> dict[str, Any]:
    """All policies, `cfg.rounds` rounds in alternating order; returns the JSON report.

    `backend` runs the bucketed policies (with cfg.options.dispatchers threads) and the
    overhead guard; `baseline_backend` (default: the same) runs monolithic and sorted from one
    thread. They differ only when the bucketed setting is several single-threaded ONNX Runtime
    contexts, which would leave a one-caller baseline on one core: the baselines then get a
    session that uses every core in each call, their best configuration.
    """
    base = baseline_backend or backend
    opts = cfg.options
    compare_name = f"bucketed[{cfg.compare_profile.name}]" if cfg.compare_profile else None

    def bucketed(profile: Profile, name: str) -> BucketedRun:
        return run_bucketed(encoded, profile, backend, window=cfg.window, options=opts, policy=name)

    policies: dict[str, Callable[[], PolicyRun]] = {
        "monolithic": lambda: run_monolithic(encoded, base, cfg.profile, batch_size=cfg.batch_size),
        "bucketed": lambda: bucketed(cfg.profile, "bucketed"),
        "sorted": lambda: run_sorted(encoded, base, cfg.profile, batch_size=cfg.batch_size),
    }
    if cfg.compare_profile is not None and compare_name is not None:
        cmp_profile = cfg.compare_profile
        policies[compare_name] = lambda: bucketed(cmp_profile, compare_name)

    # Warm-up (not reported): ORT allocates its arenas and the OS its pages on first use.
    warm = list(encoded[: min(len(encoded), 1024)])
    run_monolithic(warm, base, cfg.profile, batch_size=cfg.batch_size)
    run_bucketed(warm, cfg.profile, backend, window=cfg.window, options=opts)

    names = list(policies)
    per_round: list[dict[str, PolicyRun]] = []
    overhead: list[dict[str, float]] = []
    for r in range(cfg.rounds):
        results: dict[str, PolicyRun] = {}
        for name in round_order(names, r):
            run = policies[name]()
            results[name] = run
            log(f"round {r + 1}/{cfg.rounds} {name:>24}: {run.keywords_per_s:8.1f} kw/s  "
                f"waste {run.padding_waste:6.1%}  {run.batches} batches")
            if name == "bucketed":
                assert isinstance(run, BucketedRun)
                # Overhead guard, right after the run it replays: the same batches, pre-padded,
                # by direct calls from the same thread layout.
                direct = replay_direct(encoded, run.formed, backend, threads=opts.dispatchers)
                overhead.append({"bucketed_s": run.seconds, "direct_s": direct.seconds,
                                 "backend_busy_s": run.backend_s,
                                 "overhead": run.seconds / direct.seconds - 1.0})
                log(f"round {r + 1}/{cfg.rounds} {'direct replay':>24}: {direct.keywords_per_s:8.1f} kw/s  "
                    f"overhead {overhead[-1]['overhead']:+.1%}")
        per_round.append(results)

    def summary(name: str) -> dict[str, Any]:
        runs = [rr[name] for rr in per_round]
        return {"keywords_per_s": statistics.median(r.keywords_per_s for r in runs),
                "padding_waste": statistics.median(r.padding_waste for r in runs),
                "mean_batch": statistics.median(r.n / max(1, r.batches) for r in runs),
                "rounds_keywords_per_s": [r.keywords_per_s for r in runs]}

    def ratio(a: str, b: str) -> dict[str, float]:
        return quartiles([rr[a].keywords_per_s / rr[b].keywords_per_s for rr in per_round])

    report: dict[str, Any] = {
        "dataset": cfg.dataset,
        "n": len(encoded),
        "input": cfg.input_desc,
        "rounds": cfg.rounds,
        "timing": "tokenization done once up front and excluded from every policy; padding included in all",
        "backend": cfg.backend_desc,
        "profile": cfg.profile.name,
        "settings": {"batch_size": cfg.batch_size, "window": cfg.window,
                     "max_queue_delay_ms": opts.max_queue_delay_ms, "dispatchers": opts.dispatchers,
                     "eager": opts.eager},
        "policies": {name: summary(name) for name in ("monolithic", "bucketed", "sorted")},
        "ratios": {"bucketed/monolithic": ratio("bucketed", "monolithic"),
                   "bucketed/sorted": ratio("bucketed", "sorted"),
                   "sorted/monolithic": ratio("sorted", "monolithic")},
        "overhead": {
            "what": "bucketed wall time / direct backend calls on the same pre-padded batches, "
                    "from as many threads as dispatchers, - 1",
            **quartiles([o["overhead"] for o in overhead]),
            "rounds": overhead,
        },
    }
    if compare_name is not None and cfg.compare_profile is not None:
        report["compare"] = {
            "profile": cfg.compare_profile.name,
            "bucketed": summary(compare_name),
            "ratios": {f"{compare_name}/monolithic": ratio(compare_name, "monolithic"),
                       f"{compare_name}/sorted": ratio(compare_name, "sorted"),
                       f"bucketed/{compare_name}": ratio("bucketed", compare_name)},
        }
    if cfg.latency:
        peak = report["policies"]["bucketed"]["keywords_per_s"]
        levels = []
        for load in cfg.latency_loads:
            level = run_open_loop(encoded, cfg.profile, backend, rate=peak * load, seconds=cfg.latency_seconds,
                                  options=opts, load=load, seed=int(load * 1000))
            log(f"latency at {load:.0%} of peak ({level.offered_per_s:.0f}/s): p50 {level.p50_ms:.0f} ms  "
                f"p95 {level.p95_ms:.0f} ms  p99 {level.p99_ms:.0f} ms  mean batch {level.mean_batch:.1f}")
            levels.append(asdict(level))
        report["latency"] = {"policy": "bucketed", "profile": cfg.profile.name, "peak_keywords_per_s": peak,
                             "seconds_per_level": cfg.latency_seconds,
                             "arrivals": "open-loop Poisson; latency from scheduled arrival to embedding",
                             "levels": levels}
    else:
        report["latency"] = {}
    return report
