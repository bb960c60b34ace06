"""`specdec serve` with a tensor-parallel target on a real local Ray cluster (CPU: the target's
second rank is a process its actor spawns, the collectives gloo): greedy output equals the
whole model's, and a rank killed mid-stream takes the target down as a whole, Ray restarts it,
and every request in flight finishes with the same tokens (re-admitted from the orchestrator's
records)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from orchestrator.launch.ray_start import descendants
from tests.draft_service.models import build_checkpoints
from tests.orchestrator.test_serve import (
    PROMPTS,
    Stack,
    oracle,
    request,
    serve_stack,
    stream,
    through_a_target_restart,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    target, draft = build_checkpoints(tmp_path_factory.mktemp("tp"))
    with serve_stack(target, draft, 4, 8, target_tensor_parallel=2) as s:
        yield s


def _ranks(stack: Stack) -> list[int]:
    """The pids of the target's spawned ranks (its actor's children that run spawn_main)."""
    pair = stack.orchestrator.placement.pairs[0]
    actor = ray.get(pair.target.pid.remote(), timeout=30)
    out = []
    for pid in descendants(actor):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            out.append(pid)
    return out


def test_greedy_output_of_a_two_rank_target_is_the_whole_models(stack: Stack) -> None:
    assert len(_ranks(stack)) == 1, "the target runs one more rank than its own process"
    for prompt in PROMPTS[:2]:
        tokens, steps, _ = stream(stack.stub, request(list(prompt), 40, "draft", 3))
        assert tokens == oracle(stack.target_dir, tuple(prompt), 40)
        assert any(s.num_accepted for s in steps), "nothing was drafted"


def test_a_rank_killed_mid_stream_loses_no_request(stack: Stack) -> None:
    prompt = list(PROMPTS[1])
    expected = oracle(stack.target_dir, tuple(prompt), 120)
    pair = stack.orchestrator.placement.pairs[0]
    old_address = pair.target_address
    (rank,) = _ranks(stack)
    fault = lambda: os.kill(rank, signal.SIGKILL)
    results = through_a_target_restart(stack, prompt, 120, ("draft", "off"), fault)
    assert results == {"draft": expected, "off": expected}
    assert pair.target_address != old_address, "a new target process serves the pair"
    assert len(_ranks(stack)) == 1 and _ranks(stack) != [rank], "with a new second rank"
    m = stack.metrics()
    labels = (("model_pair", stack.orchestrator.config.model_name),)
    assert m[("specdec:service_restarts_total", (*labels, ("role", "target")))] >= 1
