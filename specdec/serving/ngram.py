"""Prompt-lookup drafts (Saxena 2023, "prompt lookup decoding"; vLLM's `ngram` proposer).

No model and no q: the last n tokens of the sequence are looked up earlier in the same
sequence, and the tokens that followed the most recent earlier match are proposed. n runs from
max_n down to min_n, so the longest matching suffix wins. The target accepts such a draft x with
probability p(x) (q one-hot at x; docs/design.md, "Exactness"), so the output stays exact.

Example, tokens [5 6 7 9 5 6], max_n 2, k 3: the suffix [5 6] occurred at 0, followed by
[7 9 5]; proposal [7 9 5].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NgramConfig:
    """Lengths of the suffix looked up, longest first."""

    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"ngram lengths need 1 <= min_n <= max_n, got min_n={self.min_n}, "
                f"max_n={self.max_n}."
            )


def propose_ngram(tokens: Sequence[int], num_draft_tokens: int, config: NgramConfig) -> list[int]:
    """Up to `num_draft_tokens` tokens that followed the latest earlier match of a suffix."""
    if num_draft_tokens <= 0:
        return []
    seq = list(tokens)
    length = len(seq)
    for n in range(min(config.max_n, length - 1), config.min_n - 1, -1):
        suffix = seq[length - n :]
        first = suffix[0]
        # Latest start i < length - n whose n tokens equal the suffix.
        for i in range(length - n - 1, -1, -1):
            if seq[i] == first and seq[i : i + n] == suffix:
                return seq[i + n : i + n + num_draft_tokens]
    return []
