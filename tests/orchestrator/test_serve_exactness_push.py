"""Exactness through the client API with chains pushed before the verdict
(`TargetConfig.draft_push_chains`, here with `draft_push_always`): after its answer and its
pass ahead, the draft pushes every chain it drafted with the verdict each assumed, and a step
whose every ask finds its verdict's chain is verified from them without asking
(`hub_draft.DraftSide.from_push`).
The client API runs in this process in front of a local pair (`tests.orchestrator.inprocess`).

One request in flight at a time, so that every hit is a step served from a push: sampled
unseeded requests (their seeds drawn here from a seeded generator) at a sharp temperature, where
the draft's guesses often hold the verdict. Every committed token after the first is mapped
through its own conditional CDF given its prefix (randomized PIT) and tested by chi-square, in a
run that answered at least 50 asks from pushes; mutant, rejected by the same statistic: the
tokens against the target at another temperature. Greedy output with pushes equals target-only
greedy, and seeded sampled output is the same with pushes on and off.

Partial pushes (a step's misses of the pushed chains backed up by the hub while its hits take
their chains, `draft_ahead_backup` "always", with the fan-out spread): the same PIT, and seeded
requests in the same batches keep the output they get alone through a pair without pushes
(mutant tried: the hub backing up a seeded request's miss too; that test fails).

Code mutants on the pushed path (`hub_draft._from_push`): q's rows reversed is refused by the
target's check of q (a draft token of probability 0); q cubed and renormalised is caught by the
seeded test (other tokens than with pushes off), and by the PIT of the tokens that steps
verifying a pushed chain committed, alone (`local_exactness.ChainAsks`), which this module runs
(the PIT of the whole output missed it: p = 0.069 over 300 requests, the distortion reaching
only the 141 pushed asks among 2,700 tokens).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from specdec.client import AsyncClient, GenerateOutput
from specdec.serving.blocks import DenseQ, SparseQ
from target_service import hub_draft
from tests.orchestrator.local_exactness import (
    ChainAsks,
    Served,
    draw_seeds_from,
    pit_against_target,
    serving_ahead,
)
from tests.orchestrator.test_serve_exactness import REJECT_BELOW, Case, K
from tests.orchestrator.test_serve_exactness_ahead import _total

NEW_TOKENS = 10  # tokens 2 to 10 of each request are tested
CASE = Case("draft", temperature=0.3)
COUNTERS = ("specdec:draft_ahead_hits_total", "specdec:draft_ahead_misses_total",
            "specdec:draft_ahead_pushed_total")  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # a push with every block: the hub's choice by measured waits could ask instead
    with serving_ahead(tmp_path_factory.mktemp("push"), 4,
                       target={"draft_push_always": True}) as served:  # fmt: skip
        served.chain_asks = ChainAsks(served)
        yield served


async def _generate(
    address: str, prompts: list[list[int]], in_flight: int, **params: object
) -> list[GenerateOutput]:
    """A request a prompt, `in_flight` at a time: each one's output."""
    limit = asyncio.Semaphore(in_flight)
    async with AsyncClient(address, timeout=300.0) as client:

        async def one(i: int) -> GenerateOutput:
            async with limit:
                out = await client.complete(
                    prompts[i], max_tokens=NEW_TOKENS, ignore_eos=True, num_draft_tokens=K,
                    **{k: v(i) if callable(v) else v for k, v in params.items()},
                )  # fmt: skip
            assert out.finish_reason == "length" and len(out.token_ids) == NEW_TOKENS, out
            return out

        return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def _run(served: Served, prompts: list[list[int]], in_flight: int, **params: object
         ) -> tuple[np.ndarray, list[float], np.ndarray | None]:  # fmt: skip
    """The requests' tokens, the draft-ahead hits, misses and pushed hits they made, and where
    the pair records its chain asks, which tokens steps that verified a chain committed."""
    before = [_total(served.orchestrator, name) for name in COUNTERS]
    outputs = asyncio.run(_generate(served.address, prompts, in_flight, **params))
    counts = [_total(served.orchestrator, n) - b for n, b in zip(COUNTERS, before, strict=True)]
    print(f"\n{len(prompts)} requests, {in_flight} in flight: draft-ahead {counts[0]:.0f} hits "
          f"({counts[2]:.0f} pushed) / {counts[1]:.0f} misses")  # fmt: skip
    chains = served.chain_asks
    from_chains = None if chains is None else chains.mask(outputs, NEW_TOKENS)
    return np.array([o.token_ids for o in outputs]), counts, from_chains


