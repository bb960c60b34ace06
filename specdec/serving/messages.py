"""Domain objects of the `specdec.v1` protocol, each with `from_pb` / `to_pb`.

`from_pb` checks shapes and sizes and raises `ValueError` with a sentence naming the field;
value checks that need the model (ids inside the vocabulary, q normalised) are the engines'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import grpc

from specdec.errors import InvalidInputError
from specdec.limits import INT32_MAX as INT32_MAX
from specdec.limits import MAX_COMMITTED_LENGTH, MAX_STEP, MAX_WIRE_NUM_DRAFT_TOKENS, check_range
from specdec.pb import common_pb2, draft_pb2
from specdec.sampling_params import SamplingParams


class ErrorReason(IntEnum):
    """Mirror of `specdec.v1.ErrorReason` (a test checks the two agree)."""

    UNSPECIFIED = 0
    UNKNOWN_REQUEST = 1
    STALE_STEP = 2
    DUPLICATE_STEP = 3
    FUTURE_STEP = 4
    COMMITTED_LENGTH_MISMATCH = 5
    DUPLICATE_ENTRY = 6
    INVALID_ARGUMENT = 7
    INVALID_DRAFT_PROBS = 8
    DRAFT_PROBS_NOT_NORMALIZED = 9
    DRAFT_TOKEN_OUT_OF_SUPPORT = 10
    TOKEN_OUT_OF_VOCAB = 11
    NONFINITE_LOGITS = 12
    CAPACITY = 13
    STEP_FAILED = 14


class QForm(IntEnum):
    """Mirror of `specdec.v1.QForm`: where an entry's q is (a test checks the two agree). The
    kernels take the plain ints (`target_service.kernels.Q_*`) as compile-time constants."""

    NONE = 0
    DENSE = 1
    SPARSE = 2


_Code = grpc.StatusCode
# The one reason → status table (the codes the proto's ErrorReason comments name).
REASON_CODES: dict[ErrorReason, grpc.StatusCode] = {
    ErrorReason.UNKNOWN_REQUEST: _Code.NOT_FOUND,
    ErrorReason.STALE_STEP: _Code.FAILED_PRECONDITION,
    ErrorReason.DUPLICATE_STEP: _Code.ALREADY_EXISTS,
    ErrorReason.FUTURE_STEP: _Code.FAILED_PRECONDITION,
    ErrorReason.COMMITTED_LENGTH_MISMATCH: _Code.FAILED_PRECONDITION,
    ErrorReason.DUPLICATE_ENTRY: _Code.INVALID_ARGUMENT,
    ErrorReason.INVALID_ARGUMENT: _Code.INVALID_ARGUMENT,
    ErrorReason.INVALID_DRAFT_PROBS: _Code.INVALID_ARGUMENT,
    ErrorReason.DRAFT_PROBS_NOT_NORMALIZED: _Code.INVALID_ARGUMENT,
    ErrorReason.DRAFT_TOKEN_OUT_OF_SUPPORT: _Code.INVALID_ARGUMENT,
    ErrorReason.TOKEN_OUT_OF_VOCAB: _Code.INVALID_ARGUMENT,
    ErrorReason.NONFINITE_LOGITS: _Code.INTERNAL,
    ErrorReason.CAPACITY: _Code.RESOURCE_EXHAUSTED,
    ErrorReason.STEP_FAILED: _Code.INTERNAL,
}


@dataclass(frozen=True, slots=True)
class RequestError:
    """Why one request of a block was not served."""

    reason: ErrorReason
    code: grpc.StatusCode
    message: str

    def __post_init__(self) -> None:
        assert self.reason != ErrorReason.UNSPECIFIED, "an error needs a reason"

    @classmethod
    def of(cls, reason: ErrorReason, message: str) -> RequestError:
        """The error with its reason's status code (`REASON_CODES`): what the engines build, so
        that they need not know gRPC."""
        return cls(reason, REASON_CODES[reason], message)

    @classmethod
    def from_pb(cls, pb: common_pb2.RequestError) -> RequestError | None:
        if pb.reason == 0:
            return None
        code = next((c for c in grpc.StatusCode if c.value[0] == pb.grpc_code), None)
        return cls(ErrorReason(pb.reason), code or grpc.StatusCode.UNKNOWN, pb.message)

    def to_pb(self) -> common_pb2.RequestError:
        return common_pb2.RequestError(
            reason=int(self.reason),  # type: ignore[arg-type]
            grpc_code=self.code.value[0],
            message=self.message,
        )


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    """SamplingParams; unset temperature / top_p mean 1. ValueError names the field."""
    try:
        return SamplingParams(
            temperature=pb.temperature if pb.HasField("temperature") else 1.0,
            top_k=pb.top_k,
            top_p=pb.top_p if pb.HasField("top_p") else 1.0,
            seed=pb.seed,
        )
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from e


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed
    )


def _check_token_ids(ids: tuple[int, ...], field_name: str, vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field_name} holds {bad[0]}, outside the vocabulary [0, {vocab_size}).")


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """A request to admit: prompt token ids, sampling parameters, first step number."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    first_step: int = 0

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string.")
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must hold at least one token id.")
        check_range(self.first_step, "first_step", 0, MAX_STEP)

    def check_vocab(self, vocab_size: int) -> None:
        _check_token_ids(self.prompt_token_ids, "prompt_token_ids", vocab_size)

    def check_limits(self, vocab_size: int, max_seq_len: int) -> None:
        """Token ids inside the vocabulary, and room for at least one new token."""
        self.check_vocab(vocab_size)
        if len(self.prompt_token_ids) >= max_seq_len:
            raise InvalidInputError(
                f"prompt_token_ids has {len(self.prompt_token_ids)} tokens; at most "
                f"{max_seq_len - 1} fit max_seq_len."
            )

    @classmethod
    def from_pb(cls, pb: common_pb2.AdmitRequest) -> AdmitRequest:
        sampling = sampling_from_pb(pb.sampling)
        return cls(pb.request_id, tuple(pb.prompt_token_ids), sampling, pb.first_step)

    def to_pb(self) -> common_pb2.AdmitRequest:
        return common_pb2.AdmitRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling=sampling_to_pb(self.sampling),
            first_step=self.first_step,
        )


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a service serves and its limits (see `specdec.v1.ModelInfo`)."""

    architecture: str
    vocab_size: int
    tokenizer_vocab_size: int
    tokenizer_hash: str
    max_seq_len: int
    max_requests: int
    max_num_draft_tokens: int
    max_message_bytes: int
    dtype: str
    drafts_ahead: bool = False  # a draft service with draft-ahead on: it can push chains

    def __post_init__(self) -> None:
        if not 0 < self.tokenizer_vocab_size <= self.vocab_size:
            raise ValueError(
                f"tokenizer_vocab_size must be in [1, vocab_size={self.vocab_size}], "
                f"got {self.tokenizer_vocab_size}."
            )

    @classmethod
    def from_pb(cls, pb: common_pb2.ModelInfo) -> ModelInfo:
        return cls(
            pb.architecture, pb.vocab_size, pb.tokenizer_vocab_size, pb.tokenizer_hash,
            pb.max_seq_len, pb.max_requests, pb.max_num_draft_tokens, pb.max_message_bytes,
            pb.dtype, pb.drafts_ahead,
        )  # fmt: skip

    def to_pb(self) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo(
            architecture=self.architecture,
            vocab_size=self.vocab_size,
            tokenizer_vocab_size=self.tokenizer_vocab_size,
            tokenizer_hash=self.tokenizer_hash,
            max_seq_len=self.max_seq_len,
            max_requests=self.max_requests,
            max_num_draft_tokens=self.max_num_draft_tokens,
            max_message_bytes=self.max_message_bytes,
            dtype=self.dtype,
            drafts_ahead=self.drafts_ahead,
        )


def check_compatible(target: ModelInfo, draft: ModelInfo) -> None:
    """Raises ValueError unless draft and target share a tokenizer (padded sizes may differ)."""
    if target.tokenizer_hash != draft.tokenizer_hash:
        raise ValueError(
            f"The draft's tokenizer (hash {draft.tokenizer_hash[:16]}) differs from the "
            f"target's (hash {target.tokenizer_hash[:16]}); draft and target must share one."
        )
    if target.tokenizer_vocab_size != draft.tokenizer_vocab_size:
        raise ValueError(
            f"The draft's tokenizer has {draft.tokenizer_vocab_size} ids and the target's "
            f"{target.tokenizer_vocab_size}; draft and target must share one tokenizer."
        )


@dataclass(frozen=True, slots=True)
class ProposeEntry:
    """One request's ask for drafts (`specdec.v1.ProposeEntry`)."""

    request_id: str
    step: int
    new_token_ids: tuple[int, ...]
    committed_length: int
    num_draft_tokens: int
    fixed_num_draft_tokens: bool = False  # no backup proposal (k = 0) on a miss
    backup: bool = False  # missed the pushed chains: answered with no drafts (`ProposeEntry`)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string.")
        check_range(self.step, "step", 0, MAX_STEP)
        check_range(self.committed_length, "committed_length", 0, MAX_COMMITTED_LENGTH)
        check_range(self.num_draft_tokens, "num_draft_tokens", 0, MAX_WIRE_NUM_DRAFT_TOKENS)
        if self.backup and (self.num_draft_tokens == 0 or self.fixed_num_draft_tokens):
            raise ValueError(
                "backup needs num_draft_tokens > 0 (the k its next step drafts) and no "
                "fixed_num_draft_tokens (a fixed k is never backed up), got "
                f"num_draft_tokens {self.num_draft_tokens} and fixed_num_draft_tokens "
                f"{self.fixed_num_draft_tokens}."
            )

    @classmethod
    def from_pb(cls, pb: draft_pb2.ProposeEntry) -> ProposeEntry:
        return cls(
            pb.request_id, pb.step, tuple(pb.new_token_ids), pb.committed_length,
            pb.num_draft_tokens, pb.fixed_num_draft_tokens, pb.backup,
        )  # fmt: skip

    def to_pb(self) -> draft_pb2.ProposeEntry:
        return draft_pb2.ProposeEntry(
            request_id=self.request_id,
            step=self.step,
            new_token_ids=self.new_token_ids,
            committed_length=self.committed_length,
            num_draft_tokens=self.num_draft_tokens,
            fixed_num_draft_tokens=self.fixed_num_draft_tokens,
            backup=self.backup,
        )


def chain_serves(drafts: int, asked: int, fixed_k: bool) -> bool:
    """Whether a chain of `drafts` tokens drafted ahead answers an ask for `asked` drafts: it
    holds them all, or at least one where the ask's k is not fixed (a chain spawned from a
    catch-up holds k - 1; the answer then holds fewer drafts than asked). The draft's answer
    (`draft_service.ahead_pass`) and the hub's take of a push (`target_service.hub_draft`)
    follow this one rule, so that an answer is what the target verified."""
    return drafts >= asked or (drafts > 0 and not fixed_k)
