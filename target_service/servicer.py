"""TargetService: protobuf ↔ domain objects, a few lines a method; the work is in `engine`."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from specdec.pb import common_pb2, target_pb2, target_pb2_grpc
from specdec.serving.blocks import (
    DraftProposal,
    VerifyResult,
    proposals_from_pb,
    results_to_pb,
)
from specdec.serving.lifecycle import LifecycleServicer
from specdec.serving.messages import ErrorReason
from target_service.engine import TargetEngine, error_result


def parse_block(block: common_pb2.DraftBlock) -> list[DraftProposal | VerifyResult]:
    """Each entry as a DraftProposal, or its INVALID_ARGUMENT result if it is malformed; a
    malformed column or q buffer is every entry's error (the stream stays open)."""
    try:
        parsed = proposals_from_pb(block)
    except ValueError as e:
        parsed = [e] * len(block.request_ids)
    reason, code = ErrorReason.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT
    steps = list(block.steps)
    return [
        p if isinstance(p, DraftProposal)
        else error_result((rid, steps[i] if i < len(steps) else 0), reason, code, str(p))
        for i, (rid, p) in enumerate(zip(block.request_ids, parsed, strict=True))
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
            yield results_to_pb(results)
