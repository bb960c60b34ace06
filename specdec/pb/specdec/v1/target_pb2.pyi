from specdec.pb.specdec.v1 import common_pb2 as _common_pb2
from specdec.pb.specdec.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftFallback(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_FALLBACK_NONE: _ClassVar[DraftFallback]
    DRAFT_FALLBACK_DEADLINE: _ClassVar[DraftFallback]
    DRAFT_FALLBACK_UNAVAILABLE: _ClassVar[DraftFallback]
DRAFT_FALLBACK_NONE: DraftFallback
DRAFT_FALLBACK_DEADLINE: DraftFallback
DRAFT_FALLBACK_UNAVAILABLE: DraftFallback

class VerifyResponse(_message.Message):
    __slots__ = ("request_ids", "steps", "num_accepted", "num_draft_tokens", "committed_lengths", "num_token_ids", "token_ids", "errors", "timing")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    steps: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    committed_lengths: _containers.RepeatedScalarFieldContainer[int]
    num_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    errors: _containers.RepeatedCompositeFieldContainer[VerifyError]
    timing: _common_pb2.StepTiming
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., steps: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., committed_lengths: _Optional[_Iterable[int]] = ..., num_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., errors: _Optional[_Iterable[_Union[VerifyError, _Mapping]]] = ..., timing: _Optional[_Union[_common_pb2.StepTiming, _Mapping]] = ...) -> None: ...

class VerifyError(_message.Message):
    __slots__ = ("index", "error")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    index: int
    error: _common_pb2.RequestError
    def __init__(self, index: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.RequestError, _Mapping]] = ...) -> None: ...

class ServeControl(_message.Message):
    __slots__ = ("admit", "release", "set_speculation", "set_draft")
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    SET_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    SET_DRAFT_FIELD_NUMBER: _ClassVar[int]
    admit: ServeAdmit
    release: _common_pb2.ReleaseRequest
    set_speculation: SetSpeculation
    set_draft: SetDraft
    def __init__(self, admit: _Optional[_Union[ServeAdmit, _Mapping]] = ..., release: _Optional[_Union[_common_pb2.ReleaseRequest, _Mapping]] = ..., set_speculation: _Optional[_Union[SetSpeculation, _Mapping]] = ..., set_draft: _Optional[_Union[SetDraft, _Mapping]] = ...) -> None: ...

class ServeAdmit(_message.Message):
    __slots__ = ("request", "proposer", "num_draft_tokens", "max_length", "fixed_num_draft_tokens")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FIXED_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request: _common_pb2.AdmitRequest
    proposer: _generate_pb2.Proposer
    num_draft_tokens: int
    max_length: int
    fixed_num_draft_tokens: bool
    def __init__(self, request: _Optional[_Union[_common_pb2.AdmitRequest, _Mapping]] = ..., proposer: _Optional[_Union[_generate_pb2.Proposer, str]] = ..., num_draft_tokens: _Optional[int] = ..., max_length: _Optional[int] = ..., fixed_num_draft_tokens: _Optional[bool] = ...) -> None: ...

class SetSpeculation(_message.Message):
    __slots__ = ("request_id", "proposer", "num_draft_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    proposer: _generate_pb2.Proposer
    num_draft_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., proposer: _Optional[_Union[_generate_pb2.Proposer, str]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class SetDraft(_message.Message):
    __slots__ = ("address", "records")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    address: str
    records: _containers.RepeatedCompositeFieldContainer[DraftRecord]
    def __init__(self, address: _Optional[str] = ..., records: _Optional[_Iterable[_Union[DraftRecord, _Mapping]]] = ...) -> None: ...

class DraftRecord(_message.Message):
    __slots__ = ("request_id", "token_ids", "next_step")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    next_step: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., next_step: _Optional[int] = ...) -> None: ...

class ServeEvent(_message.Message):
    __slots__ = ("started", "step", "admitted", "draft_down", "draft_up")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DOWN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_UP_FIELD_NUMBER: _ClassVar[int]
    started: ServeStarted
    step: ServeStep
    admitted: ServeAdmitted
    draft_down: DraftDown
    draft_up: DraftUp
    def __init__(self, started: _Optional[_Union[ServeStarted, _Mapping]] = ..., step: _Optional[_Union[ServeStep, _Mapping]] = ..., admitted: _Optional[_Union[ServeAdmitted, _Mapping]] = ..., draft_down: _Optional[_Union[DraftDown, _Mapping]] = ..., draft_up: _Optional[_Union[DraftUp, _Mapping]] = ...) -> None: ...

class ServeStarted(_message.Message):
    __slots__ = ("target", "draft")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    target: _common_pb2.ModelInfo
    draft: _common_pb2.ModelInfo
    def __init__(self, target: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., draft: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ...) -> None: ...

class ServeStep(_message.Message):
    __slots__ = ("verdicts", "draft_s", "transport_s", "verify_s", "sampler_s", "step_s", "draft_up", "graphed", "draft_ahead_hits", "draft_ahead_misses", "proposers", "draft_fallback", "num_fallback_requests", "draft_ahead_s", "draft_ahead_backups", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "draft_ahead_pushed", "draft_ahead_push_backups")
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_UP_FIELD_NUMBER: _ClassVar[int]
    GRAPHED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_MISSES_FIELD_NUMBER: _ClassVar[int]
    PROPOSERS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    NUM_FALLBACK_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_BACKUPS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_PUSHED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_PUSH_BACKUPS_FIELD_NUMBER: _ClassVar[int]
    verdicts: VerifyResponse
    draft_s: float
    transport_s: float
    verify_s: float
    sampler_s: float
    step_s: float
    draft_up: bool
    graphed: bool
    draft_ahead_hits: int
    draft_ahead_misses: int
    proposers: _containers.RepeatedScalarFieldContainer[_generate_pb2.Proposer]
    draft_fallback: DraftFallback
    num_fallback_requests: int
    draft_ahead_s: float
    draft_ahead_backups: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    draft_ahead_pushed: int
    draft_ahead_push_backups: int
    def __init__(self, verdicts: _Optional[_Union[VerifyResponse, _Mapping]] = ..., draft_s: _Optional[float] = ..., transport_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., sampler_s: _Optional[float] = ..., step_s: _Optional[float] = ..., draft_up: _Optional[bool] = ..., graphed: _Optional[bool] = ..., draft_ahead_hits: _Optional[int] = ..., draft_ahead_misses: _Optional[int] = ..., proposers: _Optional[_Iterable[_Union[_generate_pb2.Proposer, str]]] = ..., draft_fallback: _Optional[_Union[DraftFallback, str]] = ..., num_fallback_requests: _Optional[int] = ..., draft_ahead_s: _Optional[float] = ..., draft_ahead_backups: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., draft_ahead_pushed: _Optional[int] = ..., draft_ahead_push_backups: _Optional[int] = ...) -> None: ...

class ServeAdmitted(_message.Message):
    __slots__ = ("request_id", "committed_length", "next_step", "error", "prefill_s", "verdicts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    committed_length: int
    next_step: int
    error: _common_pb2.RequestError
    prefill_s: float
    verdicts: VerifyResponse
    def __init__(self, request_id: _Optional[str] = ..., committed_length: _Optional[int] = ..., next_step: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.RequestError, _Mapping]] = ..., prefill_s: _Optional[float] = ..., verdicts: _Optional[_Union[VerifyResponse, _Mapping]] = ...) -> None: ...

class DraftDown(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class DraftUp(_message.Message):
    __slots__ = ("draft",)
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    draft: _common_pb2.ModelInfo
    def __init__(self, draft: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ...) -> None: ...
