"""TargetService: protobuf ↔ domain objects, a few lines a method; the work is in `engine`."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from specdec.pb import common_pb2, target_pb2, target_pb2_grpc
from specdec.serving.blocks import DraftProposal, VerifyResult, proposals_from_pb
from specdec.serving.lifecycle import LifecycleServicer
from specdec.serving.messages import ErrorReason
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


class TargetServicer(LifecycleServicer, target_pb2_grpc.TargetServiceServicer):
    engine: TargetEngine

    def __init__(self, engine: TargetEngine):
        self.engine = engine

    def Verify(
        self, request_iterator: Iterator[common_pb2.DraftBlock], context: grpc.ServicerContext
    ) -> Iterator[target_pb2.VerifyResponse]:
        for block in request_iterator:
            results = self.engine.verify(parse_block(block))
            yield target_pb2.VerifyResponse(results=[r.to_pb() for r in results])
