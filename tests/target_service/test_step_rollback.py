"""A verify step that raises leaves every request as it was: its KV extension is rolled back,
its entries get STEP_FAILED verdicts, and the identical retry is served as on a clean engine."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

import target_service.engine as engine_module
from specdec.runner import ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DraftBlock, DraftProposal, block_to_pb
from specdec.serving.messages import AdmitRequest, ErrorReason
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from tests.draft_service.models import build_checkpoints, runner_config


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoints(tmp_path_factory.mktemp("ckpt"))[0]


def _engine(target_dir: Path) -> TargetEngine:
    config = TargetConfig(runner_config(target_dir), sampler_impl="torch")
    engine = TargetEngine(ModelRunner.load(config.runner), config)
    engine.admit(AdmitRequest("a", tuple(range(5, 14)), SamplingParams(0.0)))
    engine.admit(AdmitRequest("b", tuple(range(20, 27)), SamplingParams(0.9, seed=3)))
    return engine


def _block() -> DraftBlock:
    proposals = [DraftProposal("a", 0, 9, (14, 15)), DraftProposal("b", 0, 7, ())]
    return DraftBlock.from_pb(block_to_pb(proposals))


def test_a_failed_verify_step_rolls_back_and_the_retry_is_served(
    target_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean, faulty = _engine(target_dir), _engine(target_dir)
    lengths = [faulty.runner.cached_length(r) for r in "ab"]

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected")

    monkeypatch.setattr(engine_module, "rejection_sample", broken)
    failed = faulty.verify(_block())
    monkeypatch.undo()
    assert sorted(failed.errors) == [0, 1]
    for error in failed.errors.values():
        assert error.reason == ErrorReason.STEP_FAILED and error.code == grpc.StatusCode.INTERNAL
        assert "injected" in error.message and "unchanged" in error.message
    assert [faulty.runner.cached_length(r) for r in "ab"] == lengths
    assert faulty.tokens("a") == clean.tokens("a")
    want, got = clean.verify(_block()), faulty.verify(_block())
    assert not got.errors and not want.errors
    assert got.token_ids == want.token_ids and got.num_accepted == want.num_accepted
    assert [faulty.runner.cached_length(r) for r in "ab"] == [
        clean.runner.cached_length(r) for r in "ab"
    ]


def test_a_step_the_paged_cache_cannot_hold_fails_its_last_requests_only(target_dir: Path) -> None:
    """A paged cache one block short of the step: the last entry gets CAPACITY (its request
    unchanged), the first is verified as on an engine with room; once the first is released
    the retry of the second is served."""
    from dataclasses import replace

    roomy = _engine(target_dir)
    config = TargetConfig(replace(runner_config(target_dir), kv_block_size=4), sampler_impl="torch")
    # admission prefills each prompt but its last token: a's 8 (2 blocks), b's 6 (2 blocks);
    # then the step writes k + 1 = 3 positions for each: a block more each
    config = replace(config, runner=replace(config.runner, kv_blocks=2 + 2 + 1))
    tight = TargetEngine(ModelRunner.load(config.runner), config)
    tight.admit(AdmitRequest("a", tuple(range(5, 14)), SamplingParams(0.0)))
    tight.admit(AdmitRequest("b", tuple(range(20, 27)), SamplingParams(0.9, seed=3)))
    assert tight.runner.free_kv_blocks == 1
    both = [DraftProposal("a", 0, 9, (14, 15)), DraftProposal("b", 0, 7, (27, 28))]
    step = DraftBlock.from_pb(block_to_pb(both))
    got, want = tight.verify(step), roomy.verify(step)
    assert list(got.errors) == [1] and got.errors[1].reason == ErrorReason.CAPACITY
    assert "no free blocks" in got.errors[1].message
    assert got.token_ids[0] == want.token_ids[0]
    assert tight.runner.cached_length("b") == 6 and tight.tokens("b") == list(range(20, 27))
    tight.release(["a"])  # its blocks come back (cached, so they can be taken)
    proposals = [DraftProposal("b", 0, 7, (27, 28))]
    retry = tight.verify(DraftBlock.from_pb(block_to_pb(proposals)))
    assert not retry.errors and retry.token_ids[0] == want.token_ids[1]
