"""Exactness of sampled output through the client API with draft-ahead's backup proposals
(`draft_service.ahead.BackupChoice`, here `draft_ahead_backup="always"`, pushes off, so that
every backup is the draft's own choice): an ask that had chains
drafted ahead, none for its verdict, gets no drafts that step (the target samples its one token
from p) and its drafts for the next step are made behind the verify, in the pass that catches
it up (chains of k - 1 drafts spawned from that catch-up, `draft_service.drafting.Spawn`: at
least 50 asks answered from them). The client API
(`orchestrator.server.Orchestrator`) runs in this process in front of a local pair
(`tests.orchestrator.inprocess`); many unseeded sampled requests (a seeded one is never backed
up) are sent concurrently by `AsyncClient`; the seeds the server draws for them come from a
seeded generator here, so that a run is the same every time.

Every committed token after the first is mapped through its own conditional CDF given the
tokens before it (randomized PIT, `test_serve_exactness.pit`) and tested by chi-square on
equal-width bins, in a run that made at least 50 backup proposals and answered at least 50 asks
from chains. Mutant, rejected by the same statistic: the tokens against the target at another
temperature. The tokens committed by steps that verified a chain drafted ahead (which asks were
answered from chains is recorded in this process, `local_exactness.ChainAsks`) pass the same
test alone; code mutants, rejected by it: every draft the pass ahead makes sent with q at a
quarter or four times the temperature it was drawn at. Greedy output with backups equals
target-only greedy output, token for token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from specdec.client import AsyncClient, GenerateOutput
from tests.orchestrator.local_exactness import (
    ChainAsks,
    Served,
    draw_seeds_from,
    pit_against_target,
    q_of_another_temperature_ahead,
    serving_ahead,
)
from tests.orchestrator.test_serve_exactness import (
    REJECT_BELOW,
    Case,
    K,
)
from tests.orchestrator.test_serve_exactness_ahead import _total

MAX_REQUESTS = 16
NEW_TOKENS = 12  # tokens 2 to 12 of each request are tested
CASE = Case("draft", temperature=0.5)
COUNTERS = ("specdec:draft_ahead_hits_total", "specdec:draft_ahead_misses_total",
            "specdec:draft_ahead_backups_total")  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # F = 6: a backup's spawned chains hit often enough for 50 in one run (F = 2: 16 in 400
    # requests on this pair). Pushes off: every backup is the draft's own choice, and every
    # hit an ask answered from a chain (the hub backing up the misses of a push is
    # test_serve_exactness_push's)
    with serving_ahead(tmp_path_factory.mktemp("backup"), MAX_REQUESTS,
                       target={"draft_push_chains": False}, draft_ahead_backup="always",
                       draft_ahead=6) as served:  # fmt: skip
        served.chain_asks = ChainAsks(served)
        yield served


async def _generate(
    address: str, prompts: list[list[int]], temperature: float, proposer: str
) -> list[GenerateOutput]:
    """A request a prompt, unseeded, MAX_REQUESTS in flight: each one's output."""
    limit = asyncio.Semaphore(MAX_REQUESTS)
    async with AsyncClient(address, timeout=300.0) as client:

        async def one(i: int) -> GenerateOutput:
            async with limit:
                out = await client.complete(
                    prompts[i], max_tokens=NEW_TOKENS, ignore_eos=True,
                    temperature=temperature, proposer=proposer, num_draft_tokens=K,
                )  # fmt: skip
            assert out.finish_reason == "length" and len(out.token_ids) == NEW_TOKENS, out
            return out

        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def _run(served: Served, prompts: list[list[int]], temperature: float, proposer: str = "draft"
         ) -> tuple[np.ndarray, list[float], np.ndarray]:  # fmt: skip
    """The tokens of the requests, the draft-ahead hits, misses and backups they made, and
    which tokens steps verifying a chain drafted ahead committed."""
    before = [_total(served.orchestrator, name) for name in COUNTERS]
    outputs = asyncio.run(_generate(served.address, prompts, temperature, proposer))
    counts = [_total(served.orchestrator, n) - b for n, b in zip(COUNTERS, before, strict=True)]
    from_chains = served.chain_asks.mask(outputs, NEW_TOKENS)
    print(f"\n{len(prompts)} requests at T={temperature}: draft-ahead {counts[0]:.0f} hits / "
          f"{counts[1]:.0f} misses, {counts[2]:.0f} backups; {from_chains[:, 1:].sum()} tokens "
          "after the first from steps that verified a chain")  # fmt: skip
    return np.array([o.token_ids for o in outputs]), counts, from_chains


