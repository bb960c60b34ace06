"""Exactness through the client API under dynamic speculation (`--dynamic-speculation`): each
step's k is chosen anew, 0 included, and a step whose asks want no drafts sends its block to the
draft without waiting for the answer (`hub_draft.DraftSide.tell`), which the next step's drafts
then build on. The client API runs in this process in front of a local pair drafting ahead
(`tests.orchestrator.local_exactness`).

The chooser is scripted here: k cycles through 0, 1, ..., the request's k, one value a step, so
that every k and the step after a k = 0 come hundreds of times in each run. The real chooser
picks from measured times, which a test cannot set; the output's distribution does not depend
on how k is picked (only on what earlier steps measured, never on the step's own tokens), only
on each step verifying the drafts it was proposed with the q they were drawn from, which is
what is tested. Sampled unseeded requests, one in flight: every committed token after the first
is mapped through its own conditional CDF given its prefix (randomized PIT) and tested by
chi-square; mutant, rejected by the same statistic: the tokens against the target at twice the
temperature. Greedy output equals target-only greedy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import ClassVar

import numpy as np
import pytest

from specdec.client import AsyncClient
from target_service import hub
from target_service.speculation import KChooser
from tests.orchestrator.local_exactness import (
    Served,
    assert_follows_target,
    draw_seeds_from,
    serving_ahead,
)
from tests.orchestrator.test_serve_exactness import Case, K
from tests.orchestrator.test_serve_exactness_ahead import _total

NEW_TOKENS = 10  # tokens 2 to 10 of each request are tested
CASE = Case("draft", temperature=0.5)


class CyclingChooser(KChooser):
    """k = 0, 1, ..., `upper`, then 0 again: one value a step, whatever was measured."""

    made: ClassVar[list[CyclingChooser]] = []

    def __init__(self, max_k: int):
        super().__init__(max_k)
        self.chosen: list[int] = []
        CyclingChooser.made.append(self)

    def choose(self, batch: int, upper: int, fixed: int = 0) -> int:
        k = len(self.chosen) % (min(upper, self.max_k) + 1)
        self.chosen.append(k)
        return max(k, min(fixed, upper))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hub, "KChooser", CyclingChooser)  # the hub builds it when Serve opens
        CyclingChooser.made.clear()
        with serving_ahead(tmp_path_factory.mktemp("dynamic"), 2,
                           target={"dynamic_speculation": True}) as served:  # fmt: skip
            yield served


@pytest.fixture(autouse=True)
def drawn_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    draw_seeds_from(monkeypatch, 8)


async def _generate(address: str, prompts: list[list[int]], **params: object) -> np.ndarray:
    """[len(prompts), NEW_TOKENS]: one request at a time."""
    params = {"proposer": "draft", **params}
    async with AsyncClient(address, timeout=300.0) as client:
        rows = []
        for prompt in prompts:
            out = await client.complete(prompt, max_tokens=NEW_TOKENS, ignore_eos=True,
                                        num_draft_tokens=K, **params)  # fmt: skip
            assert out.finish_reason == "length" and len(out.token_ids) == NEW_TOKENS, out
            rows.append(out.token_ids)
        return np.array(rows)


def _k_counts(served: Served) -> dict[float, float]:
    """The metric's cumulative counts: steps with k <= bound, per bound."""
    out: dict[float, float] = {}
    for family in served.orchestrator.metrics.registry.collect():
        for s in family.samples:
            if s.name == "specdec:step_num_draft_tokens_bucket":
                bound = float(s.labels["le"])
                out[bound] = out.get(bound, 0.0) + s.value
    return out


def test_every_token_follows_target_with_k_chosen_per_step(served: Served) -> None:
    before = _k_counts(served)
    hits = _total(served.orchestrator, "specdec:draft_ahead_hits_total")
    tokens = asyncio.run(_generate(served.address, [list(CASE.prompt)] * 150,
                                   temperature=CASE.temperature))  # fmt: skip
    after = _k_counts(served)
    cumulative = [after[b] - before.get(b, 0.0) for b in (0.0, 1.0, 2.0, 3.0, 4.0)]
    per_k = [cumulative[0], *np.diff(cumulative).tolist()]
    print(f"\nsteps by k = 0..{K}: {per_k}")
    assert all(n >= 50 for n in per_k), f"each k must come 50 times or more: {per_k}"
    [chooser] = CyclingChooser.made
    assert set(chooser.chosen) == set(range(K + 1)), "the scripted chooser served the steps"
    hits = _total(served.orchestrator, "specdec:draft_ahead_hits_total") - hits
    print(f"draft-ahead hits in this run: {hits:.0f} (the steps at every k are what is tested)")
    assert_follows_target(served, CASE, tokens, seed=19)


def test_greedy_equals_target_only_with_k_chosen_per_step(served: Served) -> None:
    prompts = [[*CASE.prompt, 3 + i] for i in range(24)]
    drafted = asyncio.run(_generate(served.address, prompts, temperature=0.0))
    alone = asyncio.run(_generate(served.address, prompts, temperature=0.0, proposer="off"))
    assert len({tuple(row) for row in alone.tolist()}) > 12, "too few distinct outputs"
    assert np.array_equal(drafted, alone)
