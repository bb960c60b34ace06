"""The scheduler's routing, bounded queue, cancellation, deadlines and draft recovery, driven
through fake pair clients (no Ray, no services)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from orchestrator.core.pair import Admitted, PairAdmission, StepEvent, StepReport
from orchestrator.core.scheduler import DuplicateRequestError, QueueFullError, Scheduler
from specdec.sampling_params import SamplingParams
from specdec.serving.messages import ErrorReason, RequestError


@dataclass
class FakePair:
    admitted: list[str] = field(default_factory=list)
    admissions: list[PairAdmission] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    drafts: list[tuple[str | None, dict[str, Any]]] = field(default_factory=list)
    speculation: list[tuple[str, str, int]] = field(default_factory=list)

    def admit(self, admission: PairAdmission) -> None:
        self.admitted.append(admission.request_id)
        self.admissions.append(admission)

    def release(self, request_ids: Sequence[str]) -> None:
        self.released.extend(request_ids)

    def set_draft(self, address: str | None, records: Mapping[str, Any]) -> None:
        self.drafts.append((address, dict(records)))

    def set_speculation(self, request_id: str, proposer: str, num_draft_tokens: int) -> None:
        self.speculation.append((request_id, proposer, num_draft_tokens))


@dataclass
class FakeJob:
    request_id: str
    max_tokens: int = 3
    proposer: str = "draft"
    deadline: float | None = None
    tokens: list[int] = field(default_factory=list)
    next_step: int = 0
    error: tuple[grpc.StatusCode, str] | None = None
    shutdown: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    num_draft_tokens: int = 2
    tracks_admission: bool = False  # as the servicer's Job: awaiting_admission until answered
    awaiting_admission: bool = False

    def admission(self) -> PairAdmission:
        self.awaiting_admission = self.tracks_admission
        tokens, next_step = self.readmission()
        proposer, k = self.proposer, self.num_draft_tokens
        return PairAdmission(self.request_id, tokens, SamplingParams(0.0), proposer, k, next_step)  # type: ignore[arg-type]

    def set_speculation(self, proposer: str, num_draft_tokens: int) -> None:
        self.proposer, self.num_draft_tokens = proposer, num_draft_tokens

    def readmission(self) -> tuple[tuple[int, ...], int]:
        return (1, 2, *self.tokens), self.next_step

    def on_admitted(self, admitted: Admitted) -> None:
        self.awaiting_admission = False

    def on_event(self, event: StepEvent) -> bool:
        self.tokens.extend(event.token_ids)
        self.next_step = event.step + 1
        finished = len(self.tokens) >= self.max_tokens
        if finished:
            self.done.set()
        return finished

    def on_error(self, code: grpc.StatusCode, message: str) -> None:
        self.error = (code, message)
        self.done.set()

    def on_shutdown(self) -> None:
        self.shutdown = True
        self.done.set()


def step(*events: StepEvent, draft_up: bool = True) -> StepReport:
    return StepReport(tuple(events), 0.0, 0.0, 0.0, 0.0, 0.0, draft_up)


def event(request_id: str, step: int, *tokens: int) -> StepEvent:
    return StepEvent(request_id, step, tuple(tokens), len(tokens) - 1, len(tokens) - 1, None)


def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


@pytest.fixture
def make() -> Iterator[Callable[..., tuple[Scheduler, list[FakePair]]]]:
    made: list[Scheduler] = []

    def build(capacities: Sequence[int], max_queue: int, **kw: Any) -> Any:
        sched = Scheduler(capacities, max_queue, **kw)
        pairs = [FakePair() for _ in capacities]
        for i, p in enumerate(pairs):
            sched.attach(i, p)
        sched.start()
        made.append(sched)
        return sched, pairs

    yield build
    for s in made:
        s.stop()


def test_routes_each_request_to_the_least_loaded_pair(make: Any) -> None:
    sched, (a, b) = make([2, 2], 4)
    for count, name in enumerate("wxy", 1):
        sched.submit(FakeJob(name))
        eventually(lambda c=count: len(a.admitted + b.admitted) == c)  # type: ignore[misc]
    assert a.admitted == ["w", "y"] and b.admitted == ["x"]


def test_a_late_cancel_spares_a_newer_request_with_the_same_id(make: Any) -> None:
    sched, (pair,) = make([2], 0)
    old, new = FakeJob("a", max_tokens=1), FakeJob("a", max_tokens=2)
    sched.submit(old)
    eventually(lambda: pair.admitted == ["a"])
    sched.post_step(0, step(event("a", 0, 3)))
    eventually(old.done.is_set)
    sched.submit(new)
    sched.cancel(old, grpc.StatusCode.CANCELLED, "the old call ended")
    sched.post_step(0, step(event("a", 0, 4, 5)))
    eventually(new.done.is_set)
    assert new.error is None and new.tokens == [4, 5]


def test_a_released_requests_late_verdict_skips_a_newer_request_with_the_same_id(
    make: Any,
) -> None:
    """The hub may have verdicts of a finished request in flight when a new request reuses
    its id; before the new admission is answered they are the old one's (a fuzzed client once
    got INTERNAL "expected the verdict of step 0, got step 25")."""
    sched, (pair,) = make([2], 0)
    old = FakeJob("a", max_tokens=1)
    sched.submit(old)
    eventually(lambda: pair.admitted == ["a"])
    sched.post_step(0, step(event("a", 0, 3)))
    eventually(old.done.is_set)
    new = FakeJob("a", max_tokens=2, tracks_admission=True)
    sched.submit(new)
    eventually(lambda: pair.admitted == ["a", "a"])
    sched.post_step(0, step(event("a", 1, 9)))  # the old request's next step
    sched.post_admitted(0, "a", Admitted(2, 0.01))
    sched.post_step(0, step(event("a", 0, 4, 5)))
    eventually(new.done.is_set)
    assert new.error is None and new.tokens == [4, 5]


def test_queue_waits_then_refuses_beyond_max_queue(make: Any) -> None:
    sched, (pair,) = make([1], 1)
    first, second = FakeJob("a", max_tokens=2), FakeJob("b")
    sched.submit(first)
    sched.submit(second)
    with pytest.raises(QueueFullError, match="max_queue=1"):
        sched.submit(FakeJob("c"))
    eventually(lambda: pair.admitted == ["a"])
    sched.post_step(0, step(event("a", 0, 5, 6)))
    eventually(lambda: pair.admitted == ["a", "b"])
    assert first.tokens == [5, 6] and first.error is None and pair.released == ["a"]
    sched.submit(FakeJob("c"))  # room again: one running, one waiting


def test_duplicate_running_id_is_refused(make: Any) -> None:
    sched, _ = make([2], 2)
    sched.submit(FakeJob("a"))
    with pytest.raises(DuplicateRequestError, match="'a' is already running"):
        sched.submit(FakeJob("a"))


def test_cancel_releases_running_and_drops_waiting(make: Any) -> None:
    sched, (pair,) = make([1], 2)
    running, waiting = FakeJob("a"), FakeJob("b")
    sched.submit(running)
    sched.submit(waiting)
    eventually(lambda: pair.admitted == ["a"])
    sched.cancel(waiting, grpc.StatusCode.CANCELLED, "client went away")
    sched.cancel(running, grpc.StatusCode.CANCELLED, "client went away")
    eventually(lambda: running.done.is_set() and waiting.done.is_set())
    assert pair.released == ["a"] and pair.admitted == ["a"]
    assert running.error is not None and running.error[0] == grpc.StatusCode.CANCELLED
    sched.post_step(0, step(event("a", 0, 7)))  # a late verdict is dropped
    time.sleep(0.05)
    assert running.tokens == []


def test_deadline_expires_running_and_waiting_requests(make: Any) -> None:
    sched, (pair,) = make([1], 2)
    soon = time.monotonic() + 0.1
    running, waiting = FakeJob("a", deadline=soon), FakeJob("b", deadline=soon)
    sched.submit(running)
    sched.submit(waiting)
    eventually(lambda: running.done.is_set() and waiting.done.is_set())
    for job in (running, waiting):
        assert job.error is not None and job.error[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert pair.released == ["a"]


def test_step_error_fails_only_that_request(make: Any) -> None:
    sched, (pair,) = make([2], 0)
    bad, good = FakeJob("bad"), FakeJob("good", max_tokens=1)
    sched.submit(bad)
    sched.submit(good)
    eventually(lambda: len(pair.admitted) == 2)
    error = RequestError(ErrorReason.NONFINITE_LOGITS, grpc.StatusCode.INTERNAL, "nan")
    sched.post_step(0, step(StepEvent("bad", 0, (), 0, 0, error), event("good", 0, 9)))
    eventually(lambda: bad.done.is_set() and good.done.is_set())
    assert bad.error == (grpc.StatusCode.INTERNAL, "nan") and good.error is None
    assert pair.released == ["good"]  # the hub released "bad" itself


def test_failed_step_is_readmitted_once_from_the_record(make: Any) -> None:
    sched, (pair,) = make([2], 0)
    job = FakeJob("a", max_tokens=10)
    sched.submit(job)
    eventually(lambda: pair.admitted == ["a"])
    sched.post_step(0, step(event("a", 0, 4, 5)))
    failed = RequestError(ErrorReason.STEP_FAILED, grpc.StatusCode.INTERNAL, "step failed")
    sched.post_step(0, step(StepEvent("a", 1, (), 0, 0, failed)))
    eventually(lambda: pair.admitted == ["a", "a"])
    assert pair.admissions[-1].token_ids == (1, 2, 4, 5) and pair.admissions[-1].first_step == 1
    sched.post_step(0, step(event("a", 1, 6)))
    sched.post_step(0, step(StepEvent("a", 2, (), 0, 0, failed)))
    eventually(job.done.is_set)
    assert job.tokens == [4, 5, 6] and job.error == (grpc.StatusCode.INTERNAL, "step failed")


def test_admission_error_frees_the_slot(make: Any) -> None:
    sched, (pair,) = make([1], 1)
    job, other = FakeJob("a"), FakeJob("b")
    sched.submit(job)
    sched.submit(other)
    eventually(lambda: pair.admitted == ["a"])
    error = RequestError(ErrorReason.CAPACITY, grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    sched.post_admitted(0, "a", error)
    eventually(lambda: pair.admitted == ["a", "b"])
    assert job.error == (grpc.StatusCode.RESOURCE_EXHAUSTED, "full")


def test_draft_down_recovers_with_the_records(make: Any) -> None:
    calls: list[int] = []

    def recover(index: int) -> str:
        calls.append(index)
        return "10.0.0.1:5000"

    sched, (pair,) = make([2], 0, has_draft=True, recover=recover)
    job = FakeJob("a", max_tokens=10)
    sched.submit(job)
    eventually(lambda: pair.admitted == ["a"])
    sched.post_step(0, step(event("a", 0, 4, 5)))
    sched.post_draft_down(0)
    sched.post_step(0, step(event("a", 1, 6), draft_up=False))
    eventually(lambda: len(pair.drafts) == 1)
    assert calls == [0]
    assert pair.drafts[0] == ("10.0.0.1:5000", {"a": ((1, 2, 4, 5, 6), 2)})
    sched.post_step(0, step(event("a", 2, 7), draft_up=False))  # SetDraft not applied yet
    sched.post_step(0, step(event("a", 3, 8), draft_up=True))
    time.sleep(0.1)
    assert calls == [0] and len(pair.drafts) == 1


def test_stop_ends_every_request(make: Any) -> None:
    sched, _ = make([1], 1)
    jobs = [FakeJob("a"), FakeJob("b")]
    for j in jobs:
        sched.submit(j)
    sched.stop()
    assert all(j.shutdown for j in jobs)


def test_set_speculation_reaches_the_running_pair_and_the_record(make) -> None:  # type: ignore[no-untyped-def]
    sched, [pair] = make([1], max_queue=2)
    running, waiting = FakeJob("a"), FakeJob("b")
    sched.submit(running)
    sched.submit(waiting)
    eventually(lambda: pair.admitted == ["a"])
    assert sched.set_speculation("a", "ngram", 3)
    assert pair.speculation == [("a", "ngram", 3)] and running.proposer == "ngram"
    assert sched.set_speculation("b", "off", 0)  # waiting: only its record changes
    assert pair.speculation == [("a", "ngram", 3)]
    assert not sched.set_speculation("nobody", "off", 0)
    sched.post_step(0, step(event("a", 0, 5, 6, 7)))  # "a" finishes; "b" is admitted
    eventually(lambda: pair.admitted == ["a", "b"])
    assert pair.admissions[1].proposer == "off" and pair.admissions[1].num_draft_tokens == 0
    assert not sched.set_speculation("a", "draft", 2), "a finished request was changed"


def test_the_admissions_first_verdict_is_applied_and_can_finish_the_request(make) -> None:  # type: ignore[no-untyped-def]
    sched, [pair] = make([1], max_queue=1)
    one, more = FakeJob("one", max_tokens=1), FakeJob("more", max_tokens=3)
    sched.submit(one)
    sched.submit(more)
    eventually(lambda: pair.admitted == ["one"])
    sched.post_admitted(0, "one", Admitted(5, 0.01, event("one", 0, 7)))
    eventually(one.done.is_set)  # one token was all it wanted: finished and released
    assert one.tokens == [7] and pair.released == ["one"]
    eventually(lambda: pair.admitted == ["one", "more"])
    sched.post_admitted(0, "more", Admitted(5, 0.01, event("more", 0, 8)))
    sched.post_step(0, step(event("more", 1, 9, 10)))
    eventually(more.done.is_set)
    assert more.tokens == [8, 9, 10] and more.error is None


def test_a_verdict_is_counted_under_the_proposer_that_drafted_it(make) -> None:  # type: ignore[no-untyped-def]
    """The request switches to "off" while a step drafted by the draft model is in flight: that
    step's verdict still counts under "draft" (the hub names its proposer), and "off" shows no
    drafts, as it never drafts."""
    from orchestrator.core.metrics import Metrics

    metrics = Metrics("pair")
    sched, [pair] = make([1], max_queue=1, observer=metrics)
    job = FakeJob("a", max_tokens=10)
    sched.submit(job)
    eventually(lambda: pair.admitted == ["a"])
    assert sched.set_speculation("a", "off", 0) and job.proposer == "off"
    drafted = StepEvent("a", 0, (5, 6), 3, 1, None, "draft")  # drafted before the switch
    after = StepEvent("a", 1, (7,), 0, 0, None, "off")
    sched.post_step(0, step(drafted))
    sched.post_step(0, step(after))
    eventually(lambda: job.tokens == [5, 6, 7])

    def value(name: str, proposer: str) -> float | None:
        labels = {"model_pair": "pair", "proposer": proposer}
        return metrics.registry.get_sample_value(f"specdec:spec_decode_{name}_total", labels)

    assert [value(n, "draft") for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")] \
        == [1, 3, 1]  # fmt: skip
    assert [value(n, "off") for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")] \
        == [0, 0, 0]  # fmt: skip


def test_step_report_reads_each_verdict_s_proposer() -> None:
    from specdec.pb import target_pb2
    from specdec.pb.specdec.v1 import generate_pb2
    from specdec.serving.verdicts import VerifyResponse

    verdicts = VerifyResponse.pending(["a", "b", "c"], [4, 5, 6])
    ids = [generate_pb2.PROPOSER_DRAFT, generate_pb2.PROPOSER_NGRAM, generate_pb2.PROPOSER_OFF]
    report = StepReport.from_pb(target_pb2.ServeStep(verdicts=verdicts.to_pb(), proposers=ids))
    assert [(e.request_id, e.proposer) for e in report.events] == [
        ("a", "draft"), ("b", "ngram"), ("c", "off")
    ]  # fmt: skip
    unnamed = StepReport.from_pb(target_pb2.ServeStep(verdicts=verdicts.to_pb()))
    assert [e.proposer for e in unnamed.events] == [None, None, None]
