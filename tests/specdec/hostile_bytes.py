"""Raw request bytes for every method of the three services: the methods read from the
protocol's descriptors, a valid message for each, hand-written malformations of it, and a call
that sends bytes as they are (identity serializers) and returns the status it ended with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message

from specdec.pb import common_pb2, draft_pb2, target_pb2
from specdec.pb.specdec.v1 import generate_pb2 as gen
from specdec.serving.blocks import DraftProposal, block_to_pb

SERVICES: dict[str, ServiceDescriptor] = {
    "api": gen.DESCRIPTOR.services_by_name["GenerateService"],
    "draft": draft_pb2.DESCRIPTOR.services_by_name["DraftService"],
    "target": target_pb2.DESCRIPTOR.services_by_name["TargetService"],
}
FUZZ_ID = "fuzz"  # the valid messages' request id, released after each call


@dataclass(frozen=True)
class Method:
    role: str  # a SERVICES key
    path: str  # /specdec.v1.Service/Method
    request: type[Message]
    client_streaming: bool
    server_streaming: bool

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 2)[1].rsplit(".", 1)[1] + "." + self.path.rsplit("/", 1)[1]


def _message_class(full_name: str) -> type[Message]:
    for module in (common_pb2, draft_pb2, target_pb2, gen):
        short = full_name.rsplit(".", 1)[1]
        if short in module.DESCRIPTOR.message_types_by_name:
            cls: type[Message] = getattr(module, short)
            return cls
    raise KeyError(full_name)


def methods() -> list[Method]:
    out = []
    for role, service in SERVICES.items():
        for m in service.methods:
            request = _message_class(m.input_type.full_name)
            path = f"/{service.full_name}/{m.name}"
            out.append(Method(role, path, request, m.client_streaming, m.server_streaming))
    return out


def _speculation() -> gen.Speculation:
    return gen.Speculation(proposer=gen.PROPOSER_DRAFT, num_draft_tokens=2)


def _admit() -> common_pb2.AdmitRequest:
    return common_pb2.AdmitRequest(request_id=FUZZ_ID, prompt_token_ids=[5, 6, 7])


def valid_messages() -> dict[str, list[Message]]:
    """Well-formed requests of each message type (short ones: max_tokens 2)."""
    generate = [
        gen.GenerateRequest(token_ids=gen.TokenIds(ids=[5, 6, 7]), max_tokens=2, temperature=0.0,
                            ignore_eos=True, request_id=FUZZ_ID, speculation=_speculation()),
        gen.GenerateRequest(text="w5 w6 w7", max_tokens=2, stop=["w"], stop_token_ids=[3]),
    ]  # fmt: skip
    entry = draft_pb2.ProposeEntry(request_id=FUZZ_ID, step=0, committed_length=3,
                                   num_draft_tokens=2)  # fmt: skip
    serve_admit = target_pb2.ServeAdmit(request=_admit(), proposer=gen.PROPOSER_OFF)
    return {
        "GenerateRequest": generate,
        "GetServedModelInfoRequest": [gen.GetServedModelInfoRequest()],
        "SetSpeculationRequest": [
            gen.SetSpeculationRequest(request_id=FUZZ_ID, speculation=_speculation())
        ],
        "AdmitRequest": [_admit()],
        "ReleaseRequest": [common_pb2.ReleaseRequest(request_ids=[FUZZ_ID, "other"])],
        "GetModelInfoRequest": [common_pb2.GetModelInfoRequest()],
        "ProposeBlock": [draft_pb2.ProposeBlock(entries=[entry])],
        "DraftBlock": [block_to_pb([DraftProposal(FUZZ_ID, 0, 3, (8, 9))])],
        "ServeControl": [
            target_pb2.ServeControl(admit=serve_admit),
            target_pb2.ServeControl(release=common_pb2.ReleaseRequest(request_ids=[FUZZ_ID])),
        ],
    }


def _first_string_field(cls: type[Message]) -> FieldDescriptor | None:
    for field in cls.DESCRIPTOR.fields:
        if field.type == FieldDescriptor.TYPE_STRING:
            return field
    return None


def malformed(cls: type[Message], valid: bytes) -> dict[str, bytes]:
    """Hand-written undecodable variants of `valid` (a serialised `cls`), by name."""
    cases = {
        "truncated varint": b"\x08\xff",
        "length past the end": b"\x0a\xff\xff\xff\x0f",
        "field number 0": b"\x00\x01",
        "unterminated group": b"\x0b",
        "end group without start": b"\x0c",
        "wire type 6": b"\x0e\x00",
        "varint of 11 bytes": b"\x08" + b"\xff" * 10 + b"\x01",
        "valid then length past the end": valid + b"\x12\x40ab",
        "plain text": b"this is not a protobuf message",
    }
    if len(valid) > 1:
        cases["valid less its last byte"] = valid[:-1]
    field = _first_string_field(cls)
    if field is not None:
        tag = bytes([field.number << 3 | 2])
        cases["invalid UTF-8 in " + field.name] = tag + b"\x02\xc3\x28"
        cases["lone surrogate in " + field.name] = tag + b"\x03\xed\xa0\x80"
    return {name: data for name, data in cases.items() if not decodes(cls, data)}


def decodes(cls: type[Message], data: bytes) -> bool:
    try:
        cls.FromString(data)
    except Exception:
        return False
    return True


def call(channel: grpc.Channel, method: Method, data: bytes, timeout: float = 30.0) -> grpc.Call:
    """Sends `data` as the request (the only message of a stream) and reads every response;
    returns the finished call (its code() and details())."""
    kinds: dict[tuple[bool, bool], Callable[..., Any]] = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }
    stub = kinds[method.client_streaming, method.server_streaming](method.path)
    request: Any = iter([data]) if method.client_streaming else data
    if method.server_streaming:
        responses = stub(request, timeout=timeout)
        try:
            for _ in responses:
                pass
        except grpc.RpcError:
            pass
        return responses  # type: ignore[no-any-return]
    try:
        _, outcome = stub.with_call(request, timeout=timeout)
    except grpc.RpcError as e:
        return e  # type: ignore[return-value]
    return outcome  # type: ignore[no-any-return]
