"""The exact-match embedding cache (worker/embedding_cache.py) and Embedder's use of it."""

from __future__ import annotations

import gc
import threading
import tracemalloc

import numpy as np
import pytest

from worker.embedding_cache import ENTRY_OVERHEAD, CacheError, EmbeddingCache, hit_rate_line, key
from worker.operations.metrics import Metrics

DIM = 384


def _row(seed: int, dim: int = DIM) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(dim).astype(np.float32)


def _ids(seed: int, n: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30522, size=n).astype(np.int64)


# ------------------------------------------------------------------ keys
def test_key_is_the_token_ids_and_only_them() -> None:
    a = np.array([101, 2770, 6007, 102], dtype=np.int64)
    assert key(a) == key(a.astype(np.int32)) == key(a.astype(np.uint16)) == key(a.copy())
    assert key(a) != key(a[:3])
    assert key(a) != key(np.array([101, 2770, 6008, 102]))
    assert len(key(a)) == 4 * 8  # the tokenizer's int64, as it is


@pytest.mark.parametrize("bad", [np.array([1.0, 2.0]), np.array([[1, 2]]), [101, 102],
                                 np.array([2**63, 1], dtype=np.uint64)])
def test_key_refuses_what_is_not_token_ids(bad: object) -> None:
    with pytest.raises(CacheError, match="cache key"):
        key(bad)


# ------------------------------------------------------------------ values
def test_hit_is_bit_identical_and_counts() -> None:
    cache = EmbeddingCache(1 << 20, DIM)
    row = _row(1)
    k = key(_ids(1))
    assert cache.get(k) is None
    cache.put(k, row)
    row_before = row.copy()
    row += 1.0  # the caller reusing its buffer must not reach the cached copy
    got = cache.get(k)
    assert got is not None and got.dtype == np.float32
    assert got.tobytes() == row_before.tobytes()
    s = cache.stats()
    assert (s.hits, s.misses, s.entries) == (1, 1, 1)
    assert s.hit_rate == 0.5


def test_cached_rows_cannot_be_mutated() -> None:
    cache = EmbeddingCache(1 << 20, DIM)
    k = key(_ids(2))
    stored = cache.put(k, _row(2))
    got = cache.get(k)
    for arr in (stored, got):
        with pytest.raises(ValueError):
            arr[0] = 42.0
        with pytest.raises(ValueError):
            arr.setflags(write=True)
    assert cache.get(k).tobytes() == _row(2).tobytes()


def test_put_keeps_the_first_vector_of_a_key() -> None:
    cache = EmbeddingCache(1 << 20, DIM)
    k = key(_ids(3))
    first = cache.put(k, _row(3))
    again = cache.put(k, _row(4))  # e.g. a repeat computed in another batch shape
    assert again.tobytes() == first.tobytes() == cache.get(k).tobytes()
    assert len(cache) == 1


@pytest.mark.parametrize("row", [np.zeros(DIM, dtype=np.float64), np.zeros(DIM + 1, dtype=np.float32),
                                 np.zeros((1, DIM), dtype=np.float32)])
def test_put_refuses_a_row_of_the_wrong_shape_or_type(row: np.ndarray) -> None:
    cache = EmbeddingCache(1 << 20, DIM)
    with pytest.raises(CacheError, match="float32 row"):
        cache.put(key(_ids(5)), row)
    with pytest.raises(CacheError, match="key must be bytes"):
        cache.put("not bytes", _row(5))  # type: ignore[arg-type]


def test_bad_construction() -> None:
    with pytest.raises(CacheError, match="max_bytes"):
        EmbeddingCache(-1, DIM)
    with pytest.raises(CacheError, match="dim"):
        EmbeddingCache(10, 0)


def test_zero_bytes_stores_nothing() -> None:
    cache = EmbeddingCache(0, DIM)
    k = key(_ids(6))
    assert not cache.enabled
    assert cache.put(k, _row(6)).tobytes() == _row(6).tobytes()
    assert cache.get(k) is None and len(cache) == 0


