"""Checkpoints for the system benchmark, built locally (nothing is downloaded).

Target and draft have the shapes of Llama-3.1-8B and Llama-3.2-1B (`runner_bench.MODELS`:
hidden 4096 / 2048, layers 32 / 16, heads 32 / 32, KV heads 8 / 8, intermediate 14336 / 8192,
llama3 rope scaling, vocabulary 128,256, tied embeddings on the 1B) with random weights (normal,
std 0.02: logits stay finite through 32 layers), built on the GPU and saved in safetensors with
one shared WordLevel tokenizer of 128,256 generated symbols. The services then load them through
their real loading path. A finished checkpoint is reused: `spec.json` records what was built.

`--smoke` uses a tiny pair instead, whose draft is the target plus noise, so drafts are
accepted often enough to exercise the acceptance path of the greedy check.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.runner_bench import MODELS, SMOKE

TARGET, DRAFT = "Llama-3.1-8B", "Llama-3.2-1B"
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


def plan(smoke: bool) -> dict[str, tuple[str, dict[str, Any], dict[str, Any]]]:
    """role → (checkpoint name, LlamaConfig arguments, how the weights are made)."""
    if smoke:
        spec = dict(SMOKE)
        made = {"std": SMOKE_INIT_STD, "seed": 0, "dtype": "float32"}
        return {
            "target": (SMOKE_TARGET, spec, made),
            "draft": (SMOKE_DRAFT, spec, made | {"noise": SMOKE_DRAFT_NOISE}),
        }
    made = {"std": INIT_STD, "dtype": "bfloat16"}
    return {
        "target": (TARGET, MODELS[TARGET], made | {"seed": 0}),
        "draft": (DRAFT, MODELS[DRAFT], made | {"seed": 1}),
    }


def _ready(path: Path, record: dict[str, Any]) -> bool:
    spec = path / SPEC_FILE
    return spec.is_file() and json.loads(spec.read_text()) == record


def _random_model(spec: dict[str, Any], made: dict[str, Any], device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**spec)
    config.architectures = ["LlamaForCausalLM"]
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


def build(cache: Path, smoke: bool, device: str) -> dict[str, str]:
    """role → checkpoint directory, building what `cache` does not already hold."""
    paths = {}
    for role, (name, spec, made) in plan(smoke).items():
        path = cache / name
        record = {"spec": spec, "made": made}
        if not _ready(path, record):
            partial = path.with_name(path.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            model = _random_model(spec, made, device)
            model.save_pretrained(str(partial))
            tokenizer(spec["vocab_size"]).save_pretrained(str(partial))
            (partial / SPEC_FILE).write_text(json.dumps(record))
            del model
            shutil.rmtree(path, ignore_errors=True)
            partial.rename(path)
        paths[role] = str(path)
    return paths
