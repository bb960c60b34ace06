"""Synthetic acceptance for benchmarking (vLLM PR #40662): a configured acceptance rate per
position replaces the p/q test, so throughput can be measured at a chosen acceptance length
with random weights. Output is NOT distributed as the target's in this mode.

Mixed traffic: with a `spread` S, request i runs at its own mean acceptance length L_i, drawn
uniformly in [L - S, L + S] from a hash of its request id (so reruns agree) and clipped to
[1, k + 1], each with the minimum-variance schedule of its own L_i. The mean over requests is L
while [L - S, L + S] lies inside [1, k + 1]; clipping moves it towards the middle.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass


def request_uniform(request_id: str, salt: str) -> float:
    """A number in [0, 1) fixed by the request id (blake2b, so every process and rerun agrees);
    `salt` keeps the draws of different settings independent."""
    digest = hashlib.blake2b(f"{salt}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


@dataclass(frozen=True, slots=True)
class SyntheticAcceptance:
    """Exactly one of `rates` (unconditional per-position rates r_1 >= r_2 >= ..., length
    num_draft_tokens) or `mean_acceptance_length` (L in [1, num_draft_tokens + 1]).

    Example: num_draft_tokens=4, mean_acceptance_length=2.5 -> rates (1, 0.5, 0, 0) -> the
    kernel's conditional rates (1, 0.5, 0, 0). With spread=1, a request whose id draws
    L_i = 3.1 gets rates (1, 1, 0.1, 0).
    """

    num_draft_tokens: int
    rates: tuple[float, ...] | None = None
    mean_acceptance_length: float | None = None
    spread: float = 0.0  # per-request L_i uniform in [L - spread, L + spread] (module docstring)

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
        if not (math.isfinite(self.spread) and self.spread >= 0.0):
            raise ValueError(f"spread must be a finite number >= 0, got {self.spread}.")
        if self.spread and self.mean_acceptance_length is None:
            raise ValueError(
                "spread needs mean_acceptance_length: it spreads each request's mean "
                f"acceptance length around it, got spread {self.spread} with rates."
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

    def describe(self) -> str:
        """For the services' warning: the rates, or the range of the per-request lengths."""
        if not self.spread:
            return f"rates {self.unconditional_rates()}"
        length = self.mean_acceptance_length
        assert length is not None
        low = max(length - self.spread, 1.0)
        high = min(length + self.spread, self.num_draft_tokens + 1.0)
        return f"per-request L uniform in [{low:g}, {high:g}] about L = {length:g}"

    def request_length(self, request_id: str | None = None) -> float:
        """L_i: the request's mean acceptance length (L itself without a spread)."""
        length = self.mean_acceptance_length
        assert length is not None
        if not self.spread:
            return length
        if request_id is None:
            raise ValueError("a synthetic acceptance spread needs each request's request_id.")
        u = request_uniform(request_id, "acceptance")
        drawn = length + self.spread * (2.0 * u - 1.0)
        return min(max(drawn, 1.0), self.num_draft_tokens + 1.0)

    def unconditional_rates(self, request_id: str | None = None) -> tuple[float, ...]:
        """r_i: probability that positions 1..i are all accepted (for this request, with a
        spread)."""
        if self.rates is not None:
            return tuple(self.rates)
        accepted = self.request_length(request_id) - 1.0
        whole = math.floor(accepted)
        rates = [1.0] * whole + [accepted - whole]
        return tuple((rates + [0.0] * self.num_draft_tokens)[: self.num_draft_tokens])

    def conditional_rates(self, request_id: str | None = None) -> tuple[float, ...]:
        """c_1 = r_1, c_i = r_i / r_{i-1} (0 after a zero): what the kernel tests per position."""
        rates = self.unconditional_rates(request_id)
        return tuple(
            rate if i == 0 else (rate / rates[i - 1] if rates[i - 1] > 0 else 0.0)
            for i, rate in enumerate(rates)
        )

    def mean_length(self, request_id: str | None = None) -> float:
        """Expected tokens committed per step: 1 + sum of unconditional rates."""
        return 1.0 + sum(self.unconditional_rates(request_id))