@pytest.fixture(autouse=True)
def drawn_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    # (with 7 here the PIT of seed 19 gave p = 0.00097, and 0.47 and 0.38 with seeds 23 and
    # 29, for tokens identical with pushes on and off: the randomized PIT's own chance)
    draw_seeds_from(monkeypatch, 8)


def _follows_the_target(served: Served, tokens: np.ndarray) -> None:
    """The PIT of every token after the first passes against the target at CASE's temperature,
    and fails against it at twice that (the mutant)."""
    exact = pit_against_target(served, CASE, tokens, CASE.temperature, seed=19)
    print(f"PIT of {tokens[:, 1:].size} tokens: p-value {exact:.3g}")
    assert exact > REJECT_BELOW, exact
    wrong = pit_against_target(served, CASE, tokens, CASE.temperature * 2, seed=19)
    print(f"against the target at temperature {CASE.temperature * 2:g}: p-value {wrong:.3g}")
    assert wrong < REJECT_BELOW, wrong


def test_every_token_follows_target_with_pushed_chains(served: Served) -> None:
    prompts = [list(CASE.prompt)] * 180
    tokens, (hits, _, pushed), from_chains = _run(served, prompts, 1, temperature=CASE.temperature,
                                     proposer="draft")  # fmt: skip
    assert pushed >= 50, f"only {pushed:.0f} asks were answered from pushed chains"
    assert pushed == hits, "one request in flight: every hit is a step served from a push"
    _follows_the_target(served, tokens)
    assert from_chains is not None and from_chains[:, 1:].sum() >= 100, "too few from chains"
    alone = pit_against_target(served, CASE, tokens, CASE.temperature, seed=19, only=from_chains)
    print(f"PIT of the {from_chains[:, 1:].sum()} tokens from pushed chains: p-value {alone:.3g}")
    assert alone > REJECT_BELOW, alone


def _q_cubed(from_push: Callable[..., Any]) -> Callable[..., Any]:
    """The mutant of `hub_draft._from_push`: each pushed chain's q rows cubed and
    renormalised, so the target tests the drafts against a q they were not drawn from."""

    def mutant(*args: Any, **kwargs: Any) -> Any:
        out = from_push(*args, **kwargs)
        if out is None:
            return out
        chosen, missed = out
        for n, proposal in enumerate(chosen):
            q = proposal.q
            if isinstance(q, SparseQ | DenseQ) and proposal.draft_token_ids:
                cubed = q.probs**3 / (q.probs**3).sum(dim=-1, keepdim=True)
                q = SparseQ(q.token_ids, cubed) if isinstance(q, SparseQ) else DenseQ(cubed)
                chosen[n] = replace(proposal, q=q)
        return chosen, missed

    return mutant


