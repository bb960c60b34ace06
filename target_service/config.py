"""Configuration of the target service."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from specdec.limits import (
    DEFAULT_MAX_NUM_DRAFT_TOKENS,
    MAX_DRAFT_DEADLINE_S,
    MAX_NUM_DRAFT_TOKENS,
)
from specdec.runner import RunnerConfig
from specdec.serving.server import ServerConfig
from target_service.synthetic import SyntheticAcceptance


@dataclass(frozen=True, slots=True)
class TargetConfig:
    """The target model, the server, and the verify limits.

    `max_support_size` is the largest sparse-q support (ids per draft token) a block may carry.
    `synthetic`, for benchmarking only, replaces the acceptance test with configured rates: the
    output is then NOT distributed as the target's.
    """

    runner: RunnerConfig
    server: ServerConfig = field(default_factory=ServerConfig)
    max_num_draft_tokens: int = DEFAULT_MAX_NUM_DRAFT_TOKENS
    # Address of the draft service to check at start-up (tokenizer compatibility); optional.
    draft_address: str | None = None
    draft_wait_s: float = 30.0
    # A Propose the draft has not answered after this long (or DEADLINE_FACTOR times the median
    # recent round trip, where longer) is given up: the step goes on at k = 0 and the draft is
    # resynchronised once it answers again (target_service.hub_draft).
    draft_deadline_s: float = 0.3
    # Take the chains a draft drafting ahead pushes before they are asked for: where every
    # verdict of a step has one, the next verify starts without waiting for the draft's answer
    # (target_service.hub_draft.DraftSide.from_push). Pushes are asked for where they make the
    # hub wait less than asks, as measured (hub_draft.PushChoice); `draft_push_always` asks
    # for them with every block (tests of the pushed path; comparisons).
    draft_push_chains: bool = True
    draft_push_always: bool = False
    # TLS of the hub's channel to its draft: the CA (PEM) it trusts and, since the draft
    # listens on a node IP, the name it checks in the draft's certificate. Plaintext if None.
    draft_tls_root_cert: Path | None = None
    draft_tls_server_name: str | None = None
    # mutual TLS: the certificate (chain) and key the hub presents to its draft
    draft_tls_client_cert: Path | None = None
    draft_tls_client_key: Path | None = None
    sampler_impl: Literal["auto", "triton", "torch"] = "auto"
    max_support_size: int = 1024
    synthetic: SyntheticAcceptance | None = None
    # the hub chooses each step's k (target_service.speculation); requests' k are upper bounds
    dynamic_speculation: bool = False
    # chunked prefill: a new request's prompt longer than this is prefilled this many tokens
    # at a time, one chunk between two steps, so running requests keep stepping (0: whole)
    prefill_chunk_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prefill_chunk_tokens < 0:
            raise ValueError(
                f"prefill_chunk_tokens must be >= 0 (0: prompts prefilled whole), "
                f"got {self.prefill_chunk_tokens}."
            )
        if not 1 <= self.max_num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
            raise ValueError(
                f"max_num_draft_tokens must be in [1, {MAX_NUM_DRAFT_TOKENS}], "
                f"got {self.max_num_draft_tokens}."
            )
        if self.sampler_impl not in ("auto", "triton", "torch"):
            raise ValueError(
                f"sampler_impl must be 'auto', 'triton' or 'torch', got {self.sampler_impl!r}."
            )
        if self.max_support_size < 1:
            raise ValueError(f"max_support_size must be >= 1, got {self.max_support_size}.")
        if self.synthetic is not None and (
            self.synthetic.num_draft_tokens > self.max_num_draft_tokens
        ):
            raise ValueError(
                f"synthetic acceptance's num_draft_tokens must be in [1, max_num_draft_tokens="
                f"{self.max_num_draft_tokens}], got {self.synthetic.num_draft_tokens}."
            )
        if self.draft_wait_s < 0:
            raise ValueError(f"draft_wait_s must be >= 0, got {self.draft_wait_s}.")
        if not 0 < self.draft_deadline_s <= MAX_DRAFT_DEADLINE_S:
            raise ValueError(
                f"draft_deadline_s must be in (0, {MAX_DRAFT_DEADLINE_S:g}] seconds, "
                f"got {self.draft_deadline_s}."
            )
        if self.draft_tls_server_name is not None and self.draft_tls_root_cert is None:
            raise ValueError("draft_tls_server_name needs draft_tls_root_cert (TLS to the draft).")
        if (self.draft_tls_client_cert is None) != (self.draft_tls_client_key is None):
            raise ValueError(
                "draft_tls_client_cert and draft_tls_client_key go together (or neither)."
            )
        if self.draft_tls_client_cert is not None and self.draft_tls_root_cert is None:
            raise ValueError("draft_tls_client_cert needs draft_tls_root_cert (TLS to the draft).")
