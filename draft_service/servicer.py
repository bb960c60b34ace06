"""DraftService: protobuf ↔ domain objects, a few lines a method; the work is in `engine`."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from draft_service.engine import DraftEngine
from specdec.pb import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.serving.blocks import ProposeAsk, block_to_pb
from specdec.serving.messages import Admission, ErrorReason, RequestError


def _propose_error(request_id: str, error: RequestError) -> draft_pb2.ProposeError:
    return draft_pb2.ProposeError(request_id=request_id, error=error.to_pb())


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, engine: DraftEngine):
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

    def Propose(
        self, request_iterator: Iterator[draft_pb2.ProposeBlock], context: grpc.ServicerContext
    ) -> Iterator[draft_pb2.ProposeResponse]:
        for block in request_iterator:
            asks, errors = [], []
            for i, pb in enumerate(block.entries):
                try:
                    asks.append(ProposeAsk.from_pb(pb))
                except ValueError as e:
                    err = RequestError(
                        ErrorReason.INVALID_ARGUMENT,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"entries[{i}]: {e}",
                    )
                    errors.append(_propose_error(pb.request_id, err))
            proposals, failed = self.engine.propose(asks)
            errors += [_propose_error(rid, err) for rid, err in failed]
            yield draft_pb2.ProposeResponse(block=block_to_pb(proposals), errors=errors)
