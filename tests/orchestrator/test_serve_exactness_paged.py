"""Exactness through the client API with paged KV caches (`kv_block_size`) and prefix caching
on both services, the draft drafting ahead: its hypotheses fork the request's blocks, and every
request's prompt after the first comes from the target's and the draft's prefix caches.

Sampled: the randomized PIT of every committed token after the first against the target, by
chi-square, with the mutant (the target at twice the temperature) rejected by the same
statistic. Greedy: token for token the output of a fixed-slot runner holding the whole target.
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

BLOCK = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("paged")
    # 40 blocks of 4 positions: a few requests' worth, however many hypotheses fork them
    with serving_ahead(tmp, MAX_REQUESTS, kv={"kv_block_size": BLOCK, "kv_blocks": 160}) as served:
        yield served


@pytest.fixture(autouse=True)
def drawn_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    draw_seeds_from(monkeypatch, 13)


def test_every_token_follows_the_target(served: Served) -> None:
    assert served.pair.target_engine.runner.config.kv_block_size == BLOCK
    tokens = _generate(served, [list(CASE.prompt)] * 240, CASE.temperature)
    assert_follows_target(served, CASE, tokens, seed=29)
    for role, runner in (("target", served.pair.target_engine.runner),
                         ("draft", served.pair.draft_engine.runner)):  # fmt: skip
        stats = runner.prefix_cache_stats
        assert stats is not None and stats.hit_tokens > 0, (role, stats)
        print(f"{role}: {stats.hit_tokens} of {stats.queried_tokens} prompt tokens from the cache")
    # the target's counts reach /metrics by its ServeStep messages (the last step's after)
    registry = served.orchestrator.metrics.registry
    pair = {"model_pair": served.target_dir.resolve().name}
    hits = registry.get_sample_value("specdec:prefix_cache_hits_total", pair)
    queries = registry.get_sample_value("specdec:prefix_cache_queries_total", pair)
    target = served.pair.target_engine.runner.prefix_cache_stats
    assert 0 < hits <= target.hit_tokens and 0 < queries <= target.queried_tokens, (hits, queries)


def test_greedy_output_is_the_fixed_slot_runners(served: Served) -> None:
    prompts = [[*CASE.prompt, 3 + i] for i in range(32)]
    paged = _generate(served, prompts, 0.0)
    alone = _greedy_alone(served.target_dir, prompts)
    assert len({tuple(row) for row in alone.tolist()}) > 16, "too few distinct outputs"
    assert np.array_equal(paged, alone)