def test_pushed_chains_verified_against_another_q_are_rejected(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokens the pushed chains made, alone, reject the hub's use of a q other than the one
    the drafts were drawn from (the whole output, whose other tokens are right, did not: p =
    0.592 over 180 requests)."""
    monkeypatch.setattr(hub_draft, "_from_push", _q_cubed(hub_draft._from_push))
    prompts = [list(CASE.prompt)] * 600  # 180: p = 5.5e-4 over 229 tokens; 450: 3e-7 over 492
    tokens, (hits, _, pushed), from_chains = _run(served, prompts, 1, temperature=CASE.temperature,
                                                  proposer="draft")  # fmt: skip
    assert pushed >= 50, f"only {pushed:.0f} asks were answered from pushed chains"
    assert pushed == hits, "every chain the mutant reached came from a push"
    assert from_chains is not None
    wrong = pit_against_target(served, CASE, tokens, CASE.temperature, seed=19, only=from_chains)
    print(f"mutant: PIT of the {from_chains[:, 1:].sum()} tokens from chains: p-value {wrong:.3g}")
    assert wrong < REJECT_BELOW, wrong


@pytest.fixture(scope="module")
def with_backups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Misses of the pushed chains backed up (draft_ahead_backup "always": the push's
    backup_miss_share is infinite, so a step's hits keep their chains and its misses are
    verified with no drafts, ProposeEntry.backup), with the fan-out spread on."""
    with serving_ahead(tmp_path_factory.mktemp("push_backups"), 4,
                       target={"draft_push_always": True}, draft_ahead_backup="always",
                       draft_ahead_spread=True) as served:  # fmt: skip
        yield served


def _push_backups(served: Served) -> float:
    return _total(served.orchestrator, "specdec:draft_ahead_push_backups_total")


def test_every_token_follows_target_with_push_backups_and_the_spread(
    with_backups: Served,
) -> None:
    """Two requests in flight through `with_backups`: the tokens follow the target by the same
    PIT, with at least 50 asks answered from pushes and 50 misses of them backed up."""
    served = with_backups
    before = _push_backups(served)
    tokens, (_, misses, pushed), _ = _run(served, [list(CASE.prompt)] * 180, 2,
                                       temperature=CASE.temperature, proposer="draft")  # fmt: skip
    backed = _push_backups(served) - before
    print(f"{backed:.0f} misses of pushes backed up")
    assert pushed >= 50, f"only {pushed:.0f} asks were answered from pushed chains"
    assert 50 <= backed <= misses, (backed, misses)
    _follows_the_target(served, tokens)


def test_seeded_requests_beside_backed_up_ones_keep_their_output(
    with_backups: Served, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Seeded sampled requests in batches whose unseeded requests are backed up: a seeded
    request's miss is never backed up (its k is fixed), so its tokens are those it gets alone
    through a pair that never takes a push."""
    n = 96
    seeds = {i: 900 + i for i in range(0, n, 4)}  # one request in four seeded
    before = _push_backups(with_backups)
    mixed, _, _ = _run(with_backups, [list(CASE.prompt)] * n, 4, temperature=CASE.temperature,
                    proposer="draft", seed=seeds.get)  # fmt: skip
    backed = _push_backups(with_backups) - before
    print(f"{backed:.0f} misses of pushes backed up")
    assert backed >= 5, "the unseeded requests were backed up"
    with serving_ahead(tmp_path_factory.mktemp("nopush_seeded"), 4,
                       target={"draft_push_chains": False}) as off:  # fmt: skip
        alone, _, _ = _run(off, [list(CASE.prompt)] * len(seeds), 1, temperature=CASE.temperature,
                        proposer="draft", seed=lambda i: 900 + 4 * i)  # fmt: skip
    assert np.array_equal(mixed[0::4], alone)


def test_greedy_output_with_pushed_chains_is_target_only_greedy(served: Served) -> None:
    prompts = [[*CASE.prompt, 3 + i] for i in range(96)]
    drafted, (_, _, pushed), _ = _run(served, prompts, 2, temperature=0.0, proposer="draft")
    alone, _, _ = _run(served, prompts, 2, temperature=0.0, proposer="off")
    assert len({tuple(row) for row in alone.tolist()}) > 48, "too few distinct outputs"
    assert pushed >= 50, f"only {pushed:.0f} asks were answered from pushed chains"
    assert np.array_equal(drafted, alone)


def test_seeded_output_is_the_same_with_pushes_on_and_off(
    served: Served, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same seeded sampled requests through this pair and through one that never takes a
    push: token for token the same (a pushed chain is the answer the draft would have sent)."""
    prompts = [list(CASE.prompt)] * 96
    params = {"temperature": CASE.temperature, "proposer": "draft", "seed": lambda i: 900 + i}
    pushed_on, (_, _, pushed), _ = _run(served, prompts, 1, **params)
    assert pushed >= 10, f"only {pushed:.0f} asks were answered from pushed chains"
    with serving_ahead(tmp_path_factory.mktemp("nopush"), 4,
                       target={"draft_push_chains": False}) as off:  # fmt: skip
        pushed_off, (_, _, none), _ = _run(off, prompts, 1, **params)
    assert none == 0
    assert np.array_equal(pushed_on, pushed_off)
