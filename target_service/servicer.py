"""TargetService: protobuf ↔ domain objects, a few lines a method; the work is in `engine`."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from specdec.pb import common_pb2, target_pb2, target_pb2_grpc
from specdec.serving.blocks import DraftProposal, VerifyResult
from specdec.serving.messages import Admission, ErrorReason
from target_service.engine import TargetEngine, error_result


def parse_entry(index: int, pb: common_pb2.DraftEntry) -> DraftProposal | VerifyResult:
    """The entry as a DraftProposal, or its INVALID_ARGUMENT result if it is malformed."""
    try:
        return DraftProposal.from_pb(pb, f"entries[{index}]")
    except ValueError as e:
        reason, code = ErrorReason.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT
        return error_result((pb.request_id, pb.step), reason, code, str(e))


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
            entries = [parse_entry(i, pb) for i, pb in enumerate(block.entries)]
            results = self.engine.verify(entries)
            yield target_pb2.VerifyResponse(results=[r.to_pb() for r in results])
