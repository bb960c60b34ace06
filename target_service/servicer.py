"""TargetService: protobuf ↔ domain objects, a few lines a method; the work is in `engine`."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc

from specdec.pb import common_pb2, target_pb2, target_pb2_grpc
from specdec.serving.blocks import DraftBlock
from specdec.serving.lifecycle import LifecycleServicer, step_timing
from specdec.serving.messages import ErrorReason, RequestError
from specdec.serving.verdicts import VerifyResponse
from target_service.engine import TargetEngine


def block_error(block: common_pb2.DraftBlock, error: ValueError) -> VerifyResponse:
    """Every entry's INVALID_ARGUMENT verdict, for a block whose columns or q buffers do not fit
    each other (the stream stays open)."""
    n = len(block.request_ids)
    steps = list(block.steps)[:n]
    out = VerifyResponse.pending(block.request_ids, steps + [0] * (n - len(steps)))
    err = RequestError(ErrorReason.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT, str(error))
    for i in range(n):
        out.fail(i, err)
    return out


class TargetServicer(LifecycleServicer, target_pb2_grpc.TargetServiceServicer):
    engine: TargetEngine

    def __init__(self, engine: TargetEngine):
        self.engine = engine

    def Verify(
        self, request_iterator: Iterator[common_pb2.DraftBlock], context: grpc.ServicerContext
    ) -> Iterator[target_pb2.VerifyResponse]:
        limit = self.engine.config.max_support_size
        for block in request_iterator:
            start = time.perf_counter()
            try:
                parsed = DraftBlock.from_pb(block, max_support_size=limit)
            except ValueError as e:
                yield block_error(block, e).to_pb()
                continue
            verdicts, times = self.engine.verify_timed(parsed)
            response = verdicts.to_pb()
            response.timing.CopyFrom(step_timing(times, time.perf_counter() - start))
            yield response
