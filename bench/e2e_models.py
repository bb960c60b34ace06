"""Checkpoints for the system benchmark, built locally (nothing is downloaded).

Target and draft have the shapes of Llama-3.1-8B and Llama-3.2-1B (`runner_bench.MODELS`:
hidden 4096 / 2048, layers 32 / 16, heads 32 / 32, KV heads 8 / 8, intermediate 14336 / 8192,
llama3 rope scaling, vocabulary 128,256, tied embeddings on the 1B) with random weights (normal,
std 0.02: logits stay finite through 32 layers), built on the GPU and saved in safetensors with
one shared WordLevel tokenizer of 128,256 generated symbols. The services then load them through
their real loading path. A finished checkpoint is reused: `spec.json` records what was built.

`--smoke` uses a tiny pair instead, whose draft is the target plus noise, so drafts are
accepted often enough to exercise the acceptance path of the greedy check.

`--pair` picks larger shapes for a target split over several GPUs (`PAIRS`): Llama-3.1-70B with
Llama-3.2-1B, or Qwen2.5-32B with Qwen2.5-0.5B. Those are written tensor by tensor (`_stream`):
a 70B model is 141 GB, more than a GPU or the host's memory would hold at once, and no
checkpoint ever needs to be in memory whole, since the services read their slices of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.runner_bench import MODELS, SMOKE

TARGET, DRAFT = "Llama-3.1-8B", "Llama-3.2-1B"
QWEN_ROPE = dict(rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6)
# the larger shapes, from their config.json: (config class, arguments)
LARGE: dict[str, tuple[str, dict[str, Any]]] = {
    "Llama-3.1-70B": ("LlamaConfig", MODELS[TARGET] | dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8)),
    # one tokenizer for the pair (151,665 ids), each embedding padded as released
    "Qwen2.5-32B": ("Qwen2Config", QWEN_ROPE | dict(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False)),
    "Qwen2.5-0.5B": ("Qwen2Config", QWEN_ROPE | dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)),
}  # fmt: skip
QWEN_TOKENIZER_VOCAB = 151665
# pair name -> (target, draft)
PAIRS = {"8b": (TARGET, DRAFT), "70b": ("Llama-3.1-70B", DRAFT), "32b": ("Qwen2.5-32B",
         "Qwen2.5-0.5B")}  # fmt: skip
DEFAULT_PAIR = "8b"
SMOKE_TARGET, SMOKE_DRAFT = "smoke-target", "smoke-draft"
SPEC_FILE = "spec.json"
# the checkpoints' default folder: one per user, since a cache another user wrote is not this
# one's to read or replace (a fresh clone's tests failed on root's 0600 weights files)
DEFAULT_CACHE = Path(tempfile.gettempdir()) / f"specdec_e2e_models-{os.getuid()}"
INIT_STD = 0.02
SMOKE_INIT_STD = 0.1  # a peaked tiny model: acceptance and greedy gaps well above fp32 noise
SMOKE_DRAFT_NOISE = 0.05


def tokenizer(vocab_size: int) -> Any:
    """A WordLevel tokenizer over "[UNK]", "t1" .. "t{vocab_size - 1}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0} | {f"t{i}": i for i in range(1, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def plan(
    smoke: bool, pair: str = DEFAULT_PAIR
) -> dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """role → (checkpoint name, config class, its arguments, how the weights are made)."""
    if smoke:
        spec = dict(SMOKE)
        made = {"std": SMOKE_INIT_STD, "seed": 0, "dtype": "float32"}
        return {
            "target": (SMOKE_TARGET, "LlamaConfig", spec, made),
            "draft": (SMOKE_DRAFT, "LlamaConfig", spec, made | {"noise": SMOKE_DRAFT_NOISE}),
        }
    made = {"std": INIT_STD, "dtype": "bfloat16"}
    shapes = [LARGE.get(name, ("LlamaConfig", MODELS.get(name, {}))) for name in PAIRS[pair]]
    if pair != DEFAULT_PAIR:  # written tensor by tensor, one tokenizer for both: the smaller
        # embedding's size, at most the released tokenizer's
        sizes = [spec["vocab_size"] for _, spec in shapes]
        vocab = min([*sizes, QWEN_TOKENIZER_VOCAB] if pair == "32b" else sizes)
        made |= {"stream": True, "tokenizer_vocab": vocab}
    return {
        role: (name, family, spec, made | {"seed": seed})
        for seed, (role, name, (family, spec)) in enumerate(
            zip(("target", "draft"), PAIRS[pair], shapes, strict=True)
        )
    }


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line on these checkpoints: --out (required), --cache and
    --smoke (the tiny pair on the CPU); the benchmark adds its own flags."""
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=doc, formatter_class=raw)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--smoke", action="store_true", help="the tiny pair on the CPU")
    return p


def prompt_vocab(smoke: bool, pair: str = DEFAULT_PAIR) -> int:
    """The token ids a prompt may hold for `pair`: the shared tokenizer's size where the pair
    has one smaller than the target's embedding (the services refuse ids past it), else the
    target's vocabulary."""
    _, _, spec, made = plan(smoke, pair)["target"]
    return int(made.get("tokenizer_vocab", spec["vocab_size"]))