def _pit_pvalue(
    served: Served, tokens: np.ndarray, temperature: float, only: np.ndarray | None = None
) -> float:
    """Chi-square p-value of the PIT of every token after the first (or those `only` marks)
    against the target at `temperature`."""
    return pit_against_target(served, CASE, tokens, temperature, seed=17, only=only)


@pytest.fixture(autouse=True)
def drawn_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    draw_seeds_from(monkeypatch, 5)


def test_every_token_follows_target_with_backups(served: Served) -> None:
    short = served.pair.draft_engine.ahead_short_hits
    tokens, (hits, misses, backups), from_chains = _run(
        served, [list(CASE.prompt)] * 1000, CASE.temperature
    )
    short = served.pair.draft_engine.ahead_short_hits - short
    print(f"{short} asks answered from chains spawned in a backup's catch-up (k - 1 drafts)")
    assert backups >= 50, f"only {backups:.0f} backup proposals"
    assert hits >= 50, f"draft-ahead answered only {hits:.0f} asks from chains"
    assert short >= 50, f"only {short} asks answered from spawned chains"
    assert backups <= misses, "only misses are backed up"
    pushed = _total(served.orchestrator, "specdec:draft_ahead_push_backups_total")
    assert pushed == 0, "pushes are off: no backup is the hub's"
    exact = _pit_pvalue(served, tokens, CASE.temperature)
    print(f"PIT of {tokens[:, 1:].size} tokens: p-value {exact:.3g}")
    assert exact > REJECT_BELOW, exact
    wrong = _pit_pvalue(served, tokens, CASE.temperature * 2)
    print(f"against the target at temperature {CASE.temperature * 2:g}: p-value {wrong:.3g}")
    assert wrong < REJECT_BELOW, wrong
    # the tokens of the steps that verified a chain drafted ahead, alone
    assert from_chains[:, 1:].sum() >= 200, "too few tokens from chains"
    alone = _pit_pvalue(served, tokens, CASE.temperature, only=from_chains)
    print(f"PIT of the {from_chains[:, 1:].sum()} tokens from chains: p-value {alone:.3g}")
    assert alone > REJECT_BELOW, alone


@pytest.mark.parametrize("factor", [0.25, 4.0], ids=["q-sharper", "q-flatter"])
def test_chains_sent_with_a_q_they_were_not_drawn_from_are_rejected(
    served: Served, monkeypatch: pytest.MonkeyPatch, factor: float
) -> None:
    """The mutant: every draft the pass ahead makes (chains, a backup's catch-up, the chains
    it spawns) is sent with q at another temperature than it was drawn at. The PIT of the
    tokens from chains rejects it; drafts asked for and made after the verdict are untouched."""
    q_of_another_temperature_ahead(monkeypatch, served, factor)
    tokens, (hits, _, _), from_chains = _run(served, [list(CASE.prompt)] * 800, CASE.temperature)
    assert hits >= 50, f"draft-ahead answered only {hits:.0f} asks from chains"
    wrong = _pit_pvalue(served, tokens, CASE.temperature, only=from_chains)
    print(f"mutant: PIT of the {from_chains[:, 1:].sum()} tokens from chains: p-value {wrong:.3g}")
    assert wrong < REJECT_BELOW, wrong


def test_greedy_output_with_backups_is_target_only_greedy(served: Served) -> None:
    prompts = [[*CASE.prompt, 3 + i] for i in range(96)]  # 96 different continuations
    drafted, (_, _, backups), _ = _run(served, prompts, 0.0)
    alone, _, _ = _run(served, prompts, 0.0, "off")
    assert len({tuple(row) for row in alone.tolist()}) > 48, "too few distinct outputs"
    assert backups >= 3, f"only {backups:.0f} backup proposals"  # greedy seldom misses
    assert np.array_equal(drafted, alone)
