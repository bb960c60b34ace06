from specdec.pb.specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyResult(_message.Message):
    __slots__ = ("request_id", "step", "token_ids", "num_accepted", "accepted", "committed_length", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    step: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    accepted: _containers.RepeatedScalarFieldContainer[bool]
    committed_length: int
    error: _common_pb2.RequestError
    def __init__(self, request_id: _Optional[str] = ..., step: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., accepted: _Optional[_Iterable[bool]] = ..., committed_length: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.RequestError, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ...) -> None: ...
