"""BENCHMARKING ONLY: numbers drawn from a hash of a request's id, for the synthetic acceptance
and hit rates of benchmarks on random weights (`target_service.synthetic`, `draft_service.ahead`):
the same for a request at every step and in every rerun, and independent of the batch."""

from __future__ import annotations

import hashlib

SPREAD_TOLERANCE = 1e-9  # a spread reaching a range's end by rounding (1.4 - 0.4) is in it


def key_uniform(text: str) -> float:
    """A number in [0, 1) from a hash of `text`."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def spread_around(
    mean: float, spread: float, key: str, salt: str, low: float, high: float
) -> float:
    """`mean`, or with `spread` > 0 a value uniform in [mean - spread, mean + spread] by the
    hash of `key` (over many keys the mean stays `mean`), kept in [low, high]."""
    if spread == 0.0:
        return mean
    return min(high, max(low, mean + spread * (2.0 * key_uniform(f"{salt}:{key}") - 1.0)))


def spread_fits(mean: float, spread: float, low: float, high: float) -> bool:
    """Whether [mean - spread, mean + spread] lies in [low, high], up to SPREAD_TOLERANCE."""
    return mean - spread >= low - SPREAD_TOLERANCE and mean + spread <= high + SPREAD_TOLERANCE