# ------------------------------------------------------------------ the byte bound
def test_byte_bound_holds_under_many_inserts_and_matches_real_memory() -> None:
    n, bound = 5000, 2_000_000
    keys = [key(_ids(i, n=3 + i % 20)) for i in range(n)]
    rows = [_row(i) for i in range(n)]
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        cache = EmbeddingCache(bound, DIM)
        for i, (k, r) in enumerate(zip(keys, rows)):
            cache.put(k, r)
            if i % 97 == 0:
                assert cache.stats().nbytes <= bound
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    s = cache.stats()
    assert s.nbytes <= bound
    assert s.evictions == n - s.entries > 0
    # The account is the real size of what the cache keeps: key and value objects plus the map.
    exact = sum(EmbeddingCache.entry_bytes(k, cache._map[k]) for k in cache.keys_lru_first())
    assert s.nbytes == exact
    real = used - base
    assert 0.85 * s.nbytes <= real <= bound, (real, s.nbytes)
    # Nearly full: evicting makes room for one entry at a time.
    assert s.nbytes > bound - (max(len(k) for k in keys) + 4 * DIM + 100 + ENTRY_OVERHEAD)


def test_eviction_is_least_recently_used_first() -> None:
    one = EmbeddingCache.entry_bytes(key(_ids(0)), _row(0).tobytes())
    cache = EmbeddingCache(3 * one, DIM)
    a, b, c, d = (key(_ids(i)) for i in range(4))
    for k in (a, b, c):
        cache.put(k, _row(0))
    assert cache.get(a) is not None  # a is now the most recent; b the least
    cache.put(d, _row(0))
    assert cache.keys_lru_first() == [c, a, d]
    assert b not in cache and cache.stats().evictions == 1
    cache.put(c, _row(9))  # a put of a present key refreshes it too
    cache.put(b, _row(0))
    assert cache.keys_lru_first() == [d, c, b]


def test_a_row_bigger_than_the_bound_is_not_stored() -> None:
    cache = EmbeddingCache(1000, DIM)  # less than one 384-d vector
    k = key(_ids(7))
    cache.put(k, _row(7))
    assert len(cache) == 0 and cache.stats().nbytes == 0 and cache.stats().evictions == 0


# ------------------------------------------------------------------ threads
def test_concurrent_get_and_put_keep_rows_and_account_consistent() -> None:
    n_keys, bound = 400, 150 * (4 * DIM + 200)
    keys = [key(_ids(i, n=4 + i % 8)) for i in range(n_keys)]
    rows = [_row(i) for i in range(n_keys)]
    cache = EmbeddingCache(bound, DIM)
    errors: list[str] = []
    lookups = [0] * 6

    def worker(t: int) -> None:
        rng = np.random.default_rng(t)
        for _ in range(3000):
            i = int(rng.integers(n_keys))
            got = cache.get(keys[i])
            lookups[t] += 1
            if got is None:
                got = cache.put(keys[i], rows[i])
            if got.tobytes() != rows[i].tobytes():
                errors.append(f"thread {t}: key {i} returned another row")
                return

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = cache.stats()
    assert s.hits + s.misses == sum(lookups)
    assert s.nbytes <= bound and s.evictions > 0
    assert s.nbytes == sum(EmbeddingCache.entry_bytes(k, cache._map[k]) for k in cache.keys_lru_first())


# ------------------------------------------------------------------ metrics
def test_observer_counters_follow_the_cache() -> None:
    metrics = Metrics()
    one = EmbeddingCache.entry_bytes(key(_ids(0)), _row(0).tobytes())
    cache = EmbeddingCache(2 * one, DIM, observer=metrics)
    ks = [key(_ids(i)) for i in range(3)]
    for k in ks:
        assert cache.get(k) is None
        cache.put(k, _row(0))
    assert cache.get(ks[2]) is not None
    text = metrics.render().decode()
    assert "kwe_cache_hits_total 1.0" in text
    assert "kwe_cache_misses_total 3.0" in text
    assert "kwe_cache_evictions_total 1.0" in text
    assert "kwe_cache_entries 2.0" in text
    assert f"kwe_cache_bytes {float(cache.stats().nbytes)}" in text


def test_hit_rate_line() -> None:
    assert hit_rate_line(1234, 8766, 0) == "1,234 hits of 10,000 lookups (12.3%), 0 evicted"
    assert hit_rate_line(0, 0, 0).startswith("0 hits of 0 lookups (0.0%)")
    cache = EmbeddingCache(1 << 20, DIM)
    cache.put(key(_ids(1)), _row(1))
    assert cache.stats().line() == "0 hits of 0 lookups (0.0%), 0 evicted, 1 vectors in 0.0 MB"


