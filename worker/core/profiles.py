"""Bucket profiles: load and validate profiles.toml next to this module (the bucketer and the TensorRT build read it)."""

from __future__ import annotations

import bisect
import functools
import tomllib
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args

from worker.core.errors import KeywordEmbedderError

# What a batch is padded to: its bucket's bound (one fixed shape per bucket, what TensorRT
# wants) or its longest item (what costs least where every position is computed, ONNX Runtime on CPU).
PadPolicy = Literal["bucket", "longest"]
PAD_POLICIES: tuple[PadPolicy, ...] = get_args(PadPolicy)


class ProfileError(KeywordEmbedderError, ValueError):
    """The profiles file or one of its profiles is invalid; the message names the file and profile."""


@dataclass(frozen=True)
class Bucket:
    max_len: int
    max_batch: int
    opt_batch: int


@dataclass(frozen=True)
class Profile:
    name: str
    buckets: tuple[Bucket, ...]
    token_budget: int
    pad_to: PadPolicy
    align: int | None = None
    description: str = ""

    @functools.cached_property
    def bounds(self) -> tuple[int, ...]:
        # Cached: bucket_for reads it for every keyword (a frozen dataclass's cached_property is
        # written straight into the instance dict).
        return tuple(b.max_len for b in self.buckets)

    @property
    def max_len(self) -> int:
        return self.buckets[-1].max_len

    def capped(self, token_budget: int, why: str) -> Profile:
        """This profile with its padded-token budget cut to `token_budget` (never below one item of the
        overflow bucket); `why` goes into the description (a sparse model's logits, worker/core/sparse.py)."""
        budget = max(self.max_len, min(self.token_budget, token_budget))
        if budget == self.token_budget:
            return self
        note = f"token budget {self.token_budget} cut to {budget}: {why}"
        return replace(self, token_budget=budget, description=f"{self.description} ({note})" if self.description else note)

    def batch_limit(self, index: int) -> int:
        """Items per batch in bucket `index`: its max_batch, cut down by the padded-token budget."""
        b = self.buckets[index]
        return max(1, min(b.max_batch, self.token_budget // b.max_len))

    def bucket_for(self, length: int) -> int:
        """Index of the smallest bucket whose bound holds `length` tokens (clamped to the overflow)."""
        return min(bisect.bisect_left(self.bounds, length), len(self.buckets) - 1)


def default_profiles_path() -> Path:
    return Path(str(resources.files("worker.core").joinpath("profiles.toml")))


def _parse(name: str, raw: dict[str, Any], where: str) -> Profile:
    def fail(msg: str) -> ProfileError:
        return ProfileError(f"{where}: profile {name!r}: {msg}")

    rows = raw.get("buckets")
    if not isinstance(rows, list) or not rows:
        raise fail("needs a non-empty 'buckets' list")
    buckets = []
    for i, row in enumerate(rows):
        try:
            max_len, max_batch = int(row["max_len"]), int(row["max_batch"])
            opt_batch = int(row.get("opt_batch", max_batch))
        except (KeyError, TypeError, ValueError) as exc:
            raise fail(f"bucket {i} needs integer max_len and max_batch ({exc})") from None
        if max_len < 3:
            raise fail(f"bucket {i}: max_len {max_len} cannot hold [CLS] x [SEP]")
        if not 1 <= opt_batch <= max_batch:
            raise fail(f"bucket {i}: needs 1 <= opt_batch ({opt_batch}) <= max_batch ({max_batch})")
        buckets.append(Bucket(max_len, max_batch, opt_batch))
    bounds = [b.max_len for b in buckets]
    if bounds != sorted(set(bounds)):
        raise fail(f"bucket bounds must be strictly increasing, got {bounds}")
    align = raw.get("align")
    if align is not None:
        align = int(align)
        bad = [m for m in bounds if m % align]
        if bad:
            raise fail(f"bounds {bad} are not multiples of align={align}")
    budget = int(raw.get("token_budget", max(b.max_len * b.max_batch for b in buckets)))
    if budget < bounds[-1]:
        raise fail(f"token_budget {budget} cannot hold one item of the overflow bucket ({bounds[-1]} tokens)")
    pad_to = raw.get("pad_to", "bucket")
    if pad_to not in PAD_POLICIES:
        raise fail(f"pad_to must be one of {', '.join(PAD_POLICIES)}, got {pad_to!r}")
    return Profile(name, tuple(buckets), budget, pad_to, align, str(raw.get("description", "")))


def load_profiles(path: str | Path | None = None) -> dict[str, Profile]:
    path = Path(path) if path else default_profiles_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ProfileError(f"profiles file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"profiles file {path}: not valid TOML ({exc})") from None
    table = data.get("profiles")
    if not isinstance(table, dict) or not table:
        raise ProfileError(f"profiles file {path}: no [profiles.NAME] tables")
    return {name: _parse(name, raw, str(path)) for name, raw in table.items()}


def load_profile(name: str, path: str | Path | None = None, *, model_max_len: int | None = None) -> Profile:
    """The named profile; with model_max_len, its overflow bucket reaches the model's limit.

    The shipped profiles end at 256 tokens (all-MiniLM-L6-v2's limit). For a model that takes
    more (all-mpnet-base-v2: 384, e5 and bge: 512) the overflow bucket is stretched to the
    model's limit, so that nothing is truncated below what the model itself truncates at; its
    batches stay within the profile's token budget (Profile.batch_limit).
    """
    profiles = load_profiles(path)
    if name not in profiles:
        raise ProfileError(f"profiles file {path or default_profiles_path()}: no profile {name!r} "
                           f"(have: {', '.join(sorted(profiles))})")
    profile = profiles[name]
    if model_max_len is not None and profile.max_len < model_max_len:
        return _stretched(profile, model_max_len)
    return profile


def _stretched(profile: Profile, max_len: int) -> Profile:
    last = profile.buckets[-1]
    if profile.token_budget < max_len or (profile.align and max_len % profile.align):
        why = (f"its token_budget {profile.token_budget} cannot hold one" if profile.token_budget < max_len
               else f"{max_len} is not a multiple of its align={profile.align}")
        raise ProfileError(f"profile {profile.name!r}: its last bucket ends at {last.max_len} tokens, the model "
                           f"takes {max_len}, and the bucket cannot be stretched ({why}); give a profile whose "
                           "last bucket reaches the model's limit (--profiles-file)")
    opt = min(last.opt_batch, max(1, profile.token_budget // max_len))
    bucket = Bucket(max_len, max(last.max_batch, opt), opt)
    note = f"overflow bucket stretched from {last.max_len} to {max_len} tokens for the model"
    return replace(profile, buckets=profile.buckets[:-1] + (bucket,),
                   description=f"{profile.description} ({note})" if profile.description else note)
