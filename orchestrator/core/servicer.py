"""`specdec.v1.GenerateService`: protobuf in, scheduler jobs, protobuf out.

Calls before the services are ready answer UNAVAILABLE; past `max_concurrent_calls` calls in
flight (`orchestrator.core.frontend`, shared with the HTTP API), RESOURCE_EXHAUSTED at once (each
Generate or Complete holds a server thread, and the server's threads are sized for that many).
Errors become statuses through the server's interceptor: a ValueError from validation is
INVALID_ARGUMENT naming the field, a full queue RESOURCE_EXHAUSTED; a request's own failure
aborts only its call.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import grpc

from orchestrator.core.frontend import Frontend
from orchestrator.core.requests import Job, deadline_of, speculation_of
from specdec.pb.specdec.v1 import generate_pb2, generate_pb2_grpc
from specdec.serving.proposers import TO_PB

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    def _submit(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext) -> Job:
        job = self.frontend.submit(request, deadline_of(context), None)
        end = partial(self.frontend.end, job)  # runs whenever the call ends
        if not context.add_callback(end):
            end()  # the call ended already
        return job

    def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[generate_pb2.GenerateResponse]:
        with self.frontend.slot():
            yield from self._submit(request, context).responses(context)

    def Complete(
        self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> generate_pb2.GenerateResponse:
        with self.frontend.slot():
            job = self._submit(request, context)
            for _ in job.responses(context):
                pass
            return job.record.complete_response()

    def SetSpeculation(
        self, request: generate_pb2.SetSpeculationRequest, context: grpc.ServicerContext
    ) -> generate_pb2.SetSpeculationResponse:
        b = self.frontend.ready()
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
            proposer=TO_PB[proposer],
            num_draft_tokens=k,
        )

    def GetModelInfo(
        self, request: generate_pb2.GetServedModelInfoRequest, context: grpc.ServicerContext
    ) -> generate_pb2.ServedModelInfo:
        return self.frontend.ready().model_info()


def add_to_server(servicer: GenerateServicer, server: Any) -> None:
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
