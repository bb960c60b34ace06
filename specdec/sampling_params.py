"""A request's sampling parameters, shared by the draft and target services."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.limits import MAX_SEED, MAX_TOP_K

MAX_TEMPERATURE = 100.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 mean no truncation.

    The target distribution p is softmax(logits / temperature), then restricted to the top_k
    largest logits, then to the top_p nucleus (both keep ties at the boundary), renormalised.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy), "
                f"got {self.temperature}."
            )
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(
                f"top_k must be in [0, {MAX_TOP_K}] (0 disables it), got {self.top_k}."
            )
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}.")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
