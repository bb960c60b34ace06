"""Loading local checkpoints: round trips, the fallback path, and every bad-directory case."""

import json
import logging
from pathlib import Path

import pytest
import torch

from specdec.errors import CheckpointError
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from tests.specdec._runner_models import (
    TOKENIZER_VOCAB,
    hf_model,
    randomize,
    reference_logits,
    save_checkpoint,
    tiny_tokenizer,
)


def load(path: Path, **kw) -> ModelRunner:
    return ModelRunner.load(RunnerConfig(model_path=str(path), max_seq_len=64, **kw))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(hf_model("qwen3"), tmp_path_factory.mktemp("qwen3"))


def test_round_trip_loads_fast_path_with_padded_vocab(qwen3_dir: Path) -> None:
    runner = load(qwen3_dir)
    model = hf_model("qwen3")
    info = runner.info
    assert info.fast_path and info.architecture == "Qwen3ForCausalLM"
    assert (info.vocab_size, info.tokenizer_vocab_size, runner.vocab_size) == (300, 250, 300)
    assert len(info.tokenizer_hash) == 64 and runner.tokenizer.convert_tokens_to_ids("w7") == 7
    ids = runner.tokenizer("w3 w9 w200 w17 w42")["input_ids"]
    runner.add_request("a")
    out = runner.forward([ForwardItem("a", ids, len(ids))])
    torch.testing.assert_close(out, reference_logits(model, ids), atol=1e-4, rtol=0)


def test_tied_embeddings_round_trip(tmp_path: Path) -> None:
    model = hf_model("qwen2")
    assert model.config.tie_word_embeddings
    runner = load(save_checkpoint(model, tmp_path))
    runner.add_request("a")
    out = runner.forward([ForwardItem("a", [5, 6, 7], 3)])
    torch.testing.assert_close(out, reference_logits(model, [5, 6, 7]), atol=1e-4, rtol=0)


def test_tokenizer_hash_depends_on_the_vocabulary(qwen3_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model_hash = load(qwen3_dir).info.tokenizer_hash
    vocab = {"[UNK]": 0} | {f"v{i}": i for i in range(1, TOKENIZER_VOCAB)}
    other = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]")),
        unk_token="[UNK]",
    )
    hf_model("qwen3").save_pretrained(str(tmp_path))
    other.save_pretrained(str(tmp_path))
    assert load(tmp_path).info.tokenizer_hash != model_hash


def test_other_architectures_fall_back_to_transformers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    ).eval()
    randomize(model)
    save_checkpoint(model, tmp_path)
    with caplog.at_level(logging.WARNING):
        runner = load(tmp_path, max_slots=2)
    # Ours, once (transformers may add warnings of its own, e.g. 5.17 on the GPU image).
    ours = [r for r in caplog.records if r.name.startswith("specdec") and r.levelname == "WARNING"]
    assert len(ours) == 1 and "GPT2LMHeadModel" in ours[0].getMessage()
    assert not runner.info.fast_path
    a, b = [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]
    runner.add_request("a")
    runner.add_request("b")
    runner.forward([ForwardItem("a", a[:5], 0), ForwardItem("b", b[:1], 1)])
    runner.forward([ForwardItem("a", [0, 0], 2)])  # rejected drafts
    runner.truncate("a", 5)
    out = runner.forward([ForwardItem("a", a[5:], 3), ForwardItem("b", b[1:], 3)])
    want = torch.cat([reference_logits(model, a)[5:], reference_logits(model, b)[1:]])
    torch.testing.assert_close(out, want, atol=1e-4, rtol=0)
    steps = runner.graph_step(["a", "b"], torch.tensor([[1], [2]]))
    assert isinstance(steps, torch.Tensor) and steps.shape == (2, 1, 300)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _corrupt_weights(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"\x00" * 64)


def _truncate_weights(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _dangling_weights(d: Path) -> None:
    f = d / "model.safetensors"
    f.unlink()
    f.symlink_to(d / "gone.safetensors")  # listed, but cannot be opened


def _unknown_arch(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"model_type": "no_such_model"}))


BAD_DIRS = {
    "no config.json": lambda d: (d / "config.json").unlink(),
    "not valid JSON": lambda d: (d / "config.json").write_text("{not json"),
    "no \\*.safetensors": lambda d: (d / "model.safetensors").unlink(),
    "is corrupt": _corrupt_weights,
    "cannot be read|is corrupt": _truncate_weights,
    r"model.safetensors' cannot be read \(No such file": _dangling_weights,
    "architecture that transformers does not support": _unknown_arch,
    "tokenizer .* cannot be loaded": lambda d: (d / "tokenizer.json").unlink(),
}


@pytest.mark.parametrize("message", sorted(BAD_DIRS))
def test_bad_directories_raise_checkpoint_error(
    message: str, qwen3_dir: Path, tmp_path: Path
) -> None:
    d = _copy(qwen3_dir, tmp_path / "ckpt")
    BAD_DIRS[message](d)
    with pytest.raises(CheckpointError, match=message):
        load(d)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load(tmp_path / "absent")


def test_checkpoint_bigger_than_memory(qwen3_dir: Path) -> None:
    with pytest.raises(CheckpointError, match="GiB is available"):
        load(qwen3_dir, memory_limit_bytes=100_000)
    assert load(qwen3_dir, memory_limit_bytes=10_000_000).info.fast_path


def test_dtype_the_device_cannot_run(qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.Tensor.__matmul__

    def no_half(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.dtype == torch.float16:
            raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'")
        return real(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", no_half)
    with pytest.raises(CheckpointError, match="cannot run float16 matmuls"):
        load(qwen3_dir, dtype="float16")
    assert load(qwen3_dir, dtype="bfloat16").info.dtype == "bfloat16"


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="max_slots must be in"):
        RunnerConfig(model_path="x", max_slots=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        RunnerConfig(model_path="x", dtype="int8")
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        RunnerConfig(model_path="x", max_slots=4, cuda_graph_batch_sizes=(8,))


def test_tiny_tokenizer_is_local() -> None:
    assert len(tiny_tokenizer()) == TOKENIZER_VOCAB