def _ready(path: Path, record: dict[str, Any]) -> bool:
    spec = path / SPEC_FILE
    return spec.is_file() and json.loads(spec.read_text()) == record


def _hf_config(family: str, spec: dict[str, Any]) -> Any:
    """The transformers config of class `family` (e.g. "Qwen2Config") with `spec`."""
    import transformers

    config = getattr(transformers, family)(**spec)
    config.architectures = [family.replace("Config", "ForCausalLM")]
    return config


def _write(family: str, spec: dict[str, Any], made: dict[str, Any], device: str, out: Path) -> None:
    """The checkpoint's weights and tokenizer into `out`."""
    if made.get("stream"):
        _stream(family, spec, made, device, out)
    else:
        model = _random_model(family, spec, made, device)
        model.save_pretrained(str(out))
        del model
    tokenizer(made.get("tokenizer_vocab", spec["vocab_size"])).save_pretrained(str(out))


def _install(partial: Path, path: Path, record: dict[str, Any]) -> None:
    """`partial`, complete, becomes `path`, under a lock of the cache directory; where another
    process has meanwhile installed the same checkpoint there, that one is kept and
    `partial` removed."""
    import fcntl

    with (path.parent / ".install.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _ready(path, record):
            shutil.rmtree(partial, ignore_errors=True)
            return
        shutil.rmtree(path, ignore_errors=True)  # an older or unfinished checkpoint
        partial.rename(path)


def _free_cached() -> None:
    """The blocks the build left in this process's caching allocator given back: a caller
    that goes on to start the services on this GPU (chunked_prefill_bench, ttft_bench) found
    15 GiB of it held by the 8B's build, and the services ran out of memory."""
    import gc

    import torch

    if torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def _random_model(family: str, spec: dict[str, Any], made: dict[str, Any], device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    config = _hf_config(family, spec)
    dtype = getattr(torch, made["dtype"])
    with torch.device(device):  # built in place where transformers honours the context
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().to(device)
    gen = torch.Generator(device=device).manual_seed(made["seed"])
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, made["std"], generator=gen)
            else:  # RMSNorm scales
                p.fill_(1.0)
        if made.get("noise"):
            for p in model.parameters():
                noise = torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype)
                p.add_(made["noise"] * noise * p.abs().mean())
    return model


SHARD_BYTES = 4 << 30  # the streamed checkpoints' files


def _stream(
    family: str,
    spec: dict[str, Any],
    made: dict[str, Any],
    device: str,
    out: Path,
    shard_bytes: int = SHARD_BYTES,
) -> None:
    """A random checkpoint written tensor by tensor into files of about SHARD_BYTES: the
    model's names and shapes from a model on the meta device; matrices normal(0, std), norms
    1, biases 0; generated on `device`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    config = _hf_config(family, spec)
    config.torch_dtype = made["dtype"]
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(p.shape) for name, p in meta.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    dtype = getattr(torch, made["dtype"])
    gen = torch.Generator(device=device).manual_seed(made["seed"])
    out.mkdir(parents=True)
    config.save_pretrained(str(out))
    shard: dict[str, torch.Tensor] = {}
    size, index = 0, 0

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            save_file(shard, str(out / f"model-{index:05d}.safetensors"), {"format": "pt"})
            shard, size, index = {}, 0, index + 1

    for name, shape in shapes.items():
        if len(shape) >= 2:
            t = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, made["std"],
                                                                       generator=gen)  # fmt: skip
        elif name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype, device=device)
        else:  # biases
            t = torch.zeros(shape, dtype=dtype, device=device)
        shard[name] = t.cpu()
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            flush()
    flush()


def build(cache: Path, smoke: bool, device: str, pair: str = DEFAULT_PAIR) -> dict[str, str]:
    """role → checkpoint directory, building what `cache` does not already hold."""
    paths = {}
    for role, (name, family, spec, made) in plan(smoke, pair).items():
        # a streamed checkpoint of the default pair's draft is not the default pair's
        path = cache / (name if smoke or pair == DEFAULT_PAIR else f"{pair}-{name}")
        record: dict[str, Any] = {"spec": spec, "made": made}
        if family != "LlamaConfig":
            record["family"] = family
        if not _ready(path, record):
            # a directory of this build's own: two benchmarks building one cache at once (say,
            # on two GPUs of one host) each write their own, and the first to finish wins
            cache.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkdtemp(prefix=f"{path.name}.partial-", dir=cache))
            partial.chmod(0o755)  # as a plain directory: mkdtemp's is its owner's alone
            try:
                _write(family, spec, made, device, partial)
                (partial / SPEC_FILE).write_text(json.dumps(record))
                _install(partial, path, record)
            except BaseException:  # a failed or killed build leaves no half-written copy
                shutil.rmtree(partial, ignore_errors=True)
                raise
        paths[role] = str(path)
    if device.startswith("cuda"):
        _free_cached()
    return paths
