"""Exactness of sampled output through the client API with draft-ahead and Saguaro sampling on
(`draft_service.sampling`): the draft samples from q' (its F + 1 most likely tokens scaled by
C) and sends q', so the verdict after a rejection more often falls on a token it drafted a chain
for. The client API (`orchestrator.server.Orchestrator`) runs in this process in front of a
local pair (`tests.orchestrator.inprocess`), so that the mutants can replace the draft's
sampling; many seeded requests are sent concurrently by `AsyncClient`.

Every committed token after the first is mapped through its own conditional CDF given the
tokens before it (randomized PIT, `test_serve_exactness.pit`) and tested by chi-square on
equal-width bins, in a run that answered at least 50 asks from chains drafted ahead. Mutants,
each rejected by the same statistic: a draft that samples from q' but sends the unscaled q, and
one that samples from q but sends q'. Greedy output with the option on equals target-only
greedy output, token for token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest

from draft_service.sampling import DraftSample, sample_draft
from specdec.client import AsyncClient
from tests.orchestrator.local_exactness import (
    Served,
    patch_draft_sampling,
    pit_against_target,
    serving_ahead,
)
from tests.orchestrator.test_serve_exactness import (
    REJECT_BELOW,
    Case,
    K,
)
from tests.orchestrator.test_serve_exactness_ahead import _total

SCALE = 0.25  # Saguaro's C: the F + 1 = 3 tokens draft-ahead guesses get a quarter of their q
MAX_REQUESTS = 32
NEW_TOKENS = 8  # tokens 2 to 8 of each request are tested
CASE = Case("draft", temperature=0.7)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving_ahead(tmp_path_factory.mktemp("saguaro"), MAX_REQUESTS,
                       saguaro_scale=SCALE) as served:  # fmt: skip
        yield served


async def _generate(
    address: str, prompts: list[list[int]], temperature: float, proposer: str
) -> np.ndarray:
    """[len(prompts), NEW_TOKENS]: a request a prompt, seeds 30_000 + i, 2 * MAX_REQUESTS in
    flight."""
    limit = asyncio.Semaphore(2 * MAX_REQUESTS)
    async with AsyncClient(address, timeout=300.0) as client:

        async def one(i: int) -> tuple[int, ...]:
            async with limit:
                out = await client.complete(
                    prompts[i], max_tokens=NEW_TOKENS, ignore_eos=True,
                    temperature=temperature, seed=30_000 + i, proposer=proposer,
                    num_draft_tokens=K,
                )  # fmt: skip
            assert out.finish_reason == "length" and len(out.token_ids) == NEW_TOKENS, out
            return out.token_ids

        return np.array(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def _run(served: Served, n: int) -> tuple[np.ndarray, float, float]:
    """The tokens of n sampled requests, and the asks answered from chains and not."""
    names = ("specdec:draft_ahead_hits_total", "specdec:draft_ahead_misses_total")
    before = [_total(served.orchestrator, name) for name in names]
    prompts = [list(CASE.prompt)] * n
    tokens = asyncio.run(_generate(served.address, prompts, CASE.temperature, "draft"))
    hits, misses = (
        _total(served.orchestrator, name) - b for name, b in zip(names, before, strict=True)
    )
    print(f"\n{n} requests at T={CASE.temperature}: draft-ahead {hits:.0f} hits / "
          f"{misses:.0f} misses")  # fmt: skip
    return tokens, hits, misses


def _pit_pvalue(served: Served, tokens: np.ndarray) -> float:
    """Chi-square p-value of the PIT of every token after the first against the target."""
    return pit_against_target(served, CASE, tokens, CASE.temperature, seed=13)


def _mutant(draw_scaled: bool) -> Callable[..., DraftSample]:
    """The draft's sampling with q and the draw disagreeing: the tokens drawn from q' and the
    unscaled q sent (draw_scaled), or the tokens drawn from q and q' sent."""

    def sample(*args: object, **kwargs: object) -> DraftSample:
        scaled = sample_draft(*args, **kwargs)  # type: ignore[arg-type]
        plain = sample_draft(*args[:7])  # type: ignore[arg-type]
        drawn, sent = (scaled, plain) if draw_scaled else (plain, scaled)
        return replace(sent, token_ids=drawn.token_ids)

    return sample


def test_every_token_follows_target_with_saguaro(served: Served) -> None:
    tokens, hits, _ = _run(served, 600)
    assert hits >= 50, f"draft-ahead answered only {hits:.0f} asks from chains"
    exact = _pit_pvalue(served, tokens)
    print(f"PIT of {tokens[:, 1:].size} tokens: p-value {exact:.3g}")
    assert exact > REJECT_BELOW, exact


@pytest.mark.parametrize("draw_scaled", [True, False], ids=["draws-q'-sends-q", "draws-q-sends-q'"])
def test_a_q_other_than_the_one_drawn_from_is_rejected(
    served: Served, monkeypatch: pytest.MonkeyPatch, draw_scaled: bool
) -> None:
    patch_draft_sampling(monkeypatch, _mutant(draw_scaled))
    # (the mutant's every proposal pairs its draws with the wrong q, chain or not; one that
    # sends the unscaled q gets few hits, since the residual no longer falls on the guesses)
    tokens, _, _ = _run(served, 300)
    wrong = _pit_pvalue(served, tokens)
    print(f"mutant PIT of {tokens[:, 1:].size} tokens: p-value {wrong:.3g}")
    assert wrong < REJECT_BELOW, wrong


def test_greedy_output_is_target_only_greedy(served: Served) -> None:
    """Rounds of 64 prompts (64 different continuations each) until at least 50 greedy asks
    were answered from chains, at most 4: how many a round gets depends on the CPU's load (a
    request runs at k = 0 until the draft has admitted it; one CI run got 44 from one round).
    Every round's output equals target-only greedy."""
    hits, rounds = 0.0, 0
    while hits < 50 and rounds < 4:
        prompts = [[*CASE.prompt, 3 + i, 5 + rounds] for i in range(64)]
        before = _total(served.orchestrator, "specdec:draft_ahead_hits_total")
        drafted = asyncio.run(_generate(served.address, prompts, 0.0, "draft"))
        hits += _total(served.orchestrator, "specdec:draft_ahead_hits_total") - before
        alone = asyncio.run(_generate(served.address, prompts, 0.0, "off"))
        assert len({tuple(row) for row in alone.tolist()}) > 32, "too few distinct outputs"
        assert np.array_equal(drafted, alone), f"round {rounds}"
        rounds += 1
    assert hits >= 50, f"draft-ahead answered only {hits:.0f} greedy asks from chains"
