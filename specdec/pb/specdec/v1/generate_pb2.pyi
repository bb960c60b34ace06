from specdec.pb.specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Proposer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSER_DEFAULT: _ClassVar[Proposer]
    PROPOSER_DRAFT: _ClassVar[Proposer]
    PROPOSER_NGRAM: _ClassVar[Proposer]
    PROPOSER_OFF: _ClassVar[Proposer]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_MAX_SEQ_LEN: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
PROPOSER_DEFAULT: Proposer
PROPOSER_DRAFT: Proposer
PROPOSER_NGRAM: Proposer
PROPOSER_OFF: Proposer
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_MAX_SEQ_LEN: FinishReason
FINISH_REASON_CANCELLED: FinishReason

class Speculation(_message.Message):
    __slots__ = ("proposer", "num_draft_tokens")
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    proposer: Proposer
    num_draft_tokens: int
    def __init__(self, proposer: _Optional[_Union[Proposer, str]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class SetSpeculationRequest(_message.Message):
    __slots__ = ("request_id", "speculation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    speculation: Speculation
    def __init__(self, request_id: _Optional[str] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ...) -> None: ...

class SetSpeculationResponse(_message.Message):
    __slots__ = ("request_id", "proposer", "num_draft_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    proposer: Proposer
    num_draft_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., proposer: _Optional[_Union[Proposer, str]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "temperature", "top_k", "top_p", "seed", "speculation", "include_stop_str_in_output", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int
    speculation: Speculation
    include_stop_str_in_output: bool
    model: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., include_stop_str_in_output: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class StepAcceptance(_message.Message):
    __slots__ = ("step", "num_draft_tokens", "num_accepted")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    step: int
    num_draft_tokens: int
    num_accepted: int
    def __init__(self, step: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos", "proposer", "num_draft_tokens_per_step")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    num_steps: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    proposer: Proposer
    num_draft_tokens_per_step: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_drafts: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., proposer: _Optional[_Union[Proposer, str]] = ..., num_draft_tokens_per_step: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_s", "time_to_first_token_s", "e2e_s", "admission_s", "prefill_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    time_to_first_token_s: float
    e2e_s: float
    admission_s: float
    prefill_s: float
    def __init__(self, queue_s: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., admission_s: _Optional[float] = ..., prefill_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "steps", "finish_reason", "stop_string", "stop_token_id", "usage", "timing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepAcceptance]
    finish_reason: FinishReason
    stop_string: str
    stop_token_id: int
    usage: Usage
    timing: Timing
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., steps: _Optional[_Iterable[_Union[StepAcceptance, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class GetServedModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServedModel(_message.Message):
    __slots__ = ("name", "target_model", "draft_model", "vocab_size", "max_seq_len", "default_proposer", "default_num_draft_tokens", "max_num_draft_tokens", "eos_token_ids", "draft_up", "target", "draft")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROPOSER_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_UP_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    name: str
    target_model: str
    draft_model: str
    vocab_size: int
    max_seq_len: int
    default_proposer: Proposer
    default_num_draft_tokens: int
    max_num_draft_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_up: bool
    target: _common_pb2.ModelInfo
    draft: _common_pb2.ModelInfo
    def __init__(self, name: _Optional[str] = ..., target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., default_proposer: _Optional[_Union[Proposer, str]] = ..., default_num_draft_tokens: _Optional[int] = ..., max_num_draft_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., draft_up: _Optional[bool] = ..., target: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., draft: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ...) -> None: ...

class ServedModelInfo(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ServedModel]
    def __init__(self, models: _Optional[_Iterable[_Union[ServedModel, _Mapping]]] = ...) -> None: ...
