"""What the exactness tests that serve a local draft-ahead pair share: the client API in this
process (`tests.orchestrator.inprocess`) before a local pair drafting ahead with the given
draft options, and the PIT chi-square of sampled tokens against the target."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

import draft_service.sampling
from bench.local import local_pair
from draft_service.config import DraftConfig
from draft_service.sampling import DraftSample, sample_draft
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
    chain_asks: Any = None  # ChainAsks, where a test records them


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
    served: Served,
    case: Case,
    tokens: np.ndarray,
    temperature: float,
    seed: int,
    only: np.ndarray | None = None,
) -> float:
    """Chi-square p-value of the PIT of every token after the first of each row of `tokens`
    (continuations of case.prompt), given its prefix, against the target at `temperature`;
    0 if a token is one the target cannot produce. `only` (bool, tokens' shape): just the
    tokens it marks."""
    prompt = tuple(case.prompt)
    rows = tokens.tolist()
    new = tokens.shape[1]
    mask = np.ones(tokens.shape, dtype=bool) if only is None else only
    at = [(i, t) for i in range(len(rows)) for t in range(1, new) if mask[i, t]]
    prefix_of = [(*prompt, *rows[i][:t]) for i, t in at]
    token = np.array([rows[i][t] for i, t in at])
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


class ChainAsks:
    """The (request id, step) of every ask the draft answered from a chain drafted ahead,
    recorded in this process (`AheadPass.take_chain` of the local pair's draft engine), and
    which output tokens the steps of those asks committed."""

    def __init__(self, served: Served) -> None:
        self.asks: set[tuple[str, int]] = set()
        ahead = served.pair.draft_engine._ahead
        take = ahead.take_chain

        def recorded(a: Any, missed: set[str]) -> Any:
            chain = take(a, missed)
            if chain is not None:
                self.asks.add((a.request_id, a.step))
            return chain

        ahead.take_chain = recorded

    def mask(self, outputs: list[Any], new: int) -> np.ndarray:
        """bool [len(outputs), new]: the tokens of each `specdec.client.GenerateOutput` that
        steps whose ask was answered from a chain committed (num_accepted + 1 each). An ask
        answered so whose step then went on without drafts (a deadline missed) is marked too:
        which steps are marked depends only on earlier verdicts, so the PIT of the marked tokens
        is still uniform under exactness."""
        out = np.zeros((len(outputs), new), dtype=bool)
        for i, o in enumerate(outputs):
            at = 0
            for step in o.steps:
                n = min(step.num_accepted + 1, new - at)
                out[i, at : at + n] = (o.request_id, step.step) in self.asks
                at += n
            assert at == new, (at, o.steps)
        return out


def patch_draft_sampling(monkeypatch: Any, sample: Callable[..., object]) -> None:
    """Every draft_service module's `sample_draft` name (the heads look it up when they run)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("draft_service") and getattr(module, "sample_draft", None) is (
            sample_draft
        ):
            monkeypatch.setattr(module, "sample_draft", sample)
    assert draft_service.sampling.sample_draft is sample


def q_at_another_temperature(
    factor: float, applies: Callable[[], bool] = lambda: True
) -> Callable[..., DraftSample]:
    """A mutant of the draft's sampling (for `patch_draft_sampling`): where `applies()`, it
    draws at the request's temperature and sends q at `factor` times it, so the target tests
    the drafts against a q they were not drawn from. For requests without top-k or top-p only:
    with them the support changes with the temperature, and a drawn token outside the sent q
    is refused rather than tested."""

    def sample(logits: Any, temperature: Any, *args: Any, **kwargs: Any) -> DraftSample:
        drawn = sample_draft(logits, temperature, *args, **kwargs)
        if not applies():
            return drawn
        sent = sample_draft(logits, temperature * factor, *args, **kwargs)
        return replace(sent, token_ids=drawn.token_ids)

    return sample


def q_of_another_temperature_ahead(monkeypatch: Any, served: Served, factor: float) -> None:
    """`q_at_another_temperature` in the pass ahead only (`AheadPass.run`: the chains drafted
    ahead, a backup's catch-up and the chains it spawns); drafts made outside it are left
    alone."""
    ahead = served.pair.draft_engine._ahead
    run = ahead.run
    inside = [False]

    def flagged(request_ids: Any) -> int:
        inside[0] = True
        try:
            return int(run(request_ids))
        finally:
            inside[0] = False

    monkeypatch.setattr(ahead, "run", flagged)
    patch_draft_sampling(monkeypatch, q_at_another_temperature(factor, lambda: inside[0]))


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
