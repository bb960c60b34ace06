"""Admission, routing and the bounded queue: which request runs on which pair, and when.

Continuous batching happens in the hubs (requests join and leave between steps); the scheduler
admits each request to the least-loaded pair with room, releases it when it finishes, fails or
is cancelled, and keeps the rest waiting in arrival order. Beyond `max_queue` waiting requests
a new one is refused at once (RESOURCE_EXHAUSTED); running ones are never touched.

All state lives on the scheduler's own thread. The PairClients' callbacks, the servicer's
threads and the recovery threads (waiting for a restarted draft or target) only post events to
its queue, so no callback blocks and no lock guards the request tables; `submit` alone takes a
lock, for the capacity count it must answer synchronously.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from orchestrator.core.pair import Admitted, PairAdmission, StepEvent, StepReport
from specdec.errors import SpecdecError, UnavailableError
from specdec.serving.messages import ErrorReason, RequestError

log = logging.getLogger(__name__)
TICK_S = 0.05  # deadline resolution when nothing else happens
RECOVERY_BACKOFF_S = 1.0


class QueueFullError(SpecdecError):
    """Every pair is at its max_requests and max_queue requests are already waiting."""

    grpc_code = "RESOURCE_EXHAUSTED"


class DuplicateRequestError(SpecdecError, ValueError):
    """A request id that is already running or waiting."""

    grpc_code = "ALREADY_EXISTS"


class Job(Protocol):
    """One request as the scheduler drives it (the servicer's side implements it)."""

    @property
    def request_id(self) -> str: ...

    @property
    def deadline(self) -> float | None: ...  # time.monotonic() seconds

    @property
    def proposer(self) -> str: ...

    # an admission was sent and not yet answered: verdicts for its id are stale
    awaiting_admission: bool

    def admission(self) -> PairAdmission: ...  # from the record: a re-admission goes on

    def readmission(self) -> tuple[tuple[int, ...], int]: ...  # (prompt + committed, next step)

    def on_admitted(self, admitted: Admitted) -> None: ...

    def set_speculation(self, proposer: str, num_draft_tokens: int) -> None: ...  # the record's

    def on_event(self, event: StepEvent) -> bool: ...  # True once finished

    def on_error(self, code: grpc.StatusCode, message: str) -> None: ...  # terminal

    def on_shutdown(self) -> None: ...  # terminal: the server stopped it


class Pair(Protocol):
    """The PairClient methods the scheduler calls."""

    def admit(self, admission: PairAdmission) -> None: ...

    def release(self, request_ids: Sequence[str]) -> None: ...

    def set_speculation(self, request_id: str, proposer: str, num_draft_tokens: int) -> None: ...

    def set_draft(
        self, address: str | None, records: Mapping[str, tuple[tuple[int, ...], int]]
    ) -> None: ...


class Observer(Protocol):
    """Where the scheduler reports steps and queue sizes (the metrics)."""

    def on_step(self, report: StepReport, proposer_of: Callable[[str], str | None]) -> None: ...

    def set_queue(self, running: int, waiting: int) -> None: ...


def _proposer(job: Job | None) -> str | None:
    return job.proposer if job is not None else None


@dataclass(slots=True)
class _PairState:
    index: int
    capacity: int
    client: Pair | None = None
    running: dict[str, Job] = field(default_factory=dict)
    has_draft: bool = False
    draft_up: bool = True
    alive: bool = True
    recovering: bool = False
    awaiting_up: bool = False  # a SetDraft was sent and the hub has not answered yet
    last_recovery: float = -RECOVERY_BACKOFF_S


class Scheduler:
    """Routes requests over pairs with `capacities[i]` slots each.

    `recover(i)`, when given, blocks until pair i's draft service is back and returns its
    address; it runs on a thread of its own after the hub reports the draft down.
    `reconnect(i, request_ids)`, when given, blocks until pair i's target service is back and
    returns a new client to it, after the hub's stream failed; the pair's running requests
    wait meanwhile and are then admitted again from their records.
    """

    def __init__(
        self,
        capacities: Sequence[int],
        max_queue: int,
        *,
        has_draft: bool = False,
        recover: Callable[[int], str] | None = None,
        reconnect: Callable[[int, list[str]], Pair] | None = None,
        observer: Observer | None = None,
        on_serving: Callable[[bool], None] | None = None,
    ):
        assert capacities and all(c >= 1 for c in capacities), capacities
        self._pairs = [_PairState(i, c, has_draft=has_draft) for i, c in enumerate(capacities)]
        self.max_queue = max_queue
        self._recover = recover
        self._reconnect = reconnect
        self._on_serving = on_serving  # False while no pair has a target, True when one is back
        self._observer = observer
        self._events: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]]
        self._events = queue.SimpleQueue()
        self._waiting: deque[Job] = deque()
        self._lock = threading.Lock()
        self._active: set[str] = set()  # accepted and not finished; guarded by _lock
        self._retried: set[str] = set()  # re-admitted once after a failed step
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self._stopping = False

    def attach(self, index: int, client: Pair) -> None:
        """Gives pair `index` its client (before `start`)."""
        self._pairs[index].client = client

    def start(self) -> None:
        assert all(p.client is not None for p in self._pairs), "attach every pair first"
        self._thread.start()

    @property
    def capacity(self) -> int:
        return sum(p.capacity for p in self._pairs)

    # ---- called from other threads: they only post events ----

    def submit(self, job: Job) -> None:
        """Accepts `job` (it runs or waits) or raises QueueFullError / DuplicateRequestError."""
        with self._lock:
            if self._stopping:
                raise SpecdecError("The server is shutting down.")
            if job.request_id in self._active:
                raise DuplicateRequestError(
                    f"request_id {job.request_id!r} is already running; ids must be unique "
                    f"among running requests."
                )
            if len(self._active) >= self.capacity + self.max_queue:
                raise QueueFullError(
                    f"The server is full: every pair is at its max_requests "
                    f"({self.capacity} running) and max_queue={self.max_queue} requests are "
                    f"waiting; retry later."
                )
            self._active.add(job.request_id)
        self._post(self._on_submit, job)

    def cancel(self, job: Job, code: grpc.StatusCode, message: str) -> None:
        """Stops `job` (client gone) unless it ended already: released on its pair within one
        step. The job itself, not its id, so that a late cancel never hits a newer request
        that reuses the id."""
        self._post(self._on_cancel, job, code, message)

    def set_speculation(
        self, request_id: str, proposer: str, num_draft_tokens: int, timeout_s: float = 10.0
    ) -> bool:
        """Gives a running or waiting request new speculation settings from its next step
        (checked by the caller); False if no such request is running or waiting. Raises
        UnavailableError once the server is stopping, or when the scheduler did not answer."""
        with self._lock:
            if self._stopping:
                raise UnavailableError("The server is shutting down.")
        done: Future[bool] = Future()
        self._post(self._on_set_speculation, request_id, proposer, num_draft_tokens, done)
        try:
            return done.result(timeout_s)
        except TimeoutError:
            message = f"The scheduler did not answer within {timeout_s:g} s."
            raise UnavailableError(message) from None

    def post_step(self, pair: int, report: StepReport) -> None:
        self._post(self._on_step, pair, report)

    def post_admitted(self, pair: int, request_id: str, result: Admitted | RequestError) -> None:
        self._post(self._on_admitted, pair, request_id, result)

    def post_draft_down(self, pair: int) -> None:
        self._post(self._on_draft_down, pair)

    def post_closed(self, pair: int, error: BaseException | None) -> None:
        """Pair `pair`'s stream to its hub ended (its target failed, or shutdown)."""
        self._post(self._on_closed, pair, error)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends every request with on_shutdown and stops the thread."""
        with self._lock:
            self._stopping = True
        self._post(self._on_stop)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _post(self, handler: Callable[..., None], *args: Any) -> None:
        self._events.put((handler, args))

    # ---- the scheduler thread ----

    def _run(self) -> None:
        while True:
            try:
                handler, args = self._events.get(timeout=TICK_S)
            except queue.Empty:
                handler, args = self._on_tick, ()
            try:
                handler(*args)
            except Exception:  # one bad event must not stop every request
                log.exception("scheduler: %s failed", getattr(handler, "__name__", handler))
            if handler == self._on_stop:
                return
            if handler != self._on_tick:
                self._on_tick()
            self._schedule()

    def _finish(self, pair: _PairState | None, request_id: str, release: bool) -> None:
        if pair is not None:
            pair.running.pop(request_id, None)
            if release and pair.alive:
                assert pair.client is not None
                pair.client.release([request_id])
        self._retried.discard(request_id)
        with self._lock:
            self._active.discard(request_id)

    def _find(self, request_id: str) -> tuple[_PairState | None, Job | None]:
        for p in self._pairs:
            if request_id in p.running:
                return p, p.running[request_id]
        job = next((j for j in self._waiting if j.request_id == request_id), None)
        return None, job

    def _on_submit(self, job: Job) -> None:
        self._waiting.append(job)

    def _on_cancel(self, job: Job, code: grpc.StatusCode, message: str) -> None:
        pair, found = self._find(job.request_id)
        if found is not job:
            return  # finished already
        if pair is None:
            self._waiting.remove(job)
        self._finish(pair, job.request_id, release=True)
        job.on_error(code, message)

    def _on_set_speculation(
        self, request_id: str, proposer: str, num_draft_tokens: int, done: Future[bool]
    ) -> None:
        try:
            pair, job = self._find(request_id)
            if job is not None:
                job.set_speculation(proposer, num_draft_tokens)  # a re-admission keeps them
                if pair is not None and pair.alive:
                    assert pair.client is not None
                    pair.client.set_speculation(request_id, proposer, num_draft_tokens)
        except BaseException as e:  # the caller waits on `done`: it must always be answered
            done.set_exception(e)
            raise
        done.set_result(job is not None)

    def _on_admitted(self, index: int, request_id: str, result: Admitted | RequestError) -> None:
        pair = self._pairs[index]
        job = pair.running.get(request_id)
        if job is None:
            return  # cancelled while being admitted; its release is on the way
        if isinstance(result, Admitted):
            job.on_admitted(result)
            if result.first is not None and self._apply(pair, result.first):
                self._finish(pair, request_id, release=True)  # one token was all it wanted
            return
        self._finish(pair, request_id, release=True)
        job.on_error(result.code, result.message)

    def _on_step(self, index: int, report: StepReport) -> None:
        pair = self._pairs[index]
        if self._observer is not None:  # before the step's verdicts end any request
            self._observer.on_step(report, lambda rid: _proposer(pair.running.get(rid)))
        done = [e.request_id for e in report.events if self._apply(pair, e)]
        for request_id in done:
            self._finish(pair, request_id, release=False)
        if done:  # one control for all of them
            assert pair.client is not None
            pair.client.release(done)
        pair.draft_up = report.draft_up
        if report.draft_up:
            pair.awaiting_up = False
        elif pair.has_draft and not pair.awaiting_up:
            self._start_recovery(pair)

    def _apply(self, pair: _PairState, event: StepEvent) -> bool:
        """Applies one verdict; True when its request finished and is to be released."""
        job = pair.running.get(event.request_id)
        if job is None or job.awaiting_admission:
            return False  # released or cancelled (maybe under a reused id): a late verdict
        if event.error is None:
            return job.on_event(event)
        # the hub released the request already; a failed step left it as it was, so it is
        # admitted again once from its record (re-prefill), and fails on a second failure
        if event.error.reason == ErrorReason.STEP_FAILED and job.request_id not in self._retried:
            log.warning("request %r: step failed (%s); re-admitting it", job.request_id,
                        event.error.message)  # fmt: skip
            self._retried.add(job.request_id)
            assert pair.client is not None
            pair.client.admit(job.admission())
            return False
        self._finish(pair, event.request_id, release=False)
        job.on_error(event.error.code, event.error.message)
        return False

    def _on_tick(self) -> None:
        now = time.monotonic()
        expired = [
            j
            for j in (*self._waiting, *(j for p in self._pairs for j in p.running.values()))
            if j.deadline is not None and j.deadline <= now
        ]
        for job in expired:
            self._on_cancel(
                job, grpc.StatusCode.DEADLINE_EXCEEDED, "The request's deadline passed."
            )
        if self._observer is not None:
            running = sum(len(p.running) for p in self._pairs)
            self._observer.set_queue(running, len(self._waiting))

    def _schedule(self) -> None:
        while self._waiting:
            free = [p for p in self._pairs if p.alive and len(p.running) < p.capacity]
            if not free:
                return
            pair = min(free, key=lambda p: (len(p.running) / p.capacity, p.index))
            job = self._waiting.popleft()
            assert pair.client is not None
            pair.running[job.request_id] = job
            try:
                pair.client.admit(job.admission())
            except Exception as e:
                self._finish(pair, job.request_id, release=False)
                job.on_error(grpc.StatusCode.UNAVAILABLE, f"admission failed: {e}")

    # ---- target recovery ----

    def _on_closed(self, index: int, error: BaseException | None) -> None:
        pair = self._pairs[index]
        pair.alive = False
        if self._stopping:
            return
        log.error("pair %d: the target's Serve stream ended: %s", index, error)
        if self._on_serving is not None and not any(p.alive for p in self._pairs):
            self._on_serving(False)
        if self._reconnect is None:
            self._on_target_back(index, None, f"The target service of pair {index} failed.")
            return
        ids = list(pair.running)
        threading.Thread(target=self._reconnect_target, args=(index, ids), daemon=True).start()

    def _reconnect_target(self, index: int, request_ids: list[str]) -> None:
        assert self._reconnect is not None
        try:
            self._post(self._on_target_back, index, self._reconnect(index, request_ids), "")
        except Exception as e:
            log.error("pair %d: target recovery failed: %s", index, e)
            self._post(self._on_target_back, index, None, f"pair {index}'s target is gone: {e}")

    def _on_target_back(self, index: int, client: Pair | None, failure: str) -> None:
        """Re-admits the pair's requests to its new hub; fails them if there is none."""
        pair = self._pairs[index]
        if client is None or self._stopping:
            for job in list(pair.running.values()):
                self._finish(pair, job.request_id, release=False)
                job.on_error(grpc.StatusCode.UNAVAILABLE, failure)
            if not any(p.alive for p in self._pairs):
                while self._waiting:
                    job = self._waiting.popleft()
                    self._finish(None, job.request_id, release=False)
                    job.on_error(grpc.StatusCode.UNAVAILABLE, "No target service is left.")
            return
        pair.client, pair.alive = client, True
        if self._on_serving is not None:
            self._on_serving(True)
        log.info("pair %d: target back; re-admitting %d request(s)", index, len(pair.running))
        for job in pair.running.values():
            client.admit(job.admission())  # prompt + committed tokens, from the next step

    # ---- draft recovery ----

    def _on_draft_down(self, index: int) -> None:
        """The hub says its draft is down (or a new one could not be reached)."""
        pair = self._pairs[index]
        pair.draft_up = False
        pair.awaiting_up = False
        self._start_recovery(pair)

    def _start_recovery(self, pair: _PairState) -> None:
        if self._recover is None or pair.recovering or self._stopping:
            return
        pair.recovering = True
        wait = max(0.0, pair.last_recovery + RECOVERY_BACKOFF_S - time.monotonic())
        log.warning("pair %d: draft service down; waiting for Ray to restart it", pair.index)
        threading.Thread(target=self._recover_draft, args=(pair.index, wait), daemon=True).start()

    def _recover_draft(self, index: int, wait_s: float) -> None:
        assert self._recover is not None
        time.sleep(wait_s)  # a draft that fails again at once is not retried in a busy loop
        try:
            address: str | None = self._recover(index)
        except Exception as e:
            log.error("pair %d: draft recovery failed: %s", index, e)
            address = None
        self._post(self._on_draft_back, index, address)

    def _on_draft_back(self, index: int, address: str | None) -> None:
        pair = self._pairs[index]
        pair.recovering = False
        pair.last_recovery = time.monotonic()
        if address is None or self._stopping:
            return
        records = {rid: job.readmission() for rid, job in pair.running.items()}
        log.info("pair %d: draft back at %s; re-admitting %d request(s)", index, address,
                 len(records))  # fmt: skip
        assert pair.client is not None
        pair.awaiting_up = True  # until a step runs with it, or the hub says it is down
        pair.client.set_draft(address, records)

    def _on_stop(self) -> None:
        jobs = [*self._waiting, *(j for p in self._pairs for j in p.running.values())]
        self._waiting.clear()
        for p in self._pairs:
            p.running.clear()
        with self._lock:
            self._active.clear()
        for job in jobs:
            job.on_shutdown()

    def snapshot(self) -> tuple[int, int, list[bool]]:
        """(running, waiting, draft up per pair); approximate when read off-thread."""
        running = sum(len(p.running) for p in self._pairs)
        return running, len(self._waiting), [p.draft_up for p in self._pairs]
