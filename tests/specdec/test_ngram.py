"""Prompt-lookup proposer."""

from __future__ import annotations

import pytest

from specdec.serving.ngram import NgramConfig, propose_ngram


@pytest.mark.parametrize(
    ("tokens", "k", "config", "expected"),
    [
        ([5, 6, 7, 9, 5, 6], 3, NgramConfig(1, 2), [7, 9, 5]),  # docstring example
        ([5, 6, 7, 9, 5, 6], 1, NgramConfig(1, 2), [7]),
        ([5, 6, 7, 9, 5, 6], 0, NgramConfig(1, 2), []),
        ([1, 2, 3, 4], 3, NgramConfig(1, 3), []),  # no repeat
        ([1, 2, 8, 3, 2, 9, 1, 2], 2, NgramConfig(1, 3), [8, 3]),  # [1 2] beats the later [2]
        ([1, 2, 8, 3, 2, 9, 1, 2], 2, NgramConfig(1, 1), [9, 1]),  # only n = 1: latest 2
        ([1, 2, 8, 3, 2, 9, 1, 2], 2, NgramConfig(3, 3), []),  # [9 1 2] never seen before
        ([4, 4, 4], 5, NgramConfig(1, 2), [4]),  # match runs into the end: fewer than k
        ([7], 2, NgramConfig(1, 4), []),
        ([3, 1, 3, 2, 3], 2, NgramConfig(1, 1), [2, 3]),  # most recent earlier match wins
    ],
)
def test_propose(tokens: list[int], k: int, config: NgramConfig, expected: list[int]) -> None:
    assert propose_ngram(tokens, k, config) == expected


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="min_n=3, max_n=2"):
        NgramConfig(3, 2)
    with pytest.raises(ValueError, match="1 <= min_n"):
        NgramConfig(0, 2)


def test_long_sequence() -> None:
    tokens = list(range(4000)) * 2  # the suffix [3996 .. 3999] first occurred at 3996
    assert propose_ngram(tokens, 4, NgramConfig(1, 4)) == [0, 1, 2, 3]
