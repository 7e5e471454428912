"""Offline batching benchmark (no Kafka): monolithic vs bucketed vs sorted, on one backend.

- monolithic: chronological batches of `batch_size` (256), each padded to its longest item
  (the design's baseline).
- bucketed: the worker's own `Bucketer` and dispatch, fed in file order through a bounded
  in-flight window (submit blocks while `window` items are pending: Settings.max_in_flight),
  so it never sees the whole file at once.
- sorted: an offline oracle: the whole input sorted by length, batches of `batch_size`
  padded to their longest item.

Tokenisation is done once up front and is excluded from the timings of every policy;
padding (building the batch arrays) is included in all of them. Policies run in one process
on one backend, alternating their order round by round, and the report gives per-round paired
ratios (median and quartiles), which cancel most of the drift of a shared, noisy machine.

`run_bucketed` is the reusable offline bucketed run (the Kafka-vs-offline benchmark calls it).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from worker.backends.base import Backend, InferenceContext
from worker.bucketing import BatchStats, Bucketer
from worker.cache import EmbeddingCache, key
from worker.keyword_files import KeywordFileError, read_keywords
from worker.profiles import Profile
from worker.tokenize import Encoded, pad

DEFAULT_WINDOW = 4096  # Settings.max_in_flight's default: what the Kafka worker keeps in flight
DEFAULT_BATCH = 256


class BenchError(RuntimeError):
    """The benchmark cannot run (bad input file, incomplete run); the message says why."""


# --------------------------------------------------------------------------- input
def read_queries(path: str | Path, limit: int | None = None) -> list[tuple[str, str]]:
    """(id, text) rows of an `id<TAB>text` file, in file order; blank lines skipped."""
    try:
        rows = list(read_keywords(path, "tsv", limit=limit))
    except KeywordFileError as exc:
        raise BenchError(str(exc)) from None
    if not rows:
        raise BenchError(f"{path}: no queries")
    return rows


# --------------------------------------------------------------------------- results
@dataclass
class PolicyRun:
    """One timed pass of one policy over the whole input."""

    policy: str
    n: int
    seconds: float
    real_tokens: int
    padded_tokens: int
    batches: int
    backend_s: float = 0.0  # time inside backend calls (summed over batches)

    @property
    def keywords_per_s(self) -> float:
        return self.n / self.seconds if self.seconds > 0 else 0.0

    @property
    def padding_waste(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

    def summary(self) -> dict[str, float]:
        return {"keywords_per_s": self.keywords_per_s, "padding_waste": self.padding_waste,
                "seconds": self.seconds, "batches": self.batches, "mean_batch": self.n / max(1, self.batches)}


@dataclass
class BucketedRun(PolicyRun):
    # Each dispatched batch: its item indices (into the encoded list) and its padded length,
    # in dispatch-completion order; the overhead guard replays exactly these.
    formed: list[tuple[list[int], int]] = field(default_factory=list)
    stats: list[BatchStats] = field(default_factory=list)
    embeddings: np.ndarray | None = None


# --------------------------------------------------------------------------- policies
def _run_batches(ctx: InferenceContext, encoded: Sequence[Encoded], order: Sequence[int], batch_size: int,
                 policy: str) -> PolicyRun:
    """Fixed-size batches over `order`, each padded to its longest item, run back to back."""
    real = padded = batches = 0
    backend_s = 0.0
    start = time.perf_counter()
    for lo in range(0, len(order), batch_size):
        batch = [encoded[i] for i in order[lo:lo + batch_size]]
        pad_len = max(len(e.ids) for e in batch)
        ids, mask = pad(batch, pad_len)
        t0 = time.perf_counter()
        ctx.run(ids, mask)
        backend_s += time.perf_counter() - t0
        real += sum(len(e.ids) for e in batch)
        padded += len(batch) * pad_len
        batches += 1
    seconds = time.perf_counter() - start
    return PolicyRun(policy, len(order), seconds, real, padded, batches, backend_s)


def run_monolithic(encoded: Sequence[Encoded], backend: Backend, *, batch_size: int = DEFAULT_BATCH,
                   context: InferenceContext | None = None) -> PolicyRun:
    """Chronological batches padded to the batch max: the baseline."""
    ctx = context or backend.create_context(0)
    try:
        return _run_batches(ctx, encoded, range(len(encoded)), batch_size, "monolithic")
    finally:
        if context is None:
            ctx.close()


def run_sorted(encoded: Sequence[Encoded], backend: Backend, *, batch_size: int = DEFAULT_BATCH,
               context: InferenceContext | None = None) -> PolicyRun:
    """Offline oracle: everything sorted by length (stable), batches padded to the batch max."""
    ctx = context or backend.create_context(0)
    try:
        # The sort is part of the policy's cost (it is tiny next to inference).
        start = time.perf_counter()
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
        sort_s = time.perf_counter() - start
        run = _run_batches(ctx, encoded, order, batch_size, "sorted")
        run.seconds += sort_s
        return run
    finally:
        if context is None:
            ctx.close()


def run_bucketed(encoded: Sequence[Encoded], profile: Profile, backend: Backend, *, window: int = DEFAULT_WINDOW,
                 max_queue_delay_ms: float = 20.0, dispatchers: int = 1, pad_to: str | None = None,
                 eager: bool = True, keep_embeddings: bool = False, policy: str = "bucketed",
                 cache: EmbeddingCache[int] | None = None, coalesce: bool = True) -> BucketedRun:
    """The worker's Bucketer fed in input order through a bounded in-flight window.

    submit() blocks (here, in the feeder) while `window` items are submitted and not yet
    completed, as the Kafka worker pauses its partitions at max_in_flight. The clock runs
    from the first submit until every item is completed and the bucketer's threads are joined.
    Raises BenchError if any item errors or is dropped.

    With a `cache`, it sits in front of the bucketer as in the worker: each item is looked up
    by its token IDs first; a hit is answered at once and never reaches the bucketer, a miss is
    submitted and its vector cached when its batch completes. coalesce=True (the cache's
    lookup/complete/abandon): a repeat of a key still in flight joins it and is answered with the
    leader's vector, holding its window slot until then, as its record would stay uncommitted
    in the worker. coalesce=False (get/put): such a repeat is a miss and computed again.
    `n` counts every item; the batch counters only the items the model ran.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    n = len(encoded)
    room = threading.Semaphore(window)
    lock = threading.Lock()
    formed: list[tuple[list[int], int]] = []
    stats_list: list[BatchStats] = []
    errors: list[BaseException] = []
    out = np.empty((n, backend.dim), dtype=np.float32) if keep_embeddings else None
    keys: list[bytes] = []  # by seq, appended by the feeder before the item is submitted
    answered = [0]  # items answered by the cache: hits, and joins once their leader completes

    def on_complete(seqs: Sequence[int], rows: np.ndarray, stats: BatchStats) -> None:
        followers: list[int] = []
        if cache is not None:
            cached = []
            for s, row in zip(seqs, rows):
                vec, waiters = cache.complete(keys[s], row) if coalesce else (cache.put(keys[s], row), [])
                cached.append(vec)
                followers += waiters
                if out is not None:
                    for w in waiters:
                        out[w] = vec
            rows = np.stack(cached)
        if out is not None:
            out[list(seqs)] = rows
        with lock:
            formed.append((list(seqs), stats.pad_len))
            stats_list.append(stats)
            answered[0] += len(followers)
        for _ in range(len(seqs) + len(followers)):
            room.release()

    def on_error(seqs: Sequence[int], exc: BaseException) -> None:
        followers = [w for s in seqs for w in cache.abandon(keys[s])] if cache is not None and coalesce else []
        with lock:
            errors.append(exc)
        for _ in range(len(seqs) + len(followers)):
            room.release()

    bucketer = Bucketer(profile, backend, on_complete, on_error=on_error, max_queue_delay_ms=max_queue_delay_ms,
                        dispatchers=dispatchers, pad_to=pad_to, eager=eager)  # type: ignore[arg-type]
    bucketer.start()
    start = time.perf_counter()
    try:
        for i, enc in enumerate(encoded):
            # Every item holds a window slot until answered, as its record stays uncommitted in
            # the worker; a hit gives its slot back at once.
            room.acquire()
            if cache is not None:
                k = key(enc.ids)
                keys.append(k)
                if coalesce:
                    found = cache.lookup(k, i)
                    if found.outcome == "joined":
                        continue  # answered, and its slot released, by the leader's on_complete
                    row = found.row
                else:
                    row = cache.get(k)
                if row is not None:
                    with lock:
                        answered[0] += 1
                    if out is not None:
                        out[i] = row
                    room.release()
                    continue
            bucketer.submit(i, enc.ids)
    finally:
        dropped = bucketer.stop(drain=True)
    seconds = time.perf_counter() - start
    if errors or dropped:
        raise BenchError(f"bucketed run incomplete: {len(errors)} failed batches "
                         f"(first: {errors[0]!r})" if errors else f"bucketed run dropped {len(dropped)} items")
    done = sum(s.size for s in stats_list) + answered[0]
    if done != n:
        raise BenchError(f"bucketed run completed {done} of {n} items")
    return BucketedRun(policy, n, seconds, sum(s.real_tokens for s in stats_list),
                       sum(s.padded_tokens for s in stats_list), len(stats_list),
                       sum(s.backend_s for s in stats_list), formed=formed, stats=stats_list, embeddings=out)


