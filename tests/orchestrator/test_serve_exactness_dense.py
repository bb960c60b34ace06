"""Exactness of sampled output through the client API in lock-step with dense q (the draft sends
its whole distribution, `q_form="dense"`; the served default is sparse, which
`test_serve_exactness` covers), with a code mutant. The client API runs in this process in
front of a local pair (`tests.orchestrator.inprocess`), so that the mutant can replace the
draft's sampling; unseeded requests, their seeds drawn here from a seeded generator.

Every committed token after the first is mapped through its own conditional CDF given its
prefix (randomized PIT) and tested by chi-square, in a run where drafts were accepted and
rejected many times. Code mutant, rejected by the same statistic: a draft that draws at the
request's temperature and sends q at four times it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from specdec.client import AsyncClient
from tests.orchestrator.local_exactness import (
    Served,
    draw_seeds_from,
    patch_draft_sampling,
    pit_against_target,
    q_at_another_temperature,
    serving_ahead,
)
from tests.orchestrator.test_serve_exactness import REJECT_BELOW, Case, K

MAX_REQUESTS = 16
NEW_TOKENS = 8  # tokens 2 to 8 of each request are tested
CASE = Case("draft", temperature=0.7)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving_ahead(tmp_path_factory.mktemp("dense"), MAX_REQUESTS, draft_ahead=0,
                       q_form="dense") as served:  # fmt: skip
        assert served.pair.draft_config.q_form == "dense"
        yield served


@pytest.fixture(autouse=True)
def drawn_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    draw_seeds_from(monkeypatch, 3)


def _run(served: Served, n: int) -> tuple[np.ndarray, int, int]:
    """[n, NEW_TOKENS] tokens of n unseeded requests, MAX_REQUESTS in flight; and the drafts
    accepted and the steps that rejected one, over every step."""
    accepted = rejected = 0

    async def generate() -> list[tuple[int, ...]]:
        nonlocal accepted, rejected
        limit = asyncio.Semaphore(MAX_REQUESTS)
        async with AsyncClient(served.address, timeout=300.0) as client:

            async def one() -> tuple[int, ...]:
                nonlocal accepted, rejected
                async with limit:
                    out = await client.complete(
                        list(CASE.prompt), max_tokens=NEW_TOKENS, ignore_eos=True,
                        temperature=CASE.temperature, proposer="draft", num_draft_tokens=K,
                    )  # fmt: skip
                assert out.finish_reason == "length" and len(out.token_ids) == NEW_TOKENS, out
                for s in out.steps:
                    accepted += s.num_accepted
                    rejected += s.num_accepted < s.num_draft_tokens
                return out.token_ids

            return list(await asyncio.gather(*(one() for _ in range(n))))

    tokens = np.array(asyncio.run(generate()))
    print(f"\n{n} requests at T={CASE.temperature}: {accepted} drafts accepted, {rejected} steps "
          "rejected one")  # fmt: skip
    return tokens, accepted, rejected


def test_every_token_follows_target_with_dense_q(served: Served) -> None:
    tokens, accepted, rejected = _run(served, 600)
    assert accepted >= 200 and rejected >= 200, (accepted, rejected)
    exact = pit_against_target(served, CASE, tokens, CASE.temperature, seed=23)
    print(f"PIT of {tokens[:, 1:].size} tokens: p-value {exact:.3g}")
    assert exact > REJECT_BELOW, exact


def test_a_dense_q_other_than_the_one_drawn_from_is_rejected(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    patch_draft_sampling(monkeypatch, q_at_another_temperature(4.0))
    tokens, _, _ = _run(served, 300)
    wrong = pit_against_target(served, CASE, tokens, CASE.temperature, seed=23)
    print(f"mutant: PIT of {tokens[:, 1:].size} tokens: p-value {wrong:.3g}")
    assert wrong < REJECT_BELOW, wrong
