from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QForm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    Q_FORM_NONE: _ClassVar[QForm]
    Q_FORM_DENSE: _ClassVar[QForm]
    Q_FORM_SPARSE: _ClassVar[QForm]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_UNKNOWN_REQUEST: _ClassVar[ErrorReason]
    ERROR_REASON_STALE_STEP: _ClassVar[ErrorReason]
    ERROR_REASON_DUPLICATE_STEP: _ClassVar[ErrorReason]
    ERROR_REASON_FUTURE_STEP: _ClassVar[ErrorReason]
    ERROR_REASON_COMMITTED_LENGTH_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_DUPLICATE_ENTRY: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_ARGUMENT: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_DRAFT_PROBS: _ClassVar[ErrorReason]
    ERROR_REASON_DRAFT_PROBS_NOT_NORMALIZED: _ClassVar[ErrorReason]
    ERROR_REASON_DRAFT_TOKEN_OUT_OF_SUPPORT: _ClassVar[ErrorReason]
    ERROR_REASON_TOKEN_OUT_OF_VOCAB: _ClassVar[ErrorReason]
    ERROR_REASON_NONFINITE_LOGITS: _ClassVar[ErrorReason]
    ERROR_REASON_CAPACITY: _ClassVar[ErrorReason]
    ERROR_REASON_STEP_FAILED: _ClassVar[ErrorReason]
Q_FORM_NONE: QForm
Q_FORM_DENSE: QForm
Q_FORM_SPARSE: QForm
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_UNKNOWN_REQUEST: ErrorReason
ERROR_REASON_STALE_STEP: ErrorReason
ERROR_REASON_DUPLICATE_STEP: ErrorReason
ERROR_REASON_FUTURE_STEP: ErrorReason
ERROR_REASON_COMMITTED_LENGTH_MISMATCH: ErrorReason
ERROR_REASON_DUPLICATE_ENTRY: ErrorReason
ERROR_REASON_INVALID_ARGUMENT: ErrorReason
ERROR_REASON_INVALID_DRAFT_PROBS: ErrorReason
ERROR_REASON_DRAFT_PROBS_NOT_NORMALIZED: ErrorReason
ERROR_REASON_DRAFT_TOKEN_OUT_OF_SUPPORT: ErrorReason
ERROR_REASON_TOKEN_OUT_OF_VOCAB: ErrorReason
ERROR_REASON_NONFINITE_LOGITS: ErrorReason
ERROR_REASON_CAPACITY: ErrorReason
ERROR_REASON_STEP_FAILED: ErrorReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "first_step")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    first_step: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., first_step: _Optional[int] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("committed_length", "next_step")
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    committed_length: int
    next_step: int
    def __init__(self, committed_length: _Optional[int] = ..., next_step: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_released",)
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    def __init__(self, num_released: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("architecture", "vocab_size", "tokenizer_vocab_size", "tokenizer_hash", "max_seq_len", "max_requests", "max_num_draft_tokens", "max_message_bytes", "dtype", "drafts_ahead")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    vocab_size: int
    tokenizer_vocab_size: int
    tokenizer_hash: str
    max_seq_len: int
    max_requests: int
    max_num_draft_tokens: int
    max_message_bytes: int
    dtype: str
    drafts_ahead: bool
    def __init__(self, architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_vocab_size: _Optional[int] = ..., tokenizer_hash: _Optional[str] = ..., max_seq_len: _Optional[int] = ..., max_requests: _Optional[int] = ..., max_num_draft_tokens: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., drafts_ahead: _Optional[bool] = ...) -> None: ...

class DenseProbs(_message.Message):
    __slots__ = ("vocab_size", "probs")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    probs: bytes
    def __init__(self, vocab_size: _Optional[int] = ..., probs: _Optional[bytes] = ...) -> None: ...

class SparseProbs(_message.Message):
    __slots__ = ("support_size", "token_ids", "probs")
    SUPPORT_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    support_size: int
    token_ids: bytes
    probs: bytes
    def __init__(self, support_size: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., probs: _Optional[bytes] = ...) -> None: ...

class DraftBlock(_message.Message):
    __slots__ = ("request_ids", "steps", "committed_lengths", "num_draft_tokens", "q_forms", "draft_token_ids", "dense", "sparse")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FORMS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    steps: _containers.RepeatedScalarFieldContainer[int]
    committed_lengths: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    q_forms: _containers.RepeatedScalarFieldContainer[QForm]
    draft_token_ids: bytes
    dense: DenseProbs
    sparse: SparseProbs
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., steps: _Optional[_Iterable[int]] = ..., committed_lengths: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., q_forms: _Optional[_Iterable[_Union[QForm, str]]] = ..., draft_token_ids: _Optional[bytes] = ..., dense: _Optional[_Union[DenseProbs, _Mapping]] = ..., sparse: _Optional[_Union[SparseProbs, _Mapping]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("reason", "grpc_code", "message")
    REASON_FIELD_NUMBER: _ClassVar[int]
    GRPC_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: ErrorReason
    grpc_code: int
    message: str
    def __init__(self, reason: _Optional[_Union[ErrorReason, str]] = ..., grpc_code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StepTiming(_message.Message):
    __slots__ = ("service_s", "forward_s", "sampler_s", "graphed")
    SERVICE_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_S_FIELD_NUMBER: _ClassVar[int]
    GRAPHED_FIELD_NUMBER: _ClassVar[int]
    service_s: float
    forward_s: float
    sampler_s: float
    graphed: bool
    def __init__(self, service_s: _Optional[float] = ..., forward_s: _Optional[float] = ..., sampler_s: _Optional[float] = ..., graphed: _Optional[bool] = ...) -> None: ...
