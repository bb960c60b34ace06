"""On CUDA, the served step loop runs on captured graphs with one host synchronisation per
service step, and commits the same greedy tokens as target-only decoding."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from draft_service.engine import DraftEngine
from draft_service.server import model_info
from specdec.runner import ModelRunner, RunnerConfig
from specdec.sampling_params import SamplingParams
from specdec.serving.messages import AdmitRequest, ProposeEntry
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from tests.draft_service.models import build_checkpoints, greedy_reference, model_draft

pytestmark = pytest.mark.gpu
GRAPHS = (1, 2, 4, 8)


def _cuda(config: RunnerConfig) -> RunnerConfig:
    return replace(config, device="cuda", cuda_graph_batch_sizes=GRAPHS)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[DraftEngine, TargetEngine, Path]:
    target_dir, draft_dir = build_checkpoints(tmp_path_factory.mktemp("ckpt"))
    d_config = model_draft(draft_dir)
    assert d_config.runner is not None
    d_config = replace(d_config, runner=_cuda(d_config.runner))
    assert d_config.runner is not None
    d_runner = ModelRunner.load(d_config.runner)
    draft = DraftEngine(d_config, d_runner, model_info(d_config, d_runner))
    t_config = TargetConfig(_cuda(RunnerConfig(str(target_dir), max_slots=16, max_seq_len=128)))
    target = TargetEngine(ModelRunner.load(t_config.runner), t_config)
    return draft, target, target_dir


def _allow_only_result_reads(runner: ModelRunner) -> None:
    """The one synchronisation a step may make is `to_host`, reading its results: let it
    through the sync-debug mode, which then flags any other."""
    real = type(runner).to_host

    def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
        torch.cuda.set_sync_debug_mode("default")
        try:
            return real(runner, *tensors)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    runner.to_host = to_host  # type: ignore[method-assign]


def _run(
    draft: DraftEngine, target: TargetEngine, prompts: dict[str, list[int]], ks: dict[str, int],
    steps: int, sampling: SamplingParams, check_syncs_after: int | None = None,
) -> tuple[dict[str, list[int]], list[bool]]:  # fmt: skip
    """Lock-step propose → verify in-process; the committed tokens and each step's `graphed`."""
    tokens = {rid: list(p) for rid, p in prompts.items()}
    new: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, p in prompts.items():
        draft.admit(AdmitRequest(rid, tuple(p), sampling))
        target.admit(AdmitRequest(rid, tuple(p), sampling))
    graphed = []
    try:
        for step in range(steps):
            if check_syncs_after is not None and step == check_syncs_after:
                for runner in (draft.runner, target.runner):
                    _allow_only_result_reads(runner)  # type: ignore[arg-type]
                torch.cuda.set_sync_debug_mode("error")
            asks = [ProposeEntry(rid, step, tuple(new[rid]), len(tokens[rid]), ks[rid])
                    for rid in prompts]  # fmt: skip
            proposal = draft.propose_timed(asks)
            block, errors, d_times = proposal.block, proposal.errors, proposal.times
            assert not errors
            verdicts, t_times = target.verify_timed(block)
            assert not verdicts.errors, verdicts.errors
            graphed.append(d_times.graphed and t_times.graphed)
            for i, rid in enumerate(verdicts.request_ids):
                new[rid] = list(verdicts.token_ids[i])
                tokens[rid] += new[rid]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        for runner in (draft.runner, target.runner):
            vars(runner).pop("to_host", None)
        draft.release(list(prompts))
        target.release(list(prompts))
    return {rid: tokens[rid][len(prompts[rid]) :] for rid in prompts}, graphed


def test_greedy_through_graphs_equals_target_only_and_steps_do_not_sync(
    engines: tuple[DraftEngine, TargetEngine, Path],
) -> None:
    draft, target, target_dir = engines
    g = torch.Generator().manual_seed(0)
    prompts = {f"r{i}": torch.randint(2, 250, (5 + i,), generator=g).tolist() for i in range(5)}
    ks = {"r0": 3, "r1": 0, "r2": 1, "r3": 4, "r4": 2}  # ragged, 0 included
    got, graphed = _run(draft, target, prompts, ks, 8, SamplingParams(0.0), check_syncs_after=2)
    reference = ModelRunner.load(RunnerConfig(str(target_dir), device="cuda", max_slots=1,
                                              max_seq_len=128))  # fmt: skip
    for rid, prompt in prompts.items():
        want = greedy_reference(reference, prompt, len(got[rid]))
        assert got[rid] == want, rid
    assert all(graphed), graphed


def test_sampled_steps_run_on_graphs_without_syncs(
    engines: tuple[DraftEngine, TargetEngine, Path],
) -> None:
    draft, target, _ = engines
    prompts = {f"s{i}": list(range(3 + i, 12 + i)) for i in range(3)}
    ks = {"s0": 4, "s1": 4, "s2": 2}
    sampling = SamplingParams(0.8, top_k=20, top_p=0.9, seed=5)
    got, graphed = _run(draft, target, prompts, ks, 6, sampling, check_syncs_after=2)
    assert all(len(t) >= 6 for t in got.values())
    assert all(graphed), graphed