# ------------------------------------------------------------------ Embedder
def test_embedder_with_cache_returns_the_vectors_without_it() -> None:
    from worker import Embedder

    texts = ["cheap flights", "Cheap Flights", "used cars", "cheap flights", "a " * 300, "running shoes",
             "used cars", "東京 ラーメン"]
    with Embedder(cache_bytes=0) as plain, Embedder(cache_bytes=1 << 20) as cached:
        assert plain.cache is None and cached.cache is not None
        ref = plain.embed(texts)
        first = cached.embed(texts)
        # Same vectors as without the cache (repeats are run once, so batches may differ).
        assert np.allclose(first, ref, atol=2e-6)
        # Texts that tokenize the same share one vector (the tokenizer lowercases).
        assert first[0].tobytes() == first[1].tobytes() == first[3].tobytes()
        distinct = cached.cache.stats().entries
        assert distinct == 5  # "Cheap Flights" and the repeats share keys
        again = cached.embed(list(reversed(texts)))
        assert again[::-1].tobytes() == first.tobytes()  # hits are bit-identical
        s = cached.cache.stats()
        assert s.hits == distinct and s.entries == distinct


def test_demo_reads_the_hit_rate_off_the_metrics_page() -> None:
    from worker.commands.demo import _metric_value

    metrics = Metrics()
    cache = EmbeddingCache(1 << 20, DIM, observer=metrics)
    k = key(_ids(1))
    cache.get(k)
    cache.put(k, _row(1))
    cache.get(k)
    text = metrics.render().decode()
    counts = [_metric_value(text, f"kwe_cache_{c}_total") for c in ("hits", "misses", "evictions")]
    assert counts == [1.0, 1.0, 0.0]
    assert hit_rate_line(*counts) == "1 hits of 2 lookups (50.0%), 0 evicted"


# ------------------------------------------------------------------ single flight
def test_lookup_coalesces_repeats_of_a_key_in_flight() -> None:
    metrics = Metrics()
    cache: EmbeddingCache[str] = EmbeddingCache(1 << 20, DIM, observer=metrics)
    k = key(_ids(1))
    assert cache.lookup(k, "first").outcome == "miss"  # "first" leads
    assert cache.lookup(k, "second").outcome == "joined"
    assert cache.lookup(k, "third").outcome == "joined"
    assert cache.in_flight() == 1 and len(cache) == 0
    row, waiters = cache.complete(k, _row(1))
    assert waiters == ["second", "third"] and row.tobytes() == _row(1).tobytes()
    assert cache.in_flight() == 0
    hit = cache.lookup(k, "fourth")
    assert hit.outcome == "hit" and hit.row.tobytes() == row.tobytes()
    s = cache.stats()
    assert (s.hits, s.misses, s.joined, s.lookups) == (1, 1, 2, 4) and s.hit_rate == 0.75
    assert s.line().startswith("1 hits + 2 joined in flight of 4 lookups (75.0%)")
    assert "kwe_cache_joined_total 2.0" in metrics.render().decode()


def test_abandon_hands_the_waiters_back_and_the_next_lookup_leads() -> None:
    cache: EmbeddingCache[int] = EmbeddingCache(1 << 20, DIM)
    k = key(_ids(2))
    assert cache.lookup(k, 1).outcome == "miss"
    assert cache.lookup(k, 2).outcome == "joined"
    assert cache.abandon(k) == [2]  # the leader's batch failed: 2 must be retried or failed
    assert cache.in_flight() == 0 and k not in cache
    assert cache.lookup(k, 3).outcome == "miss"  # nobody leads now: this one does
    assert cache.abandon(k) == [] and cache.abandon(k) == []


def test_concurrent_lookups_elect_one_leader_per_key() -> None:
    cache: EmbeddingCache[int] = EmbeddingCache(1 << 22, DIM)
    keys = [key(_ids(i)) for i in range(50)]
    outcomes: dict[str, int] = {"hit": 0, "miss": 0, "joined": 0}
    answered: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def worker(t: int) -> None:
        barrier.wait()
        for i, k in enumerate(keys):
            found = cache.lookup(k, t * 1000 + i)
            with lock:
                outcomes[found.outcome] += 1
            if found.outcome == "miss":
                _, waiters = cache.complete(k, _row(i))
                with lock:
                    answered.extend(waiters)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes["miss"] == len(keys)  # exactly one leader per key
    assert outcomes["hit"] + outcomes["joined"] == 3 * len(keys)
    assert len(answered) == outcomes["joined"] and cache.in_flight() == 0
