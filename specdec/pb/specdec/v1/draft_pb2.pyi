from specdec.pb.specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeEntry(_message.Message):
    __slots__ = ("request_id", "step", "new_token_ids", "committed_length", "num_draft_tokens", "fixed_num_draft_tokens", "backup")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIXED_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    step: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    committed_length: int
    num_draft_tokens: int
    fixed_num_draft_tokens: bool
    backup: bool
    def __init__(self, request_id: _Optional[str] = ..., step: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., committed_length: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., fixed_num_draft_tokens: _Optional[bool] = ..., backup: _Optional[bool] = ...) -> None: ...

class ProposeBlock(_message.Message):
    __slots__ = ("entries", "target_step_s", "push_chains")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TARGET_STEP_S_FIELD_NUMBER: _ClassVar[int]
    PUSH_CHAINS_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[ProposeEntry]
    target_step_s: float
    push_chains: bool
    def __init__(self, entries: _Optional[_Iterable[_Union[ProposeEntry, _Mapping]]] = ..., target_step_s: _Optional[float] = ..., push_chains: _Optional[bool] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("block", "errors", "timing", "draft_ahead_hits", "draft_ahead_misses", "draft_ahead_s", "draft_ahead_backups", "pushed", "verdict_lengths", "verdict_token_ids", "any_verdict_of_length", "backup_miss_share")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_MISSES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_BACKUPS_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    VERDICT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    VERDICT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ANY_VERDICT_OF_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BACKUP_MISS_SHARE_FIELD_NUMBER: _ClassVar[int]
    block: _common_pb2.DraftBlock
    errors: _containers.RepeatedCompositeFieldContainer[ProposeError]
    timing: _common_pb2.StepTiming
    draft_ahead_hits: int
    draft_ahead_misses: int
    draft_ahead_s: float
    draft_ahead_backups: int
    pushed: bool
    verdict_lengths: _containers.RepeatedScalarFieldContainer[int]
    verdict_token_ids: bytes
    any_verdict_of_length: _containers.RepeatedScalarFieldContainer[bool]
    backup_miss_share: float
    def __init__(self, block: _Optional[_Union[_common_pb2.DraftBlock, _Mapping]] = ..., errors: _Optional[_Iterable[_Union[ProposeError, _Mapping]]] = ..., timing: _Optional[_Union[_common_pb2.StepTiming, _Mapping]] = ..., draft_ahead_hits: _Optional[int] = ..., draft_ahead_misses: _Optional[int] = ..., draft_ahead_s: _Optional[float] = ..., draft_ahead_backups: _Optional[int] = ..., pushed: _Optional[bool] = ..., verdict_lengths: _Optional[_Iterable[int]] = ..., verdict_token_ids: _Optional[bytes] = ..., any_verdict_of_length: _Optional[_Iterable[bool]] = ..., backup_miss_share: _Optional[float] = ...) -> None: ...

class ProposeError(_message.Message):
    __slots__ = ("request_id", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    error: _common_pb2.RequestError
    def __init__(self, request_id: _Optional[str] = ..., error: _Optional[_Union[_common_pb2.RequestError, _Mapping]] = ...) -> None: ...
