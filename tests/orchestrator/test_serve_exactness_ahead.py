"""Exactness of sampled output through the client API with draft-ahead on: `specdec serve` on a
real local Ray cluster (tiny CPU checkpoints), the draft drafting each request's next step for
its likely verdicts while the target verifies (`draft_service.ahead`), many seeded requests sent
concurrently by `AsyncClient`.

Every committed token after the first is mapped through its own conditional CDF given the
tokens before it (randomized probability integral transform, `test_serve_exactness.pit`); under
exactness the values are independent U(0, 1) (Rosenblatt), tested by chi-square on equal-width
bins. Pooling every position brings in the steps whose drafts were made ahead: the test asserts
that the served run answered many asks from them (the orchestrator's draft-ahead counters), and
that accepted drafts and the rejection sampler's recovery draws both made tokens.

Stacks: sparse q with the default draft (at temperature 0.3, and at 1 with top-k / top-p), and
dense q with a poor draft at 0.8 with top-k (its weights far from the target's, so most drafts
are rejected and the recovery draws carry the distribution). Mutant: the same statistic
against the target at half the case's temperature must reject, so the test can fail.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from orchestrator.server import Orchestrator
from specdec.client import AsyncClient
from tests.draft_service.models import build_checkpoints
from tests.orchestrator.test_serve_exactness import (
    MAX_REQUESTS,
    PROMPT,
    REJECT_BELOW,
    Case,
    K,
    distributions,
    pit,
    pit_pvalue,
    serving,
)

FANOUT = 2
NUM_REQUESTS = 1000
NEW_TOKENS = 10  # tokens 2 to 10 of each request are tested: several steps, most after a verdict


@dataclass(frozen=True)
class StackConfig:
    q_form: str
    draft_noise: float  # the draft's weights: the target's plus this much relative noise
    min_hits: int  # asks the run must answer from chains drafted ahead


# (one run: 258 and 101 hits with the good draft, 62 with the poor one, whose guesses seldom
# hold the verdict's token; how many also depends on how the requests were batched)
STACKS = {
    "sparse": StackConfig("sparse", 0.05, 50),
    "dense-poor": StackConfig("dense", 0.35, 25),
}
# Draft-ahead hits where the draft's top guesses hold the verdict's added token: seldom at
# temperature 1 or 0.7 over the whole vocabulary of these random models (0 of 4,431 and 5 of
# 3,541 asks in one run), so the cases sharpen the distribution or truncate it
CASES = [
    ("sparse", Case("draft", temperature=0.3)),
    ("sparse", Case("draft", top_k=20, top_p=0.9)),
    ("dense-poor", Case("draft", temperature=0.8, top_k=10)),
]


@dataclass
class Stack:
    name: str
    address: str
    target_dir: Path
    orchestrator: Orchestrator


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    name: str = request.param
    cfg = STACKS[name]
    target, draft = build_checkpoints(tmp_path_factory.mktemp(f"ahead-{name}"), cfg.draft_noise)
    options = {"q_form": cfg.q_form, "draft_ahead": FANOUT, "draft_ahead_slots": 4 * MAX_REQUESTS}
    with serving(target, draft, **options) as (orchestrator, address):
        yield Stack(name, address, target, orchestrator)


def _total(orchestrator: Orchestrator, sample: str) -> float:
    """The sum of a metric's sample over its labels."""
    return sum(
        s.value
        for family in orchestrator.metrics.registry.collect()
        for s in family.samples
        if s.name == sample
    )


@dataclass
class Run:
    tokens: np.ndarray  # [N, NEW_TOKENS]
    accepted: int  # draft tokens accepted, over every step
    recovered: int  # steps that drafted and rejected one: the recovery draw made a token
    hits: float  # the draft's asks answered from drafts made ahead
    misses: float
    pushed: float = 0.0  # of the hits, those taken from chains pushed before the verdict


