"""Exactness through the client API with a tensor-parallel target: the target service's model
split over two ranks (two processes, gloo; `specdec.runner.parallel`) behind the client API in
this process (`tests.orchestrator.local_exactness`), with a local draft drafting ahead.

Sampled: every committed token after the first is mapped through its own conditional CDF given
the tokens before it, computed by one rank holding the whole model (randomized PIT), and tested
by chi-square; mutant, rejected by the same statistic: the same tokens against the target at
twice the temperature. Greedy: token for token the output of one rank holding the whole model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.client import AsyncClient
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from specdec.runner.parallel import ParallelRunner
from tests.orchestrator.local_exactness import (
    Served,
    assert_follows_target,
    draw_seeds_from,
    serving_ahead,
)
from tests.orchestrator.test_serve_exactness import MAX_SEQ_LEN, Case, K

MAX_REQUESTS = 8
NEW_TOKENS = 10  # tokens 2 to 10 of each request are tested
CASE = Case("draft", temperature=0.8)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("tp")
    with serving_ahead(tmp, MAX_REQUESTS, target_tensor_parallel=2) as served:
        yield served


@pytest.fixture(autouse=True)
def drawn_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    draw_seeds_from(monkeypatch, 11)


def _generate(served: Served, prompts: list[list[int]], temperature: float) -> np.ndarray:
    async def run() -> np.ndarray:
        limit = asyncio.Semaphore(MAX_REQUESTS)
        async with AsyncClient(served.address, timeout=300.0) as client:

            async def one(prompt: list[int]) -> tuple[int, ...]:
                async with limit:
                    out = await client.complete(
                        prompt, max_tokens=NEW_TOKENS, ignore_eos=True, temperature=temperature,
                        proposer=CASE.proposer, num_draft_tokens=K,
                    )  # fmt: skip
                assert out.finish_reason == "length" and len(out.token_ids) == NEW_TOKENS, out
                return out.token_ids

            return np.array(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(run())


def test_every_token_follows_the_target(served: Served) -> None:
    runner = served.pair.target_engine.runner
    assert isinstance(runner, ParallelRunner) and runner.world == 2
    tokens = _generate(served, [list(CASE.prompt)] * 240, CASE.temperature)
    assert_follows_target(served, CASE, tokens, seed=23)


def _greedy_alone(checkpoint: Path, prompts: list[list[int]]) -> np.ndarray:
    """One rank holding the whole target: NEW_TOKENS greedy tokens after each prompt."""
    runner = ModelRunner.load(RunnerConfig(str(checkpoint), max_slots=1, max_seq_len=MAX_SEQ_LEN))
    rows = []
    for prompt in prompts:
        runner.add_request("r")
        ids, row = list(prompt), []
        for _ in range(NEW_TOKENS):
            logits = runner.forward([ForwardItem("r", ids, 1)])
            ids = [int(torch.argmax(logits[0, :250]))]
            row.append(ids[0])
        runner.release("r")
        rows.append(row)
    return np.array(rows)


def test_greedy_output_is_one_ranks_greedy(served: Served) -> None:
    prompts = [[*CASE.prompt, 3 + i] for i in range(32)]
    split = _generate(served, prompts, 0.0)
    alone = _greedy_alone(served.target_dir, prompts)
    assert len({tuple(row) for row in alone.tolist()}) > 16, "too few distinct outputs"
    assert np.array_equal(split, alone)
