"""Shared by the GPU scripts: the real bucketer over a list of rows, paired rounds of configurations, cosines."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from worker.core.profiles import Profile


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [N, dim] arrays."""
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(1) / np.where(den > 0, den, 1.0)


def embed_through_bucketer(backend: Any, profile: Profile, rows: Sequence[np.ndarray]) -> np.ndarray:
    """Every row through the real Bucketer (each in its bucket's context); [N, dim] in input order."""
    from worker.benchmark.policies import run_bucketed
    from worker.intake.tokenize import Encoded

    encoded = [Encoded(ids=r, length=len(r), truncated=False) for r in rows]
    run = run_bucketed(encoded, profile, backend, window=len(encoded), keep_embeddings=True, policy="parity")
    assert run.embeddings is not None
    return run.embeddings


def paired_bucketed(encoded: Sequence[Any], runs: dict[str, tuple[Any, Profile]], rounds: int,
                    pairs: Sequence[tuple[str, str]], *, options: Any = None,
                    deadline: float | None = None) -> dict[str, Any]:
    """Each (backend, profile) through the real bucketer, order rotated per round; the paired ratios a/b.

    With a `deadline` (a time.monotonic() value), no round starts once the time a round took
    would end past it; the first round always runs. `rounds_run` says how many did.
    """
    from worker.benchmark.policies import BucketerOptions, run_bucketed
    from worker.benchmark.report import quartiles

    options = options or BucketerOptions()
    names = list(runs)
    per_round: list[dict[str, float]] = []
    round_s = 0.0
    for r in range(rounds):
        started = time.monotonic()
        if per_round and deadline is not None and started + round_s > deadline:
            break
        order = names[r % len(names):] + names[:r % len(names)]
        kw = {}
        for name in order:
            backend, profile = runs[name]
            run = run_bucketed(encoded, profile, backend, options=options, policy=name)
            kw[name] = run.keywords_per_s
            print(f"round {r + 1}/{rounds} {name}: {run.keywords_per_s:,.0f} kw/s, waste {run.padding_waste:.1%}",
                  flush=True)
        per_round.append(kw)
        round_s = time.monotonic() - started
    return {"rounds": per_round, "rounds_run": len(per_round), "rounds_asked": rounds,
            "keywords_per_s": {n: quartiles([k[n] for k in per_round]) for n in names},
            "ratios": {f"{a}/{b}": quartiles([k[a] / k[b] for k in per_round]) for a, b in pairs}}
