"""What the exactness tests that serve a local draft-ahead pair share: the client API in this
process (`tests.orchestrator.inprocess`) before a local pair drafting ahead with the given
draft options, and the PIT chi-square of sampled tokens against the target."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.local import local_pair
from draft_service.config import DraftConfig
from orchestrator.config import SchedulerConfig, ServeConfig, ServiceConfig
from orchestrator.server import Orchestrator
from specdec.runner import RunnerConfig
from target_service.config import TargetConfig
from tests.draft_service.models import build_checkpoints
from tests.orchestrator.inprocess import api_on
from tests.orchestrator.test_serve_exactness import (
    MAX_SEQ_LEN,
    REJECT_BELOW,
    Case,
    K,
    distributions,
    pit,
    pit_pvalue,
)

FANOUT = 2


@dataclass
class Served:
    orchestrator: Orchestrator
    address: str
    target_dir: Path
    pair: Any = None  # bench.local.LocalPair


@contextmanager
def serving_ahead(
    tmp: Path,
    max_requests: int,
    target_tensor_parallel: int = 1,
    kv: dict[str, Any] | None = None,
    target: dict[str, Any] | None = None,
    **draft: Any,
) -> Iterator[Served]:
    """Tiny checkpoints in `tmp`, a local pair drafting ahead (F = FANOUT, k = K, with the
    DraftConfig / ServiceConfig options `draft`, named alike in both) for `max_requests`
    requests, and the client API before it; the target split over `target_tensor_parallel`
    ranks (processes, gloo); `kv`: RunnerConfig settings of both KV caches (a paged one);
    `target`: more TargetConfig options."""
    target_dir, draft_dir = build_checkpoints(tmp)
    ahead_slots = FANOUT * (K + 1) * max_requests
    ahead = {"draft_ahead": FANOUT, "draft_ahead_slots": ahead_slots, **draft}
    draft_config = DraftConfig(
        runner=RunnerConfig(str(draft_dir), max_slots=max_requests + ahead_slots + 1,
                            max_seq_len=MAX_SEQ_LEN, **(kv or {})),
        **ahead,
    )  # fmt: skip
    target_config = TargetConfig(
        RunnerConfig(
            str(target_dir),
            max_slots=max_requests + 1,
            max_seq_len=MAX_SEQ_LEN,
            tensor_parallel=target_tensor_parallel,
            **(kv or {}),
        ),
        sampler_impl="torch",
        **(target or {}),
    )
    config = ServeConfig(
        ServiceConfig(str(target_dir), str(draft_dir), device="cpu", max_requests=max_requests,
                      max_seq_len=MAX_SEQ_LEN, **ahead),
        scheduler=SchedulerConfig(max_queue=4 * max_requests, proposer="draft",
                                  num_draft_tokens=K),
        host="127.0.0.1", port=0, metrics_port=None, grace_s=2.0,
    )  # fmt: skip
    with local_pair(draft_config, target_config) as pair, api_on(pair, config) as orchestrator:
        yield Served(orchestrator, f"127.0.0.1:{orchestrator.port}", target_dir, pair)


def pit_against_target(
    served: Served, case: Case, tokens: np.ndarray, temperature: float, seed: int
) -> float:
    """Chi-square p-value of the PIT of every token after the first of each row of `tokens`
    (continuations of case.prompt), given its prefix, against the target at `temperature`;
    0 if a token is one the target cannot produce."""
    prompt = tuple(case.prompt)
    rows = tokens.tolist()
    new = tokens.shape[1]
    prefix_of = [(*prompt, *row[:t]) for row in rows for t in range(1, new)]
    token = np.array([row[t] for row in rows for t in range(1, new)])
    prefixes = sorted(set(prefix_of))
    index = {prefix: i for i, prefix in enumerate(prefixes)}
    p = distributions(served.target_dir, prefixes, case, temperature).numpy()
    p = p[np.array([index[prefix] for prefix in prefix_of])]
    if (p[np.arange(len(token)), token] == 0).any():
        return 0.0
    return pit_pvalue(pit(token, p, seed=seed))


def assert_follows_target(served: Served, case: Case, tokens: np.ndarray, seed: int) -> None:
    """The PIT test passes for `tokens` against the target at the case's temperature, and
    rejects them against the target at twice it (the mutant)."""
    exact = pit_against_target(served, case, tokens, case.temperature, seed=seed)
    print(f"\nPIT of {tokens[:, 1:].size} tokens: p-value {exact:.3g}")
    assert exact > REJECT_BELOW, exact
    wrong = pit_against_target(served, case, tokens, case.temperature * 2, seed=seed)
    print(f"against the target at temperature {case.temperature * 2:g}: p-value {wrong:.3g}")
    assert wrong < REJECT_BELOW, wrong


class Seeds:
    """Stands in for the `secrets` module where the orchestrator draws an unseeded request's
    seed (orchestrator.core.requests): the same draws every run."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)

    def randbelow(self, n: int) -> int:
        return self._random.randrange(n)


def draw_seeds_from(monkeypatch: Any, seed: int) -> None:
    """Unseeded requests' seeds from `Seeds(seed)` for the rest of the test."""
    import orchestrator.core.requests

    monkeypatch.setattr(orchestrator.core.requests, "secrets", Seeds(seed))
