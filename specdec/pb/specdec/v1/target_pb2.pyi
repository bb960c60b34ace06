from specdec.pb.specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