async def _generate(stack: Stack, case: Case) -> Run:
    limit = asyncio.Semaphore(2 * MAX_REQUESTS)
    accepted = recovered = 0
    async with AsyncClient(stack.address, timeout=120.0) as client:

        async def one(i: int) -> tuple[int, ...]:
            nonlocal accepted, recovered
            async with limit:
                out = await client.complete(
                    list(case.prompt), max_tokens=NEW_TOKENS, ignore_eos=True,
                    temperature=case.temperature, top_k=case.top_k, top_p=case.top_p,
                    seed=20_000 + i, proposer="draft", num_draft_tokens=K,
                )  # fmt: skip
            assert out.finish_reason == "length" and len(out.token_ids) == NEW_TOKENS, out
            for step in out.steps:
                accepted += step.num_accepted
                recovered += step.num_draft_tokens > 0 and step.num_accepted < step.num_draft_tokens
            return out.token_ids

        tokens = await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
    return Run(np.array(tokens), accepted, recovered, 0.0, 0.0)


def _run(stack: Stack, case: Case) -> Run:
    names = ("specdec:draft_ahead_hits_total", "specdec:draft_ahead_misses_total",
             "specdec:draft_busy_seconds_total", "specdec:step_draft_seconds_sum",
             "specdec:draft_ahead_pushed_total")  # fmt: skip
    before = [_total(stack.orchestrator, n) for n in names]
    t0 = time.monotonic()
    run = asyncio.run(_generate(stack, case))
    after = [_total(stack.orchestrator, n) for n in names]
    hits, misses, busy, forwards, pushed = (a - b for a, b in zip(after, before, strict=True))
    run.hits, run.misses, run.pushed = hits, misses, pushed
    # the draft's busy time is its proposal forwards plus its passes ahead, which ran
    assert busy > forwards > 0, (busy, forwards)
    print(f"\n{stack.name} {case}: {NUM_REQUESTS} requests in {time.monotonic() - t0:.1f} s; "
          f"{run.accepted} drafts accepted, {run.recovered} recovery draws, draft-ahead "
          f"{run.hits:.0f} hits ({run.pushed:.0f} pushed) / {run.misses:.0f} misses")  # fmt: skip
    return run


def _pit_pvalue(stack: Stack, case: Case, tokens: np.ndarray, temperature: float) -> float:
    """Chi-square p-value of the PIT of every token after the first, given its own prefix."""
    prompt = tuple(case.prompt)
    prefix_of = [(*prompt, *row[:t]) for row in tokens.tolist() for t in range(1, NEW_TOKENS)]
    token = np.array([row[t] for row in tokens.tolist() for t in range(1, NEW_TOKENS)])
    prefixes = sorted(set(prefix_of))
    index = {prefix: i for i, prefix in enumerate(prefixes)}
    p = distributions(stack.target_dir, prefixes, case, temperature).numpy()
    p = p[np.array([index[prefix] for prefix in prefix_of])]
    outside = int((p[np.arange(len(token)), token] == 0).sum())
    if outside:
        print(f"{outside} tokens outside the support at T={temperature}")
        return 0.0
    return pit_pvalue(pit(token, p, seed=11))


@pytest.mark.parametrize(
    ("stack", "case"), CASES, indirect=["stack"],
    ids=[f"{s}-T{c.temperature:g}-topk{c.top_k}-topp{c.top_p:g}" for s, c in CASES],
)  # fmt: skip
def test_every_token_follows_target_with_draft_ahead(stack: Stack, case: Case) -> None:
    assert case.prompt == tuple(PROMPT)
    run = _run(stack, case)
    # the paths that carry the distribution all ran: drafts accepted, recovery draws, and
    # asks answered from drafts made ahead
    assert run.accepted >= 200 and run.recovered >= 200, run
    assert run.hits >= STACKS[stack.name].min_hits, f"draft-ahead answered only {run.hits} asks"
    exact = _pit_pvalue(stack, case, run.tokens, case.temperature)
    print(f"PIT of {run.tokens[:, 1:].size} tokens: p-value {exact:.3g}")
    assert exact > REJECT_BELOW, exact
    wrong = _pit_pvalue(stack, case, run.tokens, case.temperature / 2)
    print(f"against the target at temperature {case.temperature / 2:g}: p-value {wrong:.3g}")
    assert wrong < REJECT_BELOW, wrong
