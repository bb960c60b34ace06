"""`specdec.v1.GenerateService`: protobuf in, scheduler jobs, protobuf out.

Calls before the services are ready answer UNAVAILABLE; past `max_concurrent_calls` Generate and
Complete calls in flight, RESOURCE_EXHAUSTED at once (each holds a server thread, and the
server's threads are sized for that many). Errors become statuses through the server's
interceptor: a ValueError from validation is INVALID_ARGUMENT naming the field, a full queue
RESOURCE_EXHAUSTED; a request's own failure aborts only its call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from orchestrator.detokenizer import TextTokenizer
from orchestrator.records import PROPOSERS
from orchestrator.requests import (
    Job,
    JobMetrics,
    Served,
    deadline_of,
    parse_request,
    speculation_of,
)
from orchestrator.scheduler import Scheduler
from specdec.pb.specdec.v1 import generate_pb2, generate_pb2_grpc
from specdec.serving.status import status_for

# gRPC ends a call at its deadline on its own clock; a call ending this close to the job's
# deadline counts as expired, not cancelled
DEADLINE_SLACK_S = 0.01
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


@dataclass(frozen=True, slots=True)
class Backend:
    """What the servicer needs once the services are up."""

    scheduler: Scheduler
    served: Served
    tokenizer: TextTokenizer
    model_info: Callable[[], generate_pb2.ServedModelInfo]
    metrics: JobMetrics | None = None


class CallLimit:
    """Counts the calls in flight, up to `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._lock = threading.Lock()

    def enter(self) -> bool:
        """Counts one more call; False (and counts nothing) at the limit."""
        with self._lock:
            if self.in_flight >= self.limit:
                return False
            self.in_flight += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, max_concurrent_calls: int) -> None:
        self.backend: Backend | None = None
        self.calls = CallLimit(max_concurrent_calls)

    def _backend(self, context: grpc.ServicerContext) -> Backend:
        if self.backend is None:
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "The services are still starting; the health service reports SERVING once "
                "every pair is warm.",
            )
        assert self.backend is not None
        return self.backend

    @contextmanager
    def _slot(self, context: grpc.ServicerContext) -> Iterator[None]:
        """Holds one of the max_concurrent_calls slots while the call runs, or refuses it."""
        if not self.calls.enter():
            if self.backend is not None and self.backend.metrics is not None:
                self.backend.metrics.on_error(grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"The server holds at most max_concurrent_calls={self.calls.limit} Generate/"
                f"Complete calls at once and is at that limit; retry later, or start it with a "
                f"larger --max-concurrent-calls (and --max-workers).",
            )
        try:
            yield
        finally:
            self.calls.leave()

    def _submit(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext) -> Job:
        b = self._backend(context)
        try:
            record, sampling = parse_request(request, b.served, b.tokenizer)
            job = Job(record, sampling, deadline_of(context), b.metrics)
            b.scheduler.submit(job)
        except Exception as e:  # refused before it ran: still an error by status code
            if b.metrics is not None:
                b.metrics.on_error(status_for(e)[0])
            raise

        def cancelled() -> None:  # runs whenever the call ends; a no-op once the job ended
            if job.deadline is not None and time.monotonic() >= job.deadline - DEADLINE_SLACK_S:
                b.scheduler.cancel(job, grpc.StatusCode.DEADLINE_EXCEEDED, "The deadline passed.")
            else:
                b.scheduler.cancel(job, grpc.StatusCode.CANCELLED, "The client cancelled the call.")

        if not context.add_callback(cancelled):
            cancelled()  # the call ended already
        return job

    def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[generate_pb2.GenerateResponse]:
        with self._slot(context):
            yield from self._submit(request, context).responses(context)

    def Complete(
        self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> generate_pb2.GenerateResponse:
        with self._slot(context):
            job = self._submit(request, context)
            for _ in job.responses(context):
                pass
            return job.record.complete_response()

    def SetSpeculation(
        self, request: generate_pb2.SetSpeculationRequest, context: grpc.ServicerContext
    ) -> generate_pb2.SetSpeculationResponse:
        b = self._backend(context)
        rid = request.request_id
        if not rid:
            raise ValueError("request_id must name a running or queued request.")
        proposer, k = speculation_of(request.speculation, b.served)
        if not b.scheduler.set_speculation(rid, proposer, k):
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"No request {rid!r} is running or queued (it may have finished).",
            )
        return generate_pb2.SetSpeculationResponse(
            request_id=rid,
            proposer=PROPOSERS[proposer],  # type: ignore[arg-type]
            num_draft_tokens=k,
        )

    def GetModelInfo(
        self, request: generate_pb2.GetServedModelInfoRequest, context: grpc.ServicerContext
    ) -> generate_pb2.ServedModelInfo:
        return self._backend(context).model_info()


def add_to_server(servicer: GenerateServicer, server: Any) -> None:
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
