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


def test_each_request_is_accepted_at_its_own_synthetic_length(
    checkpoints: tuple[Path, Path],
) -> None:
    """Mixed traffic (BENCHMARKING ONLY): with a length spread the engine gives the sampler
    each request's id, so two requests of one block commit at their own lengths."""
    from target_service.synthetic import SyntheticAcceptance

    synthetic = SyntheticAcceptance(4, mean_acceptance_length=2.5, length_spread=1.5)
    ids = sorted((f"r{i}" for i in range(200)), key=synthetic.length_for)
    short, long = ids[0], ids[-1]  # lengths near 1 and near 4
    assert synthetic.length_for(long) - synthetic.length_for(short) > 2.5
    config = TargetConfig(runner_config(checkpoints[0], max_slots=4), sampler_impl="torch",
                          synthetic=synthetic)  # fmt: skip
    engine = TargetEngine(ModelRunner.load(config.runner), config)
    committed: dict[str, list[int]] = {short: [], long: []}
    for round_ in range(12):
        tokens = {rid: list(PROMPT) for rid in committed}
        for rid in committed:
            engine.admit(AdmitRequest(rid, PROMPT, SamplingParams(1.0, seed=round_)))
        for step in range(6):
            proposals = [
                DraftProposal(rid, step, len(t), (1, 2, 3, 4)) for rid, t in tokens.items()
            ]
            verdicts = engine.verify(DraftBlock.from_pb(block_to_pb(proposals)))
            assert not verdicts.errors
            for rid, new in zip(committed, verdicts.token_ids, strict=True):
                committed[rid].append(len(new))
                tokens[rid] += new
        engine.release(list(committed))
    mean = {rid: sum(n) / len(n) for rid, n in committed.items()}
    for rid in committed:  # 72 steps each: within about 0.4 of its own L
        assert abs(mean[rid] - synthetic.length_for(rid)) < 0.45, (mean, rid)
