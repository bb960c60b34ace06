"""Synthetic acceptance for benchmarking (vLLM PR #40662): a configured acceptance rate per
position replaces the p/q test, so throughput can be measured at a chosen acceptance length
with random weights. Output is NOT distributed as the target's in this mode.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specdec.synthetic_keys import spread_around, spread_fits


@dataclass(frozen=True, slots=True)
class SyntheticAcceptance:
    """Exactly one of `rates` (unconditional per-position rates r_1 >= r_2 >= ..., length
    num_draft_tokens) or `mean_acceptance_length` (L in [1, num_draft_tokens + 1]).

    Example: num_draft_tokens=4, mean_acceptance_length=2.5 -> rates (1, 0.5, 0, 0) -> the
    kernel's conditional rates (1, 0.5, 0, 0).
    """

    num_draft_tokens: int
    rates: tuple[float, ...] | None = None
    mean_acceptance_length: float | None = None
    # mixed traffic: each request's own length, uniform in [L - spread, L + spread] by a hash
    # of its id (the batch's mean stays L); 0: every request at L
    length_spread: float = 0.0

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"num_draft_tokens must be an integer >= 1, got {k!r}.")
        if (self.rates is None) == (self.mean_acceptance_length is None):
            raise ValueError(
                "synthetic acceptance takes exactly one of rates and mean_acceptance_length."
            )
        if self.rates is not None:
            self._check_rates(self.rates)
        else:
            length = self.mean_acceptance_length
            assert length is not None
            if not (math.isfinite(length) and 1.0 <= length <= k + 1):
                raise ValueError(
                    f"mean_acceptance_length must be in [1, {k + 1}] "
                    f"(1 + num_draft_tokens), got {length}."
                )
        spread = self.length_spread
        if not (math.isfinite(spread) and spread >= 0.0):
            raise ValueError(f"length_spread must be >= 0, got {spread}.")
        if spread > 0.0:
            length = self.mean_acceptance_length
            if length is None:
                raise ValueError("length_spread needs mean_acceptance_length (not rates).")
            if not spread_fits(length, spread, 1.0, k + 1.0):
                raise ValueError(
                    f"length_spread {spread} around mean_acceptance_length {length} must stay "
                    f"in [1, {k + 1}] (1 + num_draft_tokens)."
                )

    def _check_rates(self, rates: tuple[float, ...]) -> None:
        if len(rates) != self.num_draft_tokens:
            raise ValueError(
                f"rates must have num_draft_tokens = {self.num_draft_tokens} entries, "
                f"got {len(rates)}."
            )
        for i, rate in enumerate(rates):
            if not (math.isfinite(rate) and 0.0 <= rate <= 1.0):
                raise ValueError(f"rates[{i}] must be in [0, 1], got {rate}.")
            if i and rate > rates[i - 1]:
                raise ValueError(
                    f"rates must be non-increasing: rates[{i}] = {rate} > "
                    f"rates[{i - 1}] = {rates[i - 1]}."
                )

    def unconditional_rates(self) -> tuple[float, ...]:
        """r_i: probability that positions 1..i are all accepted."""
        if self.rates is not None:
            return tuple(self.rates)
        assert self.mean_acceptance_length is not None
        accepted = self.mean_acceptance_length - 1.0
        whole = math.floor(accepted)
        rates = [1.0] * whole + [accepted - whole]
        return tuple((rates + [0.0] * self.num_draft_tokens)[: self.num_draft_tokens])

    def conditional_rates(self) -> tuple[float, ...]:
        """c_1 = r_1, c_i = r_i / r_{i-1} (0 after a zero): what the kernel tests per position."""
        rates = self.unconditional_rates()
        return tuple(
            rate if i == 0 else (rate / rates[i - 1] if rates[i - 1] > 0 else 0.0)
            for i, rate in enumerate(rates)
        )

    def mean_length(self) -> float:
        """Expected tokens committed per step: 1 + sum of unconditional rates."""
        return 1.0 + sum(self.unconditional_rates())

    def length_for(self, key: str) -> float:
        """The mean acceptance length of the request `key` (its id): L, or with length_spread
        uniform in [L - spread, L + spread] by a hash of the key, so reruns agree."""
        k = self.num_draft_tokens
        return spread_around(self.mean_length(), self.length_spread, key, "acceptance", 1.0, k + 1)

    def conditional_rates_for(self, keys: Sequence[str] | None, width: int) -> np.ndarray:
        """[len(keys), width] float32: each request's conditional rates (the first `width`
        positions); one row of the shared rates if `keys` is None or there is no spread."""
        if keys is None or self.length_spread == 0.0:
            row = np.asarray(self.conditional_rates()[:width], dtype=np.float32)
            return np.tile(row, (1 if keys is None else len(keys), 1))
        rows = [_conditional_rates(self.num_draft_tokens, self.length_for(key)) for key in keys]
        return np.asarray([r[:width] for r in rows], dtype=np.float32).reshape(len(keys), width)


@functools.lru_cache(maxsize=65536)
def _conditional_rates(k: int, length: float) -> tuple[float, ...]:
    """A request's conditional rates, kept: a mixed-traffic batch asks for them every step."""
    return SyntheticAcceptance(k, mean_acceptance_length=length).conditional_rates()
