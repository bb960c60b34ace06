"""DraftService: protobuf ↔ domain objects, a few lines a method; the work is in `engine`."""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterator

import grpc

from draft_service.engine import DraftEngine, Push
from specdec.pb import draft_pb2, draft_pb2_grpc
from specdec.runner.trace import host_span, trace_of
from specdec.serving.lifecycle import LifecycleServicer, step_timing
from specdec.serving.messages import ErrorReason, ProposeEntry, RequestError

log = logging.getLogger(__name__)


def _propose_error(request_id: str, error: RequestError) -> draft_pb2.ProposeError:
    return draft_pb2.ProposeError(request_id=request_id, error=error.to_pb())


class DraftServicer(LifecycleServicer, draft_pb2_grpc.DraftServiceServicer):
    engine: DraftEngine

    def __init__(self, engine: DraftEngine):
        self.engine = engine
        self._trace = trace_of(getattr(engine, "runner", None))  # host spans, where tracing is on

    def Propose(
        self, request_iterator: Iterator[draft_pb2.ProposeBlock], context: grpc.ServicerContext
    ) -> Iterator[draft_pb2.ProposeResponse]:
        for block in request_iterator:
            start = time.perf_counter()
            asks, errors = [], []
            for i, pb in enumerate(block.entries):
                try:
                    asks.append(ProposeEntry.from_pb(pb))
                except ValueError as e:
                    err = RequestError(
                        ErrorReason.INVALID_ARGUMENT,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"entries[{i}]: {e}",
                    )
                    errors.append(_propose_error(pb.request_id, err))
            proposal = self.engine.propose_timed(asks, block.target_step_s)
            errors += [_propose_error(rid, err) for rid, err in proposal.errors]
            response = draft_pb2.ProposeResponse(
                block=proposal.block.to_pb(), errors=errors,
                draft_ahead_hits=proposal.ahead_hits, draft_ahead_misses=proposal.ahead_misses,
                draft_ahead_s=proposal.ahead_s, draft_ahead_backups=proposal.ahead_backups,
            )  # fmt: skip
            response.timing.CopyFrom(step_timing(proposal.times, time.perf_counter() - start))
            host_span(self._trace, "answer", start)
            start = time.perf_counter()
            yield response  # returns once gRPC has sent it
            host_span(self._trace, "send", start)
            # the target verifies this block meanwhile: draft its likely successors
            start = time.perf_counter()
            self.engine.draft_ahead(proposal.block.request_ids)
            push = self._push(proposal.block.request_ids) if block.push_chains else None
            host_span(self._trace, "pass ahead", start)
            if push is not None:  # and send them before they are asked for (an empty push
                # if there are none: the hub waits for one after each answer)
                yield push

    def _push(self, request_ids: list[str]) -> draft_pb2.ProposeResponse:
        """The push of these requests' chains; empty if there are none, or if it would not fit
        a message (dense q over many chains): the hub then asks as without pushes."""
        push = self.engine.pushed(request_ids)
        pb = _push_pb(push) if push is not None else draft_pb2.ProposeResponse(pushed=True)
        limit = self.engine.info.max_message_bytes
        if pb.ByteSize() > limit:
            log.warning("a push of %d bytes exceeds the %d-byte message limit; sent empty",
                        pb.ByteSize(), limit)  # fmt: skip
            pb = draft_pb2.ProposeResponse(pushed=True)
        pb.backup_miss_share = self.engine.backup_miss_share()
        return pb


def _push_pb(push: Push) -> draft_pb2.ProposeResponse:
    keys = [t for key in push.keys for t in key]
    return draft_pb2.ProposeResponse(
        block=push.block.to_pb(), pushed=True, verdict_lengths=[len(k) for k in push.keys],
        verdict_token_ids=struct.pack(f"<{len(keys)}i", *keys),
        any_verdict_of_length=push.any_verdict,
    )  # fmt: skip
