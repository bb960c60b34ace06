"""The system benchmark's checkpoints of the larger pairs: written tensor by tensor
(`bench.e2e_models._stream`), loadable by the services' loader, one tokenizer for a pair."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import e2e_models
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig


def test_each_pair_names_shapes_a_tensor_parallel_split_takes() -> None:
    from specdec.tensor_parallel import config_split_problem

    for pair in ("70b", "32b"):
        plans = e2e_models.plan(False, pair)
        target, draft = plans["target"], plans["draft"]
        assert target[3]["stream"] and target[3]["tokenizer_vocab"] == draft[3]["tokenizer_vocab"]
        for world in (2, 4):
            assert config_split_problem(target[2], world) is None, (pair, world)
    assert e2e_models.plan(False, "32b")["target"][3]["tokenizer_vocab"] == 151665
    assert "stream" not in e2e_models.plan(False, "8b")["target"][3]  # the cached 8B as before


def test_prompts_hold_only_ids_the_pairs_tokenizer_has() -> None:
    """The 32B pair's tokenizer (151,665) is smaller than its target's embedding (152,064):
    the services refuse ids past the tokenizer, so the benchmark's prompts stay inside it (its
    first 32B run drew 151,964 and was refused)."""
    assert e2e_models.prompt_vocab(False, "32b") == 151665
    assert (
        e2e_models.prompt_vocab(False, "70b")
        == e2e_models.plan(False, "70b")["target"][3]["tokenizer_vocab"]
    )
    assert e2e_models.prompt_vocab(False, "8b") == 128256
    assert e2e_models.prompt_vocab(True) == e2e_models.plan(True)["target"][2]["vocab_size"]


@pytest.mark.parametrize("family", ["LlamaConfig", "Qwen2Config"])
def test_a_streamed_checkpoint_loads_on_the_fast_path(family: str, tmp_path: Path) -> None:
    spec = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=family == "Qwen2Config")  # fmt: skip
    made = {"std": 0.1, "dtype": "float32", "seed": 3, "stream": True}
    out = tmp_path / "model"
    e2e_models._stream(family, spec, made, "cpu", out, shard_bytes=4096)
    e2e_models.tokenizer(90).save_pretrained(str(out))
    assert len(list(out.glob("*.safetensors"))) > 1, "written in several files"
    runner = ModelRunner.load(RunnerConfig(str(out), max_slots=1, max_seq_len=32))
    assert runner.info.fast_path and runner.vocab_size == 96
    runner.add_request("r")
    logits = runner.forward([ForwardItem("r", [1, 2, 3], 1)])
    assert logits.shape == (1, 96) and bool(logits.isfinite().all())


def _build_smoke(cache: str) -> dict[str, str]:
    return e2e_models.build(Path(cache), True, "cpu")


def test_two_processes_building_one_cache_both_get_the_checkpoints(tmp_path: Path) -> None:
    """Two benchmarks on two GPUs of one host built one cache directory at once, and one
    removed the other's half-written files (a device run of 2026-11-28): each process now
    writes its own, the first to finish installs it and the other keeps that one."""
    import multiprocessing

    cache = tmp_path / "cache"
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        got = pool.map(_build_smoke, [str(cache), str(cache)])
    assert got[0] == got[1]
    for path in got[0].values():
        assert (Path(path) / e2e_models.SPEC_FILE).is_file()
        assert any(Path(path).glob("*.safetensors"))
    assert not list(cache.glob("*.partial*"))  # nothing half-written left behind
    again = e2e_models.build(cache, True, "cpu")  # and it is taken as built
    assert again == got[0]


def test_a_build_that_finishes_while_another_writes_leaves_its_files_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race above made certain: while the first build writes its target (its weights
    written, its tokenizer next), a second build of the same cache runs to its end. The
    first's files are still where it wrote them, and it completes and keeps the installed
    checkpoint."""
    cache = tmp_path / "cache"
    tokenizer, nested = e2e_models.tokenizer, []

    class Racing:
        def __init__(self, vocab: int) -> None:
            self.inner = tokenizer(vocab)

        def save_pretrained(self, where: str) -> None:
            if not nested:  # the first build's first tokenizer: the second build, whole, now
                nested.append(None)
                nested[0] = e2e_models.build(cache, True, "cpu")
                assert any(Path(where).glob("*.safetensors")), "the other build removed them"
            self.inner.save_pretrained(where)

    monkeypatch.setattr(e2e_models, "tokenizer", Racing)
    first = e2e_models.build(cache, True, "cpu")
    assert first == nested[0]
    for path in first.values():
        assert (Path(path) / e2e_models.SPEC_FILE).is_file()
        assert any(Path(path).glob("*.safetensors"))
    assert not list(cache.glob("*.partial*"))


def test_a_failed_build_leaves_nothing_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build that fails (or is killed) removes its own directory: a 32B build left behind
    would fill a device machine's disk."""
    cache = tmp_path / "cache"

    def broken(vocab: int) -> object:
        raise OSError("disk full")

    monkeypatch.setattr(e2e_models, "tokenizer", broken)
    with pytest.raises(OSError, match="disk full"):
        e2e_models.build(cache, True, "cpu")
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == []


def test_installed_checkpoints_are_readable_by_others(tmp_path: Path) -> None:
    """The default cache is shared under /tmp: a checkpoint is not its builder's alone."""
    for path in e2e_models.build(tmp_path / "cache", True, "cpu").values():
        assert Path(path).stat().st_mode & 0o755 == 0o755
