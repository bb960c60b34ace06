"""The orchestrator's part in the hub tests: a `Driver` over a real `PairClient` that records
each request's committed tokens, applies every verdict once by (request id, step), admits
requests as steps go by and releases each one once it has enough tokens; and the services
with their engines, on loopback ports (`bench.local`)."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.local import LocalPair, local_pair
from orchestrator.core.pair import (
    Admitted,
    PairAdmission,
    PairClient,
    Proposer,
    StepEvent,
    StepReport,
)
from specdec.sampling_params import SamplingParams
from specdec.serving.messages import RequestError
from target_service.config import TargetConfig
from tests.draft_service.models import model_draft, runner_config

GREEDY = SamplingParams(temperature=0.0)


@contextmanager
def hub_services(target_dir: Path, draft_dir: Path, **target_options: Any) -> Iterator[LocalPair]:
    """Draft and target services (`bench.local`); the target's hub uses the draft. The
    rejection sampler runs its pure-torch implementation (bit-equal to the kernels; the Triton
    interpreter costs about 1 s per step on a CPU). `target_options`: more TargetConfig
    fields."""
    target = TargetConfig(
        runner_config(target_dir), draft_wait_s=5.0, sampler_impl="torch", **target_options
    )
    with local_pair(model_draft(draft_dir), target) as pair:
        yield pair


@dataclass
class Record:
    """The orchestrator's record of one request."""

    prompt: list[int]
    proposer: Proposer
    tokens: list[int]
    next_step: int = 0
    events: list[StepEvent] = field(default_factory=list)
    admitted: Admitted | RequestError | None = None
    error: RequestError | None = None
    done: bool = False

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]


class Driver:
    """Runs requests through the hub the way the orchestrator does (see the module docstring)."""

    def __init__(self, address: str, max_new_tokens: int):
        self.max_new_tokens = max_new_tokens
        self.records: dict[str, Record] = {}
        self.reports: list[StepReport] = []
        self.draft_events: list[str] = []  # "down" / "up", in order
        self._events: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.client = PairClient(
            address,
            on_step=self._events.put,
            on_admitted=lambda rid, result: self._events.put((rid, result)),
            on_draft_down=lambda: self._events.put("down"),
            on_draft_up=lambda: self._events.put("up"),
            timeout_s=30.0,
        )

    def admit(
        self,
        rid: str,
        prompt: list[int],
        proposer: Proposer,
        k: int,
        max_length: int = 0,
        sampling: SamplingParams = GREEDY,
        fixed_k: bool = False,
    ) -> None:
        self.records[rid] = Record(list(prompt), proposer, list(prompt))
        admission = PairAdmission(rid, tuple(prompt), sampling, proposer, k, max_length=max_length,
                                  fixed_num_draft_tokens=fixed_k)  # fmt: skip
        self.client.admit(admission)

    def readmit(self, rid: str, k: int, sampling: SamplingParams) -> None:
        """Admits a request again from its record (prompt + committed tokens, next step), as
        the orchestrator does after a failed step."""
        rec = self.records[rid]
        rec.error, rec.done, rec.admitted = None, False, None
        admission = PairAdmission(
            rid, tuple(rec.tokens), sampling, rec.proposer, k, first_step=rec.next_step
        )
        self.client.admit(admission)

    def handle(self, timeout_s: float = 30.0) -> object:
        """Waits for the next callback and applies it; returns it."""
        event = self._events.get(timeout=timeout_s)
        if isinstance(event, StepReport):
            self.reports.append(event)
            for e in event.events:
                self._apply(e)
        elif isinstance(event, tuple):
            if event[0] in self.records:
                self.records[event[0]].admitted = event[1]
                if isinstance(event[1], Admitted) and event[1].first is not None:
                    self._apply(event[1].first)
        else:
            assert isinstance(event, str)
            self.draft_events.append(event)
        return event

    def _apply(self, e: StepEvent) -> None:
        rec = self.records.get(e.request_id)
        if rec is None or rec.done or e.step < rec.next_step:
            return  # released, or a verdict already applied
        assert e.step == rec.next_step, f"{e.request_id}: step {e.step}, expected {rec.next_step}"
        if e.error is not None:
            rec.error, rec.done = e.error, True
            return
        assert len(e.token_ids) == e.num_accepted + 1 and e.num_accepted <= e.num_draft_tokens
        rec.events.append(e)
        rec.tokens.extend(e.token_ids)
        rec.next_step = e.step + 1
        if len(rec.generated) >= self.max_new_tokens:
            rec.done = True
            self.client.release([e.request_id])

    def pending(self) -> bool:
        """Whether a callback is waiting to be handled."""
        return not self._events.empty()

    def run(self, on_step: Callable[[int], None] = lambda n: None, timeout_s: float = 60.0) -> None:
        """Handles events until every request is done; on_step(n) after the n-th step report."""
        deadline = time.monotonic() + timeout_s
        while not all(r.done for r in self.records.values()):
            assert time.monotonic() < deadline, "the requests did not finish in time"
            if isinstance(self.handle(), StepReport):
                on_step(len(self.reports))

    def until(self, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            self.handle(max(0.0, deadline - time.monotonic()))
