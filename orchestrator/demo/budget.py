"""What the demo trains and what a build leaves: the models' shapes (`LlamaShape`), the
budget (`DemoBudget`) and the cached pair (`DemoPair`). Its own module because both `models`
(which builds and caches the pair) and `training` (which trains it) need them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class LlamaShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"LlamaShape.{name} must be at least 1, got {getattr(self, name)}."
                )
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"LlamaShape needs hidden divisible by heads and heads by kv_heads, got hidden="
                f"{self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}."
            )


@dataclass(frozen=True, slots=True)
class DemoBudget:
    """What to train and for how many steps. Phases end by step count, never by time, so every
    machine trains the same pair from the same recipe (a slow one takes longer); the build
    records how long each phase took. The default's steps take about 3.5 minutes on two idle
    CPU cores, `ci()`'s a few seconds."""

    vocab_size: int = 1024
    seq_len: int = 128  # training window, and the checkpoints' max_position_embeddings
    batch_size: int = 16
    target: LlamaShape = field(default_factory=lambda: LlamaShape(4, 192, 6, 2, 512))
    draft: LlamaShape = field(default_factory=lambda: LlamaShape(1, 192, 6, 2, 512))
    # 2 CPU cores: about 0.3 s a target step, 0.2 s a draft step (it runs the target forward)
    target_steps: int = 450
    draft_steps: int = 300
    corpus_bytes: int = 0  # 0: every top-level source file; else the first files up to this
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if not 260 <= self.vocab_size <= 65536:
            raise ValueError(f"vocab_size must be in [260, 65536], got {self.vocab_size}.")
        if not 8 <= self.seq_len <= 4096:
            raise ValueError(f"seq_len must be in [8, 4096], got {self.seq_len}.")
        for name in ("batch_size", "target_steps", "draft_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}.")
        if self.corpus_bytes < 0:
            raise ValueError(f"corpus_bytes must be 0 (all) or positive, got {self.corpus_bytes}.")

    @classmethod
    def ci(cls) -> DemoBudget:
        """A tiny pair for tests and `specdec demo --quick`: seconds, not minutes."""
        return cls(
            vocab_size=512,
            seq_len=64,
            batch_size=8,
            target=LlamaShape(2, 64, 4, 2, 128),
            draft=LlamaShape(1, 64, 4, 2, 128),
            target_steps=150,
            draft_steps=100,
            corpus_bytes=600_000,
        )


@dataclass(frozen=True, slots=True)
class DemoPair:
    root: Path
    target: Path
    draft: Path

    @property
    def training(self) -> dict[str, Any]:
        """What the build measured (steps, seconds, losses), as written next to the models."""
        return dict(json.loads((self.root / "training.json").read_text()))
