"""What the client APIs (gRPC `servicer`, HTTP `orchestrator.web.api`) share: one call limit,
one way in to the scheduler and one way to end a call, so that both feed the same queue and
metrics.

A call holds a `slot` while it runs (past `max_concurrent_calls`, gRPC and HTTP together, it is
refused with RESOURCE_EXHAUSTED), `submit`s a GenerateRequest (validated by `parse_request`,
refusals counted by status code), reads its job's outbox, and calls `end` however it ends: a
job still running is then cancelled (a no-op once it finished).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from orchestrator.core.detokenizer import TextTokenizer
from orchestrator.core.requests import Job, JobMetrics, Outbox, Served, parse_request
from orchestrator.core.scheduler import Scheduler
from specdec.errors import SpecdecError, UnavailableError
from specdec.pb.specdec.v1 import generate_pb2
from specdec.serving.status import status_for

# gRPC ends a call at its deadline on its own clock; a call ending this close to the job's
# deadline counts as expired, not cancelled
DEADLINE_SLACK_S = 0.01


class TooManyCallsError(SpecdecError):
    """max_concurrent_calls calls are in flight already."""

    grpc_code = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True, slots=True)
class Backend:
    """What the client APIs need once the services are up."""

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


class Frontend:
    """The scheduler as the client APIs see it; `backend` is set once every pair is warm."""

    def __init__(self, max_concurrent_calls: int) -> None:
        self.backend: Backend | None = None
        self.serving = False  # what the health service says
        self.calls = CallLimit(max_concurrent_calls)

    def ready(self) -> Backend:
        """The backend; UnavailableError while the services are still starting."""
        if self.backend is None:
            raise UnavailableError(
                "The services are still starting; the health service reports SERVING (and "
                "HTTP /health 200) once every pair is warm."
            )
        return self.backend

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Holds one of the max_concurrent_calls slots while the call runs, or refuses it."""
        if not self.calls.enter():
            if self.backend is not None and self.backend.metrics is not None:
                self.backend.metrics.on_error(grpc.StatusCode.RESOURCE_EXHAUSTED)
            raise TooManyCallsError(
                f"The server holds at most max_concurrent_calls={self.calls.limit} generation "
                f"calls at once (gRPC and HTTP together) and is at that limit; retry later, or "
                f"start it with a larger --max-concurrent-calls (and --max-workers)."
            )
        try:
            yield
        finally:
            self.calls.leave()

    def submit(
        self, request: generate_pb2.GenerateRequest, deadline: float | None, outbox: Outbox | None
    ) -> Job:
        """The request's job, accepted by the scheduler (it runs or waits); a refusal raises
        (ValueError naming the field, QueueFullError, ...) and is counted by status code."""
        b = self.ready()
        try:
            record, sampling = parse_request(request, b.served, b.tokenizer)
            job = Job(record, sampling, deadline, b.metrics, outbox)
            b.scheduler.submit(job)
        except Exception as e:
            self.refused(e)
            raise
        return job

    def refused(self, error: Exception) -> None:
        """Counts a request refused before it ran, by status code (once serving)."""
        if self.backend is not None and self.backend.metrics is not None:
            self.backend.metrics.on_error(status_for(error)[0])

    def end(self, job: Job) -> None:
        """The call ended: the job stops if it still runs (a no-op once it finished)."""
        scheduler = self.ready().scheduler
        if job.deadline is not None and time.monotonic() >= job.deadline - DEADLINE_SLACK_S:
            scheduler.cancel(job, grpc.StatusCode.DEADLINE_EXCEEDED, "The deadline passed.")
        else:
            scheduler.cancel(job, grpc.StatusCode.CANCELLED, "The client cancelled the call.")
