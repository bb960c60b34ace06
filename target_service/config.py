"""Configuration of the target service."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specdec.runner import RunnerConfig
from specdec.serving.server import ServerConfig

MAX_NUM_DRAFT_TOKENS = 64


@dataclass(frozen=True, slots=True)
class TargetConfig:
    """The target model, the server, and the verify limits."""

    runner: RunnerConfig
    server: ServerConfig = field(default_factory=ServerConfig)
    max_num_draft_tokens: int = 16
    # Address of the draft service to check at start-up (tokenizer compatibility); optional.
    draft_address: str | None = None
    draft_wait_s: float = 30.0
    sampler_impl: Literal["auto", "triton", "torch"] = "auto"

    def __post_init__(self) -> None:
        if not 1 <= self.max_num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
            raise ValueError(
                f"max_num_draft_tokens must be in [1, {MAX_NUM_DRAFT_TOKENS}], "
                f"got {self.max_num_draft_tokens}."
            )
        if self.sampler_impl not in ("auto", "triton", "torch"):
            raise ValueError(
                f"sampler_impl must be 'auto', 'triton' or 'torch', got {self.sampler_impl!r}."
            )
        if self.draft_wait_s < 0:
            raise ValueError(f"draft_wait_s must be >= 0, got {self.draft_wait_s}.")
