"""Configuration of the draft service."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specdec.limits import DEFAULT_MAX_NUM_DRAFT_TOKENS, MAX_NUM_DRAFT_TOKENS, check_draft_ahead
from specdec.runner import RunnerConfig
from specdec.serving.ngram import NgramConfig
from specdec.serving.server import ServerConfig
from specdec.synthetic_keys import spread_around


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """The proposer (a draft model or n-gram prompt lookup), q's form, and limits.

    proposer "model" needs `runner`; "ngram" needs `tokenizer_path` (a local directory with the
    tokenizer that target and draft share) and sends no q. q_form "sparse" sends the draft's top
    `support_size` tokens (intersected with the request's top-k / top-p, renormalised): the
    exact q it sampled from; "dense" sends q over the whole vocabulary.
    """

    proposer: Literal["model", "ngram"] = "model"
    runner: RunnerConfig | None = None
    tokenizer_path: str | None = None
    ngram: NgramConfig = field(default_factory=NgramConfig)
    q_form: Literal["dense", "sparse"] = "sparse"
    support_size: int = 32
    max_num_draft_tokens: int = DEFAULT_MAX_NUM_DRAFT_TOKENS
    max_requests: int = 256  # n-gram only; a model holds runner.max_slots
    # draft-ahead (draft_service.ahead): guesses per accepted count (0: off), and how many of
    # the runner's KV slots are kept for the hypotheses (requests get the others)
    draft_ahead: int = 0
    draft_ahead_slots: int = 0
    # with draft-ahead, the fan-out spread over the accepted counts and the guesses' ranks by
    # the verdicts seen (ahead.spread): as many hypotheses a pass as a fixed F drafts, the
    # likeliest of up to 2F guesses a position. Off: F guesses for every likely count
    draft_ahead_spread: bool = False
    # with draft-ahead, whether an ask that had chains drafted ahead, none for its verdict,
    # gets a backup proposal of no drafts (the step does not wait; its drafts are made ahead
    # for the next step): "auto" where that commits more tokens per second
    # (ahead.BackupChoice), "always", or "never" (drafted now, as without draft-ahead). Seeded
    # sampled requests never do, nor a step that drafts now for another request anyway.
    draft_ahead_backup: Literal["auto", "always", "never"] = "auto"
    # Saguaro sampling (draft_service.sampling), with draft_ahead: the draft samples from q with
    # its draft_ahead + 1 most likely tokens scaled by this and renormalised, and sends that q,
    # so a rejection's token is more often one it guessed. 1: off. Exact for any value.
    saguaro_scale: float = 1.0
    # BENCHMARKING ONLY (with the target's synthetic acceptance, whose verdicts ignore the
    # drafts): an ask finds its chain drafted ahead with this probability whatever its verdict
    # token, so a benchmark on random weights sets the hit rate. None: real hits only.
    synthetic_hit_rate: float | None = None
    # BENCHMARKING ONLY, mixed traffic: each request's own hit rate, uniform in [h - spread,
    # h + spread] by a hash of its id (0: every request at h)
    synthetic_hit_rate_spread: float = 0.0

    @property
    def guess_count(self) -> int:
        """How many of its most likely ids the draft keeps at each position for draft-ahead's
        guesses: F + 1 (F besides a draft it may reject), 2F + 1 with the spread."""
        return (2 if self.draft_ahead_spread else 1) * self.draft_ahead + 1

    def hit_rate_for(self, request_id: str) -> float | None:
        """BENCHMARKING ONLY: the synthetic hit rate of this request (None: real hits only)."""
        rate = self.synthetic_hit_rate
        if rate is None:
            return None
        return spread_around(rate, self.synthetic_hit_rate_spread, request_id, "hit", 0.0, 1.0)

    # BENCHMARKING ONLY: the times file of `draft_service.stand_in`; the runner is then the
    # stand-in, which waits the measured forward times on no GPU and drafts no model's tokens
    stand_in: str | None = None
    # chunked prefill: an admission's prompt longer than this is prefilled this many tokens at
    # a time, the engine's lock let go between chunks, so proposals for the running requests
    # are served meanwhile (0: whole)
    prefill_chunk_tokens: int = 0
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        if self.proposer not in ("model", "ngram"):
            raise ValueError(f"proposer must be 'model' or 'ngram', got {self.proposer!r}.")
        if self.proposer == "model" and self.runner is None:
            raise ValueError("proposer 'model' needs a runner config (the draft checkpoint).")
        if self.proposer == "ngram" and self.tokenizer_path is None:
            raise ValueError("proposer 'ngram' needs tokenizer_path (the shared tokenizer).")
        if self.q_form not in ("dense", "sparse"):
            raise ValueError(f"q_form must be 'dense' or 'sparse', got {self.q_form!r}.")
        if self.support_size < 1:
            raise ValueError(f"support_size must be >= 1, got {self.support_size}.")
        if not 1 <= self.max_num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
            raise ValueError(
                f"max_num_draft_tokens must be in [1, {MAX_NUM_DRAFT_TOKENS}], "
                f"got {self.max_num_draft_tokens}."
            )
        if self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}.")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(
                f"prefill_chunk_tokens must be >= 0 (0: prompts prefilled whole), "
                f"got {self.prefill_chunk_tokens}."
            )
        check_draft_ahead(self.draft_ahead, self.saguaro_scale, self.synthetic_hit_rate,
                          self.synthetic_hit_rate_spread, self.draft_ahead_spread)  # fmt: skip
        if self.draft_ahead_backup not in ("auto", "always", "never"):
            raise ValueError(
                "draft_ahead_backup must be 'auto', 'always' or 'never', "
                f"got {self.draft_ahead_backup!r}."
            )
        if self.draft_ahead and self.proposer != "model":
            raise ValueError("draft_ahead needs proposer 'model' (prompt lookup costs nothing).")
        if self.stand_in is not None and self.proposer != "model":
            raise ValueError("stand_in stands in for a draft model: it needs proposer 'model'.")
        slots = self.runner.max_slots if self.runner is not None else 0
        if self.draft_ahead and not 1 <= self.draft_ahead_slots < slots:
            raise ValueError(
                f"draft_ahead_slots must be in [1, runner.max_slots - 1 = {slots - 1}] when "
                f"draft_ahead is on, got {self.draft_ahead_slots}."
            )
