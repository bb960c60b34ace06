"""TargetService: protobuf ↔ domain objects, a few lines a method; the work is in `engine`."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from specdec.pb import common_pb2, target_pb2, target_pb2_grpc
from specdec.serving.blocks import DraftProposal, VerifyResult, proposals_from_pb
from specdec.serving.messages import Admission, ErrorReason
from target_service.engine import TargetEngine, error_result


def parse_block(block: common_pb2.DraftBlock) -> list[DraftProposal | VerifyResult]:
    """Each entry as a DraftProposal, or its INVALID_ARGUMENT result if it is malformed; a
    malformed q buffer is every entry's error (the stream stays open)."""
    try:
        parsed = proposals_from_pb(block)
    except ValueError as e:
        parsed = [e] * len(block.entries)
    reason, code = ErrorReason.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT
    return [
        p if isinstance(p, DraftProposal) else error_result((e.request_id, e.step), reason, code,
                                                            str(p))
        for e, p in zip(block.entries, parsed, strict=True)
    ]  # fmt: skip


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: TargetEngine):
        self.engine = engine

    def Admit(
        self, request: common_pb2.AdmitRequest, context: grpc.ServicerContext
    ) -> common_pb2.AdmitResponse:
        length, step = self.engine.admit(Admission.from_pb(request))
        return common_pb2.AdmitResponse(committed_length=length, next_step=step)

    def Release(
        self, request: common_pb2.ReleaseRequest, context: grpc.ServicerContext
    ) -> common_pb2.ReleaseResponse:
        return common_pb2.ReleaseResponse(num_released=self.engine.release(request.request_ids))

    def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> common_pb2.ModelInfo:
        return self.engine.info.to_pb()

    def Verify(
        self, request_iterator: Iterator[common_pb2.DraftBlock], context: grpc.ServicerContext
    ) -> Iterator[target_pb2.VerifyResponse]:
        for block in request_iterator:
            results = self.engine.verify(parse_block(block))
            yield target_pb2.VerifyResponse(results=[r.to_pb() for r in results])
