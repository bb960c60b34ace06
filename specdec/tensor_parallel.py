"""What splitting a checkpoint over N tensor-parallel ranks needs of it (`specdec.runner.parallel`
splits the attention heads, the KV heads and the MLP's width evenly). No torch import:
`specdec serve` checks a checkpoint's config.json with it before Ray starts, and the runner
before it reads a weight.
"""

from __future__ import annotations

from collections.abc import Mapping

MAX_TENSOR_PARALLEL = 64  # ranks of one node


def split_problem(heads: int, kv_heads: int, intermediate: int, world: int) -> str | None:
    """Why `world` ranks cannot split a model of these sizes evenly, or None if they can."""
    for name, n in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("intermediate_size", intermediate),
    ):
        if n % world:
            return (
                f"A tensor-parallel size of {world} does not divide the model's {name} ({n}); "
                f"use a size that divides {name}."
            )
    return None


def config_split_problem(config: Mapping[str, object], world: int) -> str | None:
    """`split_problem` for a checkpoint's config.json as a dict (None with world 1)."""
    if world == 1:
        return None
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    intermediate = config.get("intermediate_size")
    sizes = (heads, kv_heads, intermediate)
    if not all(isinstance(n, int) and n > 0 for n in sizes):
        return (
            "tensor parallelism needs num_attention_heads, num_key_value_heads and "
            "intermediate_size in the checkpoint's config.json (the Llama, Mistral, Qwen2 and "
            "Qwen3 families)."
        )
    return split_problem(*sizes, world)  # type: ignore[arg-type]
