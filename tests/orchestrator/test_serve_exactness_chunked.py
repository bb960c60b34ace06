"""Exactness through the client API with chunked prefill on the target (`prefill_chunk_tokens`):
every prompt is prefilled two tokens at a time between the steps of the requests already running,
while the draft drafts ahead.

Sampled: the randomized PIT of every committed token after the first against the target, by
chi-square, with the mutant (the target at twice the temperature) rejected by the same
statistic. Greedy: token for token the output of a runner holding the whole target.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.orchestrator.local_exactness import (
    Served,
    assert_follows_target,
    draw_seeds_from,
    serving_ahead,
)
from tests.orchestrator.test_serve_exactness_tp import CASE, MAX_REQUESTS, _generate, _greedy_alone

CHUNK = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("chunked")
    with serving_ahead(tmp, MAX_REQUESTS, target={"prefill_chunk_tokens": CHUNK}) as served:
        yield served


@pytest.fixture(autouse=True)
def drawn_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    draw_seeds_from(monkeypatch, 17)


@pytest.fixture
def chunks(served: Served, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The request ids of every prefill chunk the target ran."""
    engine, seen = served.pair.target_engine, []
    real = engine.prefill_chunk

    def counted(rid: str, budget: int) -> object:
        seen.append(rid)
        return real(rid, budget)

    monkeypatch.setattr(engine, "prefill_chunk", counted)
    return seen


def test_every_token_follows_the_target(served: Served, chunks: list[str]) -> None:
    tokens = _generate(served, [list(CASE.prompt)] * 240, CASE.temperature)
    per_prompt = -(-len(CASE.prompt) // CHUNK)
    assert len(chunks) == 240 * per_prompt, "every prompt in chunks of CHUNK tokens"
    assert_follows_target(served, CASE, tokens, seed=31)


def test_greedy_output_is_the_whole_prefills(served: Served, chunks: list[str]) -> None:
    prompts = [[*CASE.prompt, 3 + i] for i in range(32)]
    chunked = _generate(served, prompts, 0.0)
    assert len(chunks) == 32 * -(-(len(CASE.prompt) + 1) // CHUNK)
    alone = _greedy_alone(served.target_dir, prompts)
    assert len({tuple(row) for row in alone.tolist()}) > 16, "too few distinct outputs"
    assert np.array_equal(chunked, alone)