def replay_direct(encoded: Sequence[Encoded], formed: Sequence[tuple[list[int], int]], backend: Backend, *,
                  threads: int = 1) -> PolicyRun:
    """Overhead guard: the same batches, pre-padded, run by direct backend calls.

    `threads` callers (one context each) take the batches in order from a shared index, the
    same parallelism the bucketer's dispatchers have, without its queues, forming or padding.
    """
    arrays = [pad([encoded[i] for i in seqs], pad_len) for seqs, pad_len in formed]
    n = sum(len(seqs) for seqs, _ in formed)
    contexts = [backend.create_context(i) for i in range(threads)]
    next_index = iter(range(len(arrays)))
    lock = threading.Lock()
    failures: list[BaseException] = []

    def work(ctx: InferenceContext) -> None:
        try:
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                ctx.run(*arrays[i])
        except BaseException as exc:  # surfaced below, after the join
            failures.append(exc)

    workers = [threading.Thread(target=work, args=(ctx,), name=f"kwe-bench-direct-{k}")
               for k, ctx in enumerate(contexts)]
    start = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    seconds = time.perf_counter() - start
    for ctx in contexts:
        ctx.close()
    if failures:
        raise BenchError(f"direct replay failed: {failures[0]!r}")
    real = sum(len(encoded[i].ids) for seqs, _ in formed for i in seqs)
    padded = sum(len(seqs) * pad_len for seqs, pad_len in formed)
    return PolicyRun("direct", n, seconds, real, padded, len(formed), seconds)


