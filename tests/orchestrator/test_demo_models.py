"""The demo pair: trained (CI budget) into a temporary cache, loaded by the runner, cached."""

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from orchestrator.demo import models as demo_models
from orchestrator.demo import training as demo_training
from orchestrator.demo.models import DemoBudget, DemoPair, LlamaShape, build_demo_models
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig

TEXT = "def naïve(x):\n    return f'café → {x} 日本語 🐍'\n\tpass  \n"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> DemoPair:
    return build_demo_models(
        tmp_path_factory.mktemp("cache"), budget=DemoBudget.ci(), progress=False
    )


def runner(path: Path) -> ModelRunner:
    return ModelRunner.load(
        RunnerConfig(str(path), max_slots=2, max_seq_len=DemoBudget.ci().seq_len)
    )


def test_both_checkpoints_load_on_the_fast_path_with_one_tokenizer(pair: DemoPair) -> None:
    target, draft = runner(pair.target), runner(pair.draft)
    assert target.info.fast_path and draft.info.fast_path
    assert target.info.tokenizer_hash == draft.info.tokenizer_hash
    assert target.info.vocab_size == draft.info.vocab_size == DemoBudget.ci().vocab_size
    assert (pair.target / "tokenizer.json").read_bytes() == (
        pair.draft / "tokenizer.json"
    ).read_bytes()
    training = pair.training
    assert training["target"]["steps"] == DemoBudget.ci().target_steps
    assert training["draft"]["steps"] == DemoBudget.ci().draft_steps
    assert training["total_seconds"] >= training["target"]["seconds"] > 0


def test_a_slow_machine_trains_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phases end by step count: a machine whose steps take an hour each trains the same
    pair, only later; the time is recorded, not obeyed."""
    clock = iter(range(0, 10**6, 3600))
    monkeypatch.setattr(demo_training.time, "perf_counter", lambda: float(next(clock)))
    budget = DemoBudget.ci()
    model = demo_training.llama(budget.draft, budget, eos_id=0)
    data = torch.randint(0, budget.vocab_size, (1000,))
    batches = demo_training.batch_sampler(data, budget, seed=0)
    stats = demo_training.train_phase(
        model, demo_training.lm_loss(model), batches, budget, 5, "test", progress=False
    )
    assert stats.steps == 5 and stats.seconds >= 5 * 3600


def test_tokenizer_round_trips_multibyte_text(pair: DemoPair) -> None:
    tokenizer = runner(pair.target).tokenizer
    ids = tokenizer(TEXT).input_ids
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids
    assert len(ids) < len(TEXT.encode())  # merges were learned: fewer ids than bytes


def test_runner_greedy_equals_transformers_generate(pair: DemoPair) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(pair.target)).eval()
    run = runner(pair.target)
    prompt = run.tokenizer("import os\n\ndef main(argv):\n").input_ids
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0]
        ref_logits = model(torch.tensor([prompt])).logits[0]  # [p, vocab]
    run.add_request("a")
    logits = run.forward([ForwardItem("a", prompt, len(prompt))])  # [p, vocab]
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    got = list(prompt)
    for _ in range(8):
        got.append(int(logits[-1].argmax()))
        logits = run.forward([ForwardItem("a", got[-1:], 1)])
    assert got == want.tolist()


def test_cached_call_is_fast_and_returns_the_same_directories(pair: DemoPair) -> None:
    start = time.perf_counter()
    again = build_demo_models(pair.root.parent.parent, budget=DemoBudget.ci(), progress=False)
    assert time.perf_counter() - start < 1.0
    assert again == pair


def test_an_interrupted_build_leaves_no_cache_entry_and_trains_on_no_heldout_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Path] = []

    def fail(
        out: Path, budget: DemoBudget, files: list[Path], progress: bool, device: str = "cpu"
    ) -> dict[str, object]:
        seen.extend(files)
        (out / "target").mkdir()  # half-written, then interrupted
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_training, "train_pair", fail)
    with pytest.raises(KeyboardInterrupt):
        build_demo_models(tmp_path, budget=DemoBudget(), progress=False)
    assert list((tmp_path / "demo").iterdir()) == []
    everything = demo_models.source_files()
    held = {f for f in everything if demo_models.is_heldout(f)}
    assert 0 < len(held) < len(everything) // 5
    assert set(seen) == set(everything) - held


def test_cache_location_and_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPECDEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert demo_models.cache_root() == tmp_path / "specdec"
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "mine"))
    assert demo_models.cache_root() == tmp_path / "mine"
    ci = DemoBudget.ci()
    assert demo_models.cache_key(ci) == demo_models.cache_key(DemoBudget.ci())
    assert demo_models.cache_key(ci) != demo_models.cache_key(replace(ci, seed=1))


def test_budget_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="vocab_size must be in"):
        DemoBudget(vocab_size=10)
    with pytest.raises(ValueError, match="target_steps must be at least 1"):
        DemoBudget(target_steps=0)
    with pytest.raises(ValueError, match="divisible"):
        LlamaShape(1, 100, 3, 2, 64)


def test_heldout_prompts_start_at_definitions() -> None:
    files = demo_models.source_files()
    prompts = demo_training.heldout_prompts(files, demo_models.is_heldout, count=4)
    assert len(prompts) == 4
    assert all(p.lstrip().startswith(("def ", "class ")) and not p.endswith("\n") for p in prompts)


def test_replay_counts_the_leading_matches_of_each_step() -> None:
    right = [False, True, True, False, True, True, True, True, True, True]
    assert demo_training.replay(right, 1, 9, 4) == (2, 6)  # docstring's example
    assert demo_training.replay(right, 1, 9, 1) == (5, 4)  # k = 1: 1+1, then 0+1, 1+1, 1+1, 1+1
    assert demo_training.replay([False] * 6, 1, 6, 4) == (5, 0)  # never right: 1 token a step
    assert demo_training.replay([False] + [True] * 5, 1, 6, 8) == (1, 4)  # the last: the target's


def test_measured_acceptance_is_a_mean_length_between_1_and_k_plus_1(pair: DemoPair) -> None:
    report = demo_models.measure_acceptance(pair, ["def f(x):", "class A:"], k=4, new_tokens=12)
    assert report.prompts == 2 and report.committed_tokens > report.verify_steps > 0
    assert 1.0 <= report.mean_acceptance_length <= 5.0
    per_step = report.committed_tokens / report.verify_steps
    assert report.mean_acceptance_length == pytest.approx(per_step)
    assert report.sample.startswith("def f(x):")


def test_a_pair_trained_on_a_gpu_has_a_cache_entry_of_its_own() -> None:
    """The benchmark's trained pair (`bench/trained_pair_bench.py`) is keyed by the device it
    trained on; the demo's CPU key is what it was before the device was known."""
    from orchestrator.demo.models import cache_key, recipe

    budget = DemoBudget.ci()
    assert cache_key(budget) == cache_key(budget, "cpu")
    assert "device" not in recipe(budget)
    assert cache_key(budget, "cuda") == cache_key(budget, "cuda:1") != cache_key(budget)
