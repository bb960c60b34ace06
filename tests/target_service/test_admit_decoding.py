"""`TargetEngine.admit_decoding`: the first token sampled from the prefill's own last position
is the token a verify step of k = 0 at the first step samples (same sampler, parameters and
random stream), and a refused first token leaves nothing admitted."""

from __future__ import annotations

from pathlib import Path

import pytest

import target_service.engine as engine_module
from specdec.runner import ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DraftBlock, DraftProposal, block_to_pb
from specdec.serving.messages import AdmitRequest, ErrorReason
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from tests.draft_service.models import runner_config

PROMPT = tuple(range(5, 14))


def _engine(target_dir: Path) -> TargetEngine:
    config = TargetConfig(runner_config(target_dir, max_slots=4), sampler_impl="torch")
    return TargetEngine(ModelRunner.load(config.runner), config)


def test_the_first_token_is_the_k0_steps_token(checkpoints: tuple[Path, Path]) -> None:
    engine = _engine(checkpoints[0])
    seen = set()
    for seed in range(40):
        sampling = SamplingParams(1.0, seed=seed)
        engine.admit(AdmitRequest("step", PROMPT, sampling))
        block = DraftBlock.from_pb(block_to_pb([DraftProposal("step", 0, len(PROMPT), ())]))
        want = engine.verify(block)
        engine.release(["step"])
        got, _ = engine.admit_decoding(AdmitRequest("fused", PROMPT, sampling))
        assert not got.errors and not want.errors
        assert got.token_ids == want.token_ids and got.steps == [0], seed
        assert engine.tokens("fused") == [*PROMPT, *got.token_ids[0]]
        assert engine.runner.cached_length("fused") == len(PROMPT)  # the KV of the prompt
        engine.release(["fused"])
        seen.add(got.token_ids[0][0])
    assert len(seen) > 5, "seeds that all drew one token test nothing"


def test_a_refused_first_token_admits_nothing(
    checkpoints: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(checkpoints[0])
    real = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda items: real(items) * float("nan"))
    verdicts, _ = engine.admit_decoding(AdmitRequest("nan", PROMPT, SamplingParams(1.0, seed=1)))
    assert verdicts.errors[0].reason != ErrorReason.STEP_FAILED  # the sampler's own refusal
    assert engine.release(["nan"]) == 0, "a refused request stayed admitted"
    monkeypatch.setattr(engine_module.TargetEngine, "_prefill_step", _raise)
    with pytest.raises(RuntimeError, match="injected"):
        engine.admit_decoding(AdmitRequest("raise", PROMPT, SamplingParams(0.0)))
    assert engine.release(["raise"]) == 0
    monkeypatch.undo()
    verdicts, _ = engine.admit_decoding(AdmitRequest("raise", PROMPT, SamplingParams(0.0)))
    assert not verdicts.errors and engine.tokens("raise") == [*PROMPT, *verdicts.token_ids[0]]


def _raise(*args: object) -> None:
    raise RuntimeError("injected")