# --------------------------------------------------------------------------- latency
@dataclass
class LatencyLevel:
    load: float  # fraction of the bucketed peak rate
    offered_per_s: float
    achieved_per_s: float
    n: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    mean_batch: float
    padding_waste: float


def run_open_loop(encoded: Sequence[Encoded], profile: Profile, backend: Backend, *, rate: float,
                  seconds: float, max_queue_delay_ms: float = 20.0, dispatchers: int = 1,
                  pad_to: str | None = None, eager: bool = True, seed: int = 0, load: float = 0.0,
                  warmup_fraction: float = 0.1) -> LatencyLevel:
    """Open-loop Poisson arrivals at `rate`/s for `seconds`; latency from arrival to embedding.

    Arrival times are drawn up front; the feeder sleeps until each one and submits. Latency is
    counted from the *scheduled* arrival, so a feeder running late is charged to the system,
    not hidden (no coordinated omission). Items arriving in the first `warmup_fraction` of the
    run are left out of the percentiles. Keywords are taken in file order, cycling.
    """
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        arrivals.append(t)
    n = len(arrivals)
    done_at = np.zeros(n)
    lock = threading.Lock()
    sizes: list[int] = []
    real = padded = 0
    finished = threading.Event()
    remaining = [n]

    def on_complete(seqs: Sequence[int], rows: np.ndarray, stats: BatchStats) -> None:
        nonlocal real, padded
        now = time.perf_counter()
        done_at[list(seqs)] = now
        with lock:
            sizes.append(stats.size)
            real += stats.real_tokens
            padded += stats.padded_tokens
            remaining[0] -= len(seqs)
            if remaining[0] == 0:
                finished.set()

    failures: list[BaseException] = []

    def on_error(seqs: Sequence[int], exc: BaseException) -> None:
        with lock:
            failures.append(exc)
            remaining[0] -= len(seqs)
            if remaining[0] == 0:
                finished.set()

    bucketer = Bucketer(profile, backend, on_complete, on_error=on_error, max_queue_delay_ms=max_queue_delay_ms,
                        dispatchers=dispatchers, pad_to=pad_to, eager=eager)  # type: ignore[arg-type]
    bucketer.start()
    start = time.perf_counter()
    try:
        for i, at in enumerate(arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            bucketer.submit(i, encoded[i % len(encoded)].ids)
        # Open loop: the system gets until the arrivals end plus a generous tail to finish.
        finished.wait(max(30.0, seconds * 3))
    finally:
        dropped = bucketer.stop(drain=False)
    if failures:
        raise BenchError(f"latency run at {rate:.0f}/s: {len(failures)} batches failed (first: {failures[0]!r})")
    if dropped or not finished.is_set():
        raise BenchError(f"latency run at {rate:.0f}/s did not finish: {remaining[0]} items left "
                         "(the offered load is above what the backend sustains)")
    end = float(done_at.max()) - start
    lat = (done_at - start - np.asarray(arrivals)) * 1000.0
    keep = lat[np.asarray(arrivals) >= seconds * warmup_fraction]
    p50, p95, p99 = np.percentile(keep, [50, 95, 99])
    return LatencyLevel(load=load, offered_per_s=rate, achieved_per_s=n / end, n=len(keep), p50_ms=float(p50),
                        p95_ms=float(p95), p99_ms=float(p99), max_ms=float(keep.max()),
                        mean_batch=n / max(1, len(sizes)), padding_waste=1.0 - real / padded if padded else 0.0)


# --------------------------------------------------------------------------- the whole benchmark
def quartiles(values: Sequence[float]) -> dict[str, float]:
    """Median and quartiles (inclusive method; with one value all three are that value)."""
    vals = sorted(values)
    if len(vals) == 1:
        return {"median": vals[0], "q1": vals[0], "q3": vals[0]}
    q1, med, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    return {"median": med, "q1": q1, "q3": q3}


@dataclass
class BenchConfig:
    dataset: str
    profile: Profile
    compare_profile: Profile | None
    rounds: int = 3
    batch_size: int = DEFAULT_BATCH
    window: int = DEFAULT_WINDOW
    max_queue_delay_ms: float = 20.0
    dispatchers: int = 1
    eager: bool = True
    latency: bool = True
    latency_seconds: float = 10.0
    latency_loads: tuple[float, ...] = (0.25, 0.5, 0.8)
    backend_desc: dict[str, Any] = field(default_factory=dict)


def run_benchmark(encoded: Sequence[Encoded], backend: Backend, cfg: BenchConfig,
                  log: Callable[[str], None] = lambda s: None, *,
                  baseline_backend: Backend | None = None) -> dict[str, Any]:
    """All policies, `cfg.rounds` rounds in alternating order; returns the JSON report.

    `backend` runs the bucketed policies (with cfg.dispatchers threads) and the overhead
    guard; `baseline_backend` (default: the same) runs monolithic and sorted from one thread.
    They differ only when the bucketed setting is several single-threaded contexts, which
    would leave a one-caller baseline on one core: the baselines then get a session that uses
    every core in each call, their best configuration.
    """
    base = baseline_backend or backend
    ctx = base.create_context(0)
    compare_name = f"bucketed[{cfg.compare_profile.name}]" if cfg.compare_profile else None

    def bucketed(profile: Profile, name: str) -> BucketedRun:
        return run_bucketed(encoded, profile, backend, window=cfg.window, max_queue_delay_ms=cfg.max_queue_delay_ms,
                            dispatchers=cfg.dispatchers, eager=cfg.eager, policy=name)

    policies: dict[str, Callable[[], PolicyRun]] = {
        "monolithic": lambda: run_monolithic(encoded, base, batch_size=cfg.batch_size, context=ctx),
        "bucketed": lambda: bucketed(cfg.profile, "bucketed"),
        "sorted": lambda: run_sorted(encoded, base, batch_size=cfg.batch_size, context=ctx),
    }
    if cfg.compare_profile is not None and compare_name is not None:
        cmp_profile = cfg.compare_profile
        policies[compare_name] = lambda: bucketed(cmp_profile, compare_name)

    # Warm-up (not reported): ORT allocates its arenas and the OS its pages on first use.
    warm = list(encoded[: min(len(encoded), 1024)])
    run_monolithic(warm, base, batch_size=cfg.batch_size, context=ctx)
    run_bucketed(warm, cfg.profile, backend, window=cfg.window, dispatchers=cfg.dispatchers, eager=cfg.eager)

    names = list(policies)
    per_round: list[dict[str, PolicyRun]] = []
    overhead: list[dict[str, float]] = []
    for r in range(cfg.rounds):
        # Rotate the order every round and reverse it every other one, so that no policy
        # always runs first, last, or right after the same neighbour.
        k = r % len(names)
        order = names[k:] + names[:k]
        if r % 2:
            order.reverse()
        results: dict[str, PolicyRun] = {}
        for name in order:
            run = policies[name]()
            results[name] = run
            log(f"round {r + 1}/{cfg.rounds} {name:>24}: {run.keywords_per_s:8.1f} kw/s  "
                f"waste {run.padding_waste:6.1%}  {run.batches} batches")
            if name == "bucketed":
                assert isinstance(run, BucketedRun)
                # Overhead guard, right after the run it replays: the same batches, pre-padded,
                # by direct calls on one context.
                direct = replay_direct(encoded, run.formed, backend, threads=cfg.dispatchers)
                overhead.append({"bucketed_s": run.seconds, "direct_s": direct.seconds,
                                 "backend_busy_s": run.backend_s,
                                 "overhead": run.seconds / direct.seconds - 1.0})
                log(f"round {r + 1}/{cfg.rounds} {'direct replay':>24}: {direct.keywords_per_s:8.1f} kw/s  "
                    f"overhead {overhead[-1]['overhead']:+.1%}")
        per_round.append(results)
    ctx.close()

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
        "rounds": cfg.rounds,
        "timing": "tokenization done once up front and excluded from every policy; padding included in all",
        "backend": cfg.backend_desc,
        "profile": cfg.profile.name,
        "settings": {"batch_size": cfg.batch_size, "window": cfg.window,
                     "max_queue_delay_ms": cfg.max_queue_delay_ms, "dispatchers": cfg.dispatchers,
                     "eager": cfg.eager},
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
                                  max_queue_delay_ms=cfg.max_queue_delay_ms, dispatchers=cfg.dispatchers,
                                  eager=cfg.eager, load=load, seed=int(load * 1000))
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


