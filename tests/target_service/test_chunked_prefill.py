"""Chunked prefill (`TargetConfig.prefill_chunk_tokens`): a new prompt prefilled a chunk at a time
(`TargetEngine.begin_prefill` / `prefill_chunk`) gives the first token a whole prefill gives, and
the same KV after it; a chunk that fails, or a release meanwhile, leaves nothing held; with prefix
caching the prompt's cached start is taken once, before its chunks; in the hub, running requests
keep stepping between a long prompt's chunks, and greedy output equals target-only greedy."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import target_service.engine as engine_module
from orchestrator.core.pair import Admitted
from specdec.runner import ForwardItem, ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DraftBlock, DraftProposal, block_to_pb
from specdec.serving.messages import AdmitRequest, ErrorReason
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from tests.draft_service.models import TOKENIZER_VOCAB, greedy_reference, runner_config
from tests.target_service.hub_helpers import Driver, hub_services

PROMPT: tuple[int, ...] = tuple(
    torch.randint(2, TOKENIZER_VOCAB, (23,), generator=torch.Generator().manual_seed(5)).tolist()
)


def _engine(target_dir: Path, **runner: Any) -> TargetEngine:
    rc = replace(runner_config(target_dir, max_slots=4), **runner)
    config = TargetConfig(rc, sampler_impl="torch")
    return TargetEngine(ModelRunner.load(config.runner), config)


def _chunked(engine: TargetEngine, adm: AdmitRequest, budget: int) -> tuple[Any, int]:
    """The verdict of a chunked prefill, and how many calls it took."""
    engine.begin_prefill(adm)
    calls = 0
    while True:
        calls += 1
        done = engine.prefill_chunk(adm.request_id, budget)
        if done is not None:
            return done[0], calls


def _k0_step(engine: TargetEngine, rid: str, step: int) -> list[int]:
    n = len(engine.tokens(rid))
    block = DraftBlock.from_pb(block_to_pb([DraftProposal(rid, step, n, ())]))
    out = engine.verify(block)
    assert not out.errors
    return list(out.token_ids[0])


@pytest.mark.parametrize("budget", [1, 4, 22, 23, 64])
def test_a_chunked_prefill_draws_the_whole_prefills_tokens(
    checkpoints: tuple[Path, Path], budget: int
) -> None:
    engine = _engine(checkpoints[0])
    seen = set()
    for seed in range(12):
        sampling = SamplingParams(1.0, seed=seed)
        whole, _ = engine.admit_decoding(AdmitRequest("whole", PROMPT, sampling))
        got, calls = _chunked(engine, AdmitRequest("chunked", PROMPT, sampling), budget)
        assert calls == -(-len(PROMPT) // budget), "one call per chunk of at most the budget"
        assert not got.errors and got.token_ids == whole.token_ids and got.steps == [0], seed
        assert engine.tokens("chunked") == engine.tokens("whole")
        assert engine.runner.cached_length("chunked") == len(PROMPT)
        # the KV the chunks wrote serves the next steps as the whole prefill's does
        for step in (1, 2, 3):
            assert _k0_step(engine, "chunked", step) == _k0_step(engine, "whole", step), seed
        seen.add(got.token_ids[0][0])
        assert engine.release(["whole", "chunked"]) == 2
    assert len(seen) > 3, "seeds that all drew one token test nothing"


def test_the_chunks_logits_are_the_whole_prefills(checkpoints: tuple[Path, Path]) -> None:
    runner = ModelRunner.load(runner_config(checkpoints[0], max_slots=2))
    runner.add_request("whole")
    runner.add_request("chunked")
    want = runner.forward([ForwardItem("whole", PROMPT, 1)])
    for start in range(0, 20, 5):
        runner.forward([ForwardItem("chunked", PROMPT[start : start + 5], 0)])
    got = runner.forward([ForwardItem("chunked", PROMPT[20:], 1)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_failed_chunk_or_a_release_leaves_nothing_held(
    checkpoints: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(checkpoints[0])
    free = engine.runner.free_slots
    engine.begin_prefill(AdmitRequest("r", PROMPT, SamplingParams(0.0)))
    assert engine.prefill_chunk("r", 8) is None
    with pytest.raises(Exception, match="already admitted"):
        engine.begin_prefill(AdmitRequest("r", PROMPT, SamplingParams(0.0)))
    with pytest.raises(Exception, match="already admitted"):
        engine.admit_decoding(AdmitRequest("r", PROMPT, SamplingParams(0.0)))
    assert engine.release(["r"]) == 1 and engine.runner.free_slots == free

    real = engine.runner.forward
    calls = []

    def fail_second(items: list[ForwardItem]) -> torch.Tensor:
        calls.append(items)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(items)

    monkeypatch.setattr(engine.runner, "forward", fail_second)
    engine.begin_prefill(AdmitRequest("f", PROMPT, SamplingParams(0.0)))
    assert engine.prefill_chunk("f", 8) is None
    with pytest.raises(RuntimeError, match="injected"):
        engine.prefill_chunk("f", 8)
    assert engine.release(["f"]) == 0 and engine.runner.free_slots == free
    monkeypatch.undo()

    monkeypatch.setattr(engine_module.TargetEngine, "_prefill_step", _raise)  # the last chunk
    engine.begin_prefill(AdmitRequest("g", PROMPT, SamplingParams(0.0)))
    assert engine.prefill_chunk("g", 16) is None
    with pytest.raises(RuntimeError, match="injected"):
        engine.prefill_chunk("g", 16)
    assert engine.release(["g"]) == 0 and engine.runner.free_slots == free
    monkeypatch.undo()

    real = engine.runner.forward  # a refused first token (NaN logits) admits nothing either
    monkeypatch.setattr(engine.runner, "forward", lambda items: real(items) * float("nan"))
    verdicts, _ = _chunked(engine, AdmitRequest("nan", PROMPT, SamplingParams(1.0, seed=1)), 8)
    assert verdicts.errors and verdicts.errors[0].reason != ErrorReason.STEP_FAILED
    assert engine.release(["nan"]) == 0 and engine.runner.free_slots == free


def _raise(*args: object) -> None:
    raise RuntimeError("injected")


def test_a_cached_prefix_is_taken_once_before_the_chunks(checkpoints: tuple[Path, Path]) -> None:
    engine = _engine(checkpoints[0], kv_block_size=4, prefix_caching=True)
    sampling = SamplingParams(1.0, seed=3)
    first, _ = engine.admit_decoding(AdmitRequest("a", PROMPT, sampling))
    engine.release(["a"])
    before = engine.prefix_cache_stats
    assert before is not None
    got, calls = _chunked(engine, AdmitRequest("b", PROMPT, sampling), 3)
    after = engine.prefix_cache_stats
    assert after is not None
    asked = after.queried_tokens - before.queried_tokens
    assert asked == len(PROMPT), "the prompt was asked for once"
    assert after.hit_tokens - before.hit_tokens == 20, "every full block before the last token"
    assert calls == 1, "the 3 tokens past the cached 20 in one chunk"
    assert got.token_ids == first.token_ids


def test_running_requests_step_between_a_long_prompts_chunks(
    checkpoints: tuple[Path, Path], reference: ModelRunner
) -> None:
    with hub_services(*checkpoints, prefill_chunk_tokens=4) as svc:
        driver = Driver(svc.target_address, max_new_tokens=60)
        driver.admit(
            "running", list(PROMPT[:6]), "off", 0
        )  # a token a step: it outlasts the chunks
        driver.until(lambda: len(driver.reports) >= 2)
        long_prompt = list(PROMPT * 3)[:60]  # 15 chunks of 4
        driver.admit("long", long_prompt, "draft", 3)
        seen = len(driver.reports)
        driver.until(lambda: driver.records["long"].admitted is not None)
        between = [r for r in driver.reports[seen:]
                   if "running" in {e.request_id for e in r.events}]  # fmt: skip
        assert len(between) >= 10, f"only {len(between)} steps while 15 chunks were prefilled"
        assert isinstance(driver.records["long"].admitted, Admitted)
        # a release while a prompt is in its chunks is answered, and frees it on both services
        driver.records["gone"] = driver.records["long"].__class__(list(long_prompt), "draft", [])
        driver.client.admit(_admission("gone", long_prompt))
        driver.client.release(["gone"])
        driver.records["gone"].done = True
        driver.run()
        assert svc.target_engine.release(["gone"]) == 0
        assert svc.draft_engine.release(["gone"]) == 0
        driver.client.close()
    for rid in ("running", "long"):
        rec = driver.records[rid]
        assert rec.error is None, rec.error
        want = greedy_reference(reference, rec.prompt, len(rec.generated))
        assert rec.generated == want, rid


def _admission(rid: str, prompt: list[int]) -> Any:
    from orchestrator.core.pair import PairAdmission

    return PairAdmission(rid, tuple(prompt), SamplingParams(0.0), "draft", 3)


def test_a_negative_chunk_is_refused(checkpoints: tuple[Path, Path]) -> None:
    with pytest.raises(ValueError, match="prefill_chunk_tokens must be >= 0"):
        TargetConfig(runner_config(checkpoints[0]), prefill_chunk_tokens=-1)


def test_a_prompt_the_blocks_cannot_hold_yields_to_the_running_requests(
    checkpoints: tuple[Path, Path],
) -> None:
    """Chunk by chunk, a prompt larger than the free blocks would take those the running
    requests' next steps need, and they would fail first; it is refused instead, before it takes
    any (as a whole prefill that does not fit is), and the running request steps on."""
    from specdec.errors import CacheFullError

    engine = _engine(checkpoints[0], kv_block_size=4, kv_blocks=12, prefix_caching=False)
    engine.admit_decoding(AdmitRequest("run", PROMPT[:9], SamplingParams(0.0)))
    free = engine.runner.free_kv_blocks
    long_prompt = (PROMPT * 2)[:44]  # 11 blocks, more than the 9 free
    with pytest.raises(CacheFullError, match="No free KV blocks"):
        engine.begin_prefill(AdmitRequest("long", long_prompt, SamplingParams(0.0)))
    assert engine.runner.free_kv_blocks == free and engine.release(["long"]) == 0
    for step in (1, 2, 3):
        _k0_step(engine, "run", step)
    fits, _ = _chunked(engine, AdmitRequest("fits", PROMPT[:20], SamplingParams(0.0)), 4)
    assert not fits.errors
