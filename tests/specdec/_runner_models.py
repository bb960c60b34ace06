"""Tiny random checkpoints of each supported family, built locally (nothing is downloaded)."""

from pathlib import Path
from typing import Any

import torch

TOKENIZER_VOCAB = 250  # the models' embeddings have 300 rows: a padded vocabulary

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
    num_attention_heads=4,
)

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # llama 3: GQA, llama3 rope scaling, untied
    "llama3": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            rope_theta=500000.0,
        ),
    ),
    # llama 2: multi-head, tied embeddings, linear rope scaling
    "llama2": (
        "LlamaConfig",
        dict(
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    # mistral: GQA and a sliding window shorter than the test sequences
    "mistral": (
        "MistralConfig",
        dict(num_key_value_heads=1, sliding_window=6, tie_word_embeddings=False),
    ),
    # qwen2: q/k/v bias, GQA, tied
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    # qwen3: q/k norm, head_dim 32 != hidden / heads, untied
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
}


def hf_model(family: str, seed: int = 0) -> Any:
    """A transformers model of `family` with every parameter random (biases and norms too)."""
    import transformers

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**(BASE | extra))
    config.architectures = [cls_name.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    return model.eval()


def randomize(model: Any) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() >= 2:
                p.copy_(noise * 0.1)
            elif "norm" in name:
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(0.2 * noise)


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1} | {f"w{i}": i for i in range(2, TOKENIZER_VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def save_checkpoint(model: Any, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    tiny_tokenizer().save_pretrained(str(path))
    return path


def reference_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' own float32 logits [len(ids), vocab] for one whole sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()
