"""The benchmark's driver over in-process services: target-only steps (k = 0 blocks, the draft
never called) commit target-only greedy decoding and lock-step steps the same tokens; every
step's split comes from the services' own StepTiming and adds up to the step."""

from pathlib import Path

import pytest

from bench.e2e_driver import (
    SPLIT,
    PipelineDriver,
    Workload,
    compare,
    greedy_run,
    measure,
    prompts,
)
from specdec.runner import ModelRunner
from tests.draft_service.models import (
    greedy_reference,
    model_draft,
    runner_config,
    services,
)
from tests.specdec._runner_models import TOKENIZER_VOCAB


def test_target_only_and_lockstep_commit_greedy_decoding(checkpoints: tuple[Path, Path]) -> None:
    target_dir, draft_dir = checkpoints
    plain_work = Workload(3, 0, 6, TOKENIZER_VOCAB, warmup=0, steps=0)
    spec_work = Workload(3, 3, 6, TOKENIZER_VOCAB, warmup=0, steps=0)
    with services(target_dir, model_draft(draft_dir), sampler_impl="torch") as svc:
        plain = PipelineDriver(None, svc.target_address)
        with pytest.raises(ValueError, match="target-only pipeline"):
            plain.step({"nobody": 1})
        target_only = greedy_run(plain, plain_work, "plain", 6)
        plain.close()
        spec_driver = PipelineDriver(svc.draft_address, svc.target_address)
        steps: list[list[int]] = []
        spec = greedy_run(spec_driver, spec_work, "spec", 6, steps)
        spec_driver.close()
    record = compare(spec_work, target_only, spec, steps)
    assert record["passed"] and record["speculative_steps"] == steps and len(steps) == 3
    for n in steps:  # each step commits 1 to k + 1 tokens, until 6 are there
        assert all(1 <= x <= 4 for x in n) and sum(n) >= 6 and sum(n[:-1]) < 6
    reference = ModelRunner.load(runner_config(target_dir))
    for prompt, got in zip(prompts(3, 6, TOKENIZER_VOCAB, 1), target_only, strict=True):
        assert got == greedy_reference(reference, prompt, 6)


def test_compare_records_the_first_divergence() -> None:
    work = Workload(2, 4, 3, TOKENIZER_VOCAB, warmup=0, steps=0)
    record = compare(work, [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 7, 6]])
    assert not record["passed"]
    (d,) = record["divergences"]
    assert (d["request"], d["position"], d["prefix"]) == (1, 1, [4])
    assert (d["target_only_token"], d["speculative_token"]) == (5, 7)
    assert d["prompt"] == prompts(2, 3, TOKENIZER_VOCAB, 1)[1]


@pytest.mark.parametrize("k", [0, 3])
def test_measure_splits_each_step(checkpoints: tuple[Path, Path], k: int) -> None:
    target_dir, draft_dir = checkpoints
    work = Workload(2, k, 5, TOKENIZER_VOCAB, warmup=1, steps=4)
    with services(target_dir, model_draft(draft_dir), sampler_impl="torch") as svc:
        driver = PipelineDriver(svc.draft_address if k else None, svc.target_address)
        row = measure(driver, work, "m")
        driver.close()
    split = row["split_ms_mean"]
    assert set(split) == set(SPLIT) and row["steps"] == 4
    assert split["verify_forward"] > 0 and split["transport"] > 0 and split["sampler"] > 0
    assert (split["draft_forward"] > 0) == (k > 0)
    assert sum(split.values()) == pytest.approx(row["step_ms_mean"], rel=0.02)
    assert 1 <= row["tokens_per_step_per_request"] <= k + 1
    assert row["committed_tokens"] == round(row["tokens_per_step_per_request"] * 4 * 2)