# --------------------------------------------------------------------------- markdown
def _fmt_q(q: dict[str, float]) -> str:
    return f"{q['median']:.2f} ({q['q1']:.2f}-{q['q3']:.2f})"


def render_markdown(report: dict[str, Any], command: str) -> str:
    pol = report["policies"]
    lines = [
        "# Bucketed batching benchmark",
        "",
        f"`{command}`",
        "",
        f"Dataset `{report['dataset']}`, first {report['n']} queries, {report['rounds']} rounds in alternating "
        f"order, backend {report['backend'].get('name', '?')} "
        f"({', '.join(f'{k}={v}' for k, v in report['backend'].items() if k != 'name')}), "
        f"profile `{report['profile']}`, settings {report['settings']}. {report['timing'].capitalize()}.",
        "",
        "| policy | keywords/s (median) | padding waste | mean batch |",
        "|---|---:|---:|---:|",
    ]
    rows = [(name, pol[name]) for name in ("monolithic", "bucketed", "sorted")]
    if "compare" in report:
        rows.insert(2, (f"bucketed[{report['compare']['profile']}]", report["compare"]["bucketed"]))
    for name, p in rows:
        label = f"bucketed[{report['profile']}]" if name == "bucketed" else name
        lines.append(f"| {label} | {p['keywords_per_s']:.0f} | {p['padding_waste']:.1%} | {p['mean_batch']:.1f} |")
    lines += ["", "Paired per-round throughput ratios, median (q1-q3):", "", "| ratio | value |", "|---|---:|"]
    for name, q in report["ratios"].items():
        lines.append(f"| {name} | {_fmt_q(q)} |")
    if "compare" in report:
        for name, q in report["compare"]["ratios"].items():
            lines.append(f"| {name} | {_fmt_q(q)} |")
    ov = report["overhead"]
    lines += ["", f"Overhead guard ({ov['what']}): median {ov['median']:+.1%} (q1 {ov['q1']:+.1%}, "
              f"q3 {ov['q3']:+.1%}).", ""]
    lat = report.get("latency") or {}
    if lat:
        lines += [f"Latency, {lat['arrivals']}, {lat['seconds_per_level']:.0f} s per level, bucketed peak "
                  f"{lat['peak_keywords_per_s']:.0f} keywords/s:", "",
                  "| load | offered/s | achieved/s | p50 ms | p95 ms | p99 ms | max ms | mean batch |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for lv in lat["levels"]:
            lines.append(f"| {lv['load']:.0%} | {lv['offered_per_s']:.0f} | {lv['achieved_per_s']:.0f} | "
                         f"{lv['p50_ms']:.0f} | {lv['p95_ms']:.0f} | {lv['p99_ms']:.0f} | {lv['max_ms']:.0f} | "
                         f"{lv['mean_batch']:.1f} |")
        lines.append("")
    return "\n".join(lines)

