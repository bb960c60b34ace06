"""The step loop with the target as hub (`TargetService.Serve`).

One orchestrator opens a Serve stream; a loop thread in this process then runs steps for as
long as it has requests. A step collects proposals for a group of requests, verifies the group
in one block and publishes the verdicts:
- PROPOSER_DRAFT requests get drafts (and q) from the draft service over one long-lived
  Propose stream; q never leaves the draft → target hop;
- PROPOSER_NGRAM requests get prompt lookup computed here (no q, no network hop);
- PROPOSER_OFF requests, and draft requests while the draft is down, decode one token (k = 0).
The local entries' columns are appended to the draft's DraftBlock, so the target scores every
request of the step in one forward.

Controls (admit, release, set_speculation, set_draft) are applied at step boundaries, in the
order sent. `target_service.hub_draft` keeps which requests the draft service holds and what it
has been told, so each ask carries the tokens committed since as `new_token_ids`.

Failures: a request whose verdict is an error is released on both services (the orchestrator
may admit it again from its record). An exception inside a step fails that step's requests
only (ERROR_REASON_STEP_FAILED) and the loop goes on. If the draft service fails, the step is
proposed again at k = 0 (nothing was committed), a draft_down event goes out, and draft
requests run at k = 0 until set_draft names a new draft service: the hub admits them there
from the orchestrator's records plus the tokens it committed after them, and speculation
resumes. If the draft does not answer within its deadline, the step goes on at k = 0 the same
way, but the draft is only stalled: the hub resynchronises it by itself once it answers again
(`target_service.hub_draft`). Each step reports why draft requests ran at k = 0, and how many.

A step's state lives in a `_Group`, so that two groups in flight (the draft proposing for one
while the target verifies the other) can come without changing the step's parts.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

import grpc

from specdec.errors import CacheFullError, InvalidInputError
from specdec.pb import common_pb2, draft_pb2, target_pb2
from specdec.runner.trace import host_span, trace_of
from specdec.serving.blocks import Q_NONE, DraftBlock
from specdec.serving.messages import AdmitRequest, ErrorReason, RequestError
from specdec.serving.ngram import NgramConfig, propose_ngram
from specdec.serving.proposers import FROM_PB, TO_PB
from specdec.serving.status import status_for
from specdec.serving.verdicts import VerifyResponse
from target_service.draft_link import DraftLink
from target_service.engine import TargetEngine
from target_service.hub_draft import DraftSide, HubRequest
from target_service.servicer import TargetServicer
from target_service.speculation import KChooser

log = logging.getLogger(__name__)

_STOP = object()
STEP_TIME_WEIGHT = 0.1  # of each new step in the step time sent to the draft
WAIT_POLL_S = 0.005  # between looks at a stalled draft while only seeded requests wait for it


@dataclass(slots=True)
class _Prefill:
    """An admission whose prompt is prefilled a chunk at a time (`prefill_chunk_tokens`)."""

    pb: target_pb2.ServeAdmit
    adm: AdmitRequest
    proposer: str
    num_draft_tokens: int
    start: float  # when the admission arrived


@dataclass(slots=True)
class _Group:
    """One step: its requests, then the block being built and the draft's times."""

    requests: list[HubRequest]
    block: common_pb2.DraftBlock = field(default_factory=common_pb2.DraftBlock)
    poll_s: float = 0.0  # waiting for draft admissions (and a resynchronisation) first
    asked: bool = False  # the draft service was asked for this group
    drafted: bool = False  # and answered
    draft_s: float = 0.0
    transport_s: float = 0.0
    draft_graphed: bool = True  # the draft's forwards replayed graphs (or it drafted nothing)
    ahead_hits: int = 0  # the draft's asks answered from drafts made ahead, and those missed
    ahead_misses: int = 0
    ahead_s: float = 0.0  # the draft's passes ahead since it last answered
    ahead_backups: int = 0  # asks that missed and got no drafts, so the step did not wait
    pushed: int = 0  # asks answered from chains pushed before the verdict (no wait at all)
    push_backups: int = 0  # asks that missed the pushed chains and got no drafts (no wait)
    fallback: int = target_pb2.DRAFT_FALLBACK_NONE  # why draft requests ran at k = 0, and how many
    num_fallback: int = 0


class _Refused(Exception):
    """The target's sampler refused a request's first token: its verdict's error."""

    def __init__(self, error: RequestError):
        super().__init__(error.message)
        self.error = error


def request_error(exc: BaseException) -> RequestError:
    """The RequestError of an exception raised while serving one request."""
    code, message = status_for(exc)
    if isinstance(exc, CacheFullError):
        reason = ErrorReason.CAPACITY
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        reason = ErrorReason.INVALID_ARGUMENT
    else:
        reason = ErrorReason.STEP_FAILED
    return RequestError(reason, code, message)


def _speculation(proposer: int, num_draft_tokens: int, limit: int) -> tuple[str, int]:
    """("draft" | "ngram" | "off", k); ValueError naming the field."""
    name = FROM_PB.get(proposer)
    if name is None:
        raise InvalidInputError(
            f"proposer must be PROPOSER_DRAFT, PROPOSER_NGRAM or PROPOSER_OFF, got {proposer} "
            "(the orchestrator resolves PROPOSER_DEFAULT)."
        )
    if name != "off" and not 0 <= num_draft_tokens <= limit:
        raise InvalidInputError(
            f"num_draft_tokens must be in [0, {limit}], got {num_draft_tokens}."
        )
    return name, num_draft_tokens


class Hub:
    """The loop of one Serve stream: `control` feeds it, `events` drains it."""

    def __init__(
        self,
        engine: TargetEngine,
        on_end: Callable[[], None] = lambda: None,
        open_link: Callable[[str], DraftLink] | None = None,
    ):
        """`open_link` connects to a draft service by address (default: gRPC, `DraftLink`)."""
        self.engine = engine
        self._trace = trace_of(getattr(engine, "runner", None))  # host spans, where tracing is on
        self._on_end = on_end  # after every request is released and the draft link closed
        self._config = engine.config
        self._controls: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[target_pb2.ServeEvent | None] = queue.SimpleQueue()
        self._requests: dict[str, HubRequest] = {}
        self._prefills: dict[str, _Prefill] = {}  # admissions prefilled a chunk per step
        self._draft = DraftSide(self._config, engine.info, self._requests, self._emit, open_link)
        self._ngram = NgramConfig()
        self._max_seq_len = engine.info.max_seq_len
        self._chooser = (KChooser(self._config.max_num_draft_tokens)
                         if self._config.dynamic_speculation else None)  # fmt: skip
        self._k_cap: int | None = None  # this step's k for the draft's requests, when dynamic
        self._target_step_s = 0.0  # recent step time less the wait for the draft (0: unknown)
        self._prefix_seen = self._prefix_totals()  # the prefix cache's counts already reported
        self._thread = threading.Thread(target=self._run, name="hub", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def control(self, pb: target_pb2.ServeControl) -> None:
        self._controls.put(pb)

    def stop(self) -> None:
        """Ends the loop after its current step; its requests are then released."""
        self._controls.put(_STOP)

    def join(self) -> None:
        self._thread.join()

    def events(self) -> Iterator[target_pb2.ServeEvent]:
        """The events, until the loop has ended."""
        return iter(self._events.get, None)

    def _emit(self, **event: object) -> None:
        self._events.put(target_pb2.ServeEvent(**event))  # type: ignore[arg-type]

    def _run(self) -> None:
        try:
            self._start()
            while self._apply(self._take()):
                if self._prefills:
                    self._prefill_next()
                if self._steppable():
                    self._step()
                elif self._draft.admitting:  # no step polls them: settle what has ended
                    self._draft.settle_done()
        except Exception:
            log.exception("the hub's loop failed")
        finally:
            try:
                self._release([*self._requests, *self._prefills])
                self._draft.close()
            finally:
                self._events.put(None)
                self._on_end()

    def _start(self) -> None:
        address = self._config.draft_address
        failure = None if address is None else self._draft.connect(address)
        started = target_pb2.ServeStarted(target=self.engine.info.to_pb())
        if self._draft.link is not None:
            started.draft.CopyFrom(self._draft.link.info.to_pb())
        self._emit(started=started)
        if failure is not None:
            self._emit(draft_down=target_pb2.DraftDown(message=failure))

    def _steppable(self) -> bool:
        return any(not r.done for r in self._requests.values())

    def _take(self) -> list[object]:
        """The controls sent so far; waits for one while there is nothing to step."""
        busy = self._steppable() or self._prefills
        if not busy and self._draft.admitting:  # idle, a draft admission to settle when it ends
            try:
                controls = [self._controls.get(timeout=WAIT_POLL_S)]
            except queue.Empty:
                controls = []
            self._draft.settle_done()
        else:
            controls = [] if busy else [self._controls.get()]
        while True:
            try:
                controls.append(self._controls.get_nowait())
            except queue.Empty:
                return controls

    def _apply(self, controls: Iterable[object]) -> bool:
        """Applies the controls in order; False once the stream has ended."""
        for pb in controls:
            if pb is _STOP:
                return False
            assert isinstance(pb, target_pb2.ServeControl)
            kind = pb.WhichOneof("control")
            try:
                if kind == "admit":
                    self._admit(pb.admit)
                elif kind == "release":
                    self._release(list(pb.release.request_ids))
                elif kind == "set_speculation":
                    self._set_speculation(pb.set_speculation)
                elif kind == "set_draft":
                    records = {r.request_id: r for r in pb.set_draft.records}
                    self._draft.replace(pb.set_draft.address, records)
            except Exception:  # one bad control must not end the stream
                log.exception("control %s failed", kind)
        return True

    # Controls

    def _admit(self, pb: target_pb2.ServeAdmit) -> None:
        rid = pb.request.request_id
        start = time.perf_counter()
        try:
            adm = AdmitRequest.from_pb(pb.request)
            limit = self._config.max_num_draft_tokens
            proposer, k = _speculation(pb.proposer, pb.num_draft_tokens, limit)
            chunk = self._config.prefill_chunk_tokens
            if chunk and adm.first_step == 0 and len(adm.prompt_token_ids) > chunk:
                self.engine.begin_prefill(adm)  # its chunks run between steps: `_prefill_next`
                self._prefills[rid] = _Prefill(pb, adm, proposer, k, start)
                return
            verdicts = self._prefill(adm)
        except Exception as e:
            self._refuse(rid, e)
            return
        self._admitted(pb, adm, proposer, k, verdicts, start)

    def _prefill_next(self) -> None:
        """One chunk of the oldest chunked admission; with its last, the request is admitted
        (its first token goes out) and steps from the next one on."""
        rid, p = next(iter(self._prefills.items()))
        try:
            done = self.engine.prefill_chunk(rid, self._config.prefill_chunk_tokens)
            if done is not None and done[0].errors:
                raise _Refused(done[0].errors[0])
        except Exception as e:  # the engine holds nothing of it any more
            del self._prefills[rid]
            self._refuse(rid, e)
            return
        if done is not None:
            del self._prefills[rid]
            self._admitted(p.pb, p.adm, p.proposer, p.num_draft_tokens, done[0], p.start)

    def _refuse(self, rid: str, e: Exception) -> None:
        error = e.error if isinstance(e, _Refused) else request_error(e)
        self._emit(admitted=target_pb2.ServeAdmitted(request_id=rid, error=error.to_pb()))

    def _admitted(
        self,
        pb: target_pb2.ServeAdmit,
        adm: AdmitRequest,
        proposer: str,
        k: int,
        verdicts: VerifyResponse | None,
        start: float,
    ) -> None:
        """A request the target has prefilled: to the draft (when it drafts), then into the
        steps, its first token out."""
        rid, pending = adm.request_id, None
        try:
            if proposer == "draft":  # after the target's prefill, which it would slow down on a
                # shared GPU; it runs while the first token goes out
                first_step = adm.first_step + (verdicts is not None)
                pending = self._draft.start_admit(replace(adm, first_step=first_step))
        except Exception as e:
            self.engine.release([rid])
            self._refuse(rid, e)
            return
        tokens = [*adm.prompt_token_ids, *(verdicts.token_ids[0] if verdicts else ())]
        next_step = adm.first_step + (verdicts is not None)
        req = HubRequest(rid, adm.sampling, proposer, k, tokens, next_step)
        req.max_length, req.fixed_k = pb.max_length, pb.fixed_num_draft_tokens
        self._requests[rid] = req
        admitted = target_pb2.ServeAdmitted(
            request_id=rid, committed_length=len(tokens), next_step=next_step,
            prefill_s=time.perf_counter() - start,
            verdicts=verdicts.to_pb() if verdicts else None,
        )  # fmt: skip
        self._emit(admitted=admitted)  # the first token goes out before the draft is waited for
        if pending is not None:  # settled at the next step, up to the draft's deadline
            self._draft.defer(pending, [req])

    def _prefill(self, adm: AdmitRequest) -> VerifyResponse | None:
        """A new request (step 0) gets its first token decoded in its prefill's forward: the
        verdict of step 0. A re-admission (a later first step, after a failure or a restart)
        is only prefilled, so that its next step is verified at its own k exactly as it would
        have been without the failure: a seeded output does not depend on a retry."""
        if adm.first_step > 0:
            self.engine.admit(adm)
            self.engine.runner.synchronize()  # the prefill's time, not its launches
            return None
        verdicts, _ = self.engine.admit_decoding(adm)
        if verdicts.errors:
            raise _Refused(verdicts.errors[0])
        return verdicts

    def _release(self, request_ids: list[str]) -> None:
        prefilling = [rid for rid in dict.fromkeys(request_ids) if rid in self._prefills]
        for rid in prefilling:  # released before its first token; every admit is answered
            del self._prefills[rid]
        self.engine.release(prefilling)
        for rid in prefilling:
            gone = RequestError.of(ErrorReason.UNKNOWN_REQUEST, "released during its prefill")
            self._emit(admitted=target_pb2.ServeAdmitted(request_id=rid, error=gone.to_pb()))
        ids = [rid for rid in dict.fromkeys(request_ids) if rid in self._requests]
        held = [self._requests.pop(rid) for rid in ids]
        if held:
            self.engine.release(ids)
            self._draft.release(held)

    def _set_speculation(self, pb: target_pb2.SetSpeculation) -> None:
        req = self._requests.get(pb.request_id)
        prefill = self._prefills.get(pb.request_id)
        if req is None and prefill is None:
            return  # released meanwhile
        try:
            limit = self._config.max_num_draft_tokens
            proposer, k = _speculation(pb.proposer, pb.num_draft_tokens, limit)
        except ValueError as e:
            log.warning("set_speculation for %r ignored: %s", pb.request_id, e)
            return
        if req is None:  # still in its prefill: takes effect at its admission
            assert prefill is not None
            prefill.proposer, prefill.num_draft_tokens = proposer, k
            return
        if proposer != "draft":
            self._draft.release([req])  # it would miss steps; re-admitted if it comes back
        req.proposer, req.num_draft_tokens = proposer, k
        if proposer == "draft" and not req.on_draft:
            self._draft.admit([req], {})

    # The step

    def _step(self) -> None:
        start = time.perf_counter()
        running = [r for r in self._requests.values() if not r.done]
        group = _Group([r for r in running if not self._draft.waits_for_draft(r)])
        if not group.requests:  # seeded requests wait out a draft stall (`hub_draft`)
            self._draft.poll()
            time.sleep(WAIT_POLL_S)
            return
        self._k_cap = self._choose_k(group)
        verify_s = sampler_s = verified = 0.0
        graphed = False
        try:
            block = self._proposals(group)
            if not group.requests:  # its seeded requests sit out a stall that began now
                return
            # a block told to the draft (k = 0) leaves once the verify is launched
            verdicts, times = self.engine.verify_timed(block, self._draft.flush)
            verified = time.perf_counter()
            # a block sent without waiting is answered by now: read it before any control
            # (a release, a re-admission) reaches the draft ahead of that block
            self._collect(group)
            host_span(self._trace, "read the draft's answer", verified)
            verified = time.perf_counter()
            verify_s, sampler_s = times.forward_s, times.sampler_s
            graphed = times.graphed and group.draft_graphed
        except Exception as e:
            log.exception("a step of %d requests failed", len(group.requests))
            # a block told to the draft goes out and is answered before the failed requests'
            # release does (`_record`), as after a step that succeeded
            self._collect(group)
            verdicts = self._failed(group, e)
        else:
            self._observe(group, verdicts, time.perf_counter() - start)
            if group.drafted:  # less what drafting now cost it: a backup saves that only
                own_s = time.perf_counter() - start - group.draft_s - group.poll_s
                old = self._target_step_s or own_s
                self._target_step_s = old + STEP_TIME_WEIGHT * (own_s - old)
        step = target_pb2.ServeStep(
            verdicts=verdicts.to_pb(), draft_s=group.draft_s, transport_s=group.transport_s,
            verify_s=verify_s, sampler_s=sampler_s, step_s=time.perf_counter() - start,
            draft_up=self._draft.up, graphed=graphed,
            draft_ahead_hits=group.ahead_hits, draft_ahead_misses=group.ahead_misses,
            draft_ahead_s=group.ahead_s, draft_ahead_backups=group.ahead_backups,
            draft_ahead_pushed=group.pushed, draft_ahead_push_backups=group.push_backups,
            proposers=_proposers(group, verdicts),  # type: ignore[arg-type]
            draft_fallback=group.fallback,  # type: ignore[arg-type]
            num_fallback_requests=group.num_fallback,
        )  # fmt: skip
        totals = self._prefix_totals()
        step.prefix_cache_queried_tokens = totals[0] - self._prefix_seen[0]
        step.prefix_cache_hit_tokens = totals[1] - self._prefix_seen[1]
        self._prefix_seen = totals
        self._emit(step=step)
        self._record(verdicts)
        if verified:  # the host's work after the verify, the draft's answer read, to the step's end
            host_span(self._trace, "after the verify", verified)

    def _prefix_totals(self) -> tuple[int, int]:
        """(prompt tokens looked up, found) in the target's prefix cache since it started."""
        stats = getattr(self.engine, "prefix_cache_stats", None)  # the tests' fakes have none
        return (stats.queried_tokens, stats.hit_tokens) if stats is not None else (0, 0)

    def _choose_k(self, group: _Group) -> int | None:
        """The k of this step's draft requests under dynamic speculation, else None."""
        if self._chooser is None:
            return None
        drafted = [r for r in group.requests if r.proposer == "draft"]
        asked = [r.num_draft_tokens for r in drafted if not r.fixed_k]
        fixed = max((r.num_draft_tokens for r in drafted if r.fixed_k), default=0)
        if not asked:
            return None
        return self._chooser.choose(len(group.requests), max(asked), fixed)

    def _observe(self, group: _Group, verdicts: VerifyResponse, step_s: float) -> None:
        """What dynamic speculation learns from a step: its draft requests' k and acceptance,
        and its times."""
        if self._chooser is None or (group.asked and not group.drafted):
            return  # a step that asked the draft in vain (waited out its deadline, or it
            # failed) times neither k > 0 nor k = 0
        ks, accepted = [], []
        for i, rid in enumerate(verdicts.request_ids):
            req = self._requests.get(rid)
            if req is not None and req.proposer == "draft" and i not in verdicts.errors:
                ks.append(verdicts.num_draft_tokens[i])
                accepted.append(verdicts.num_accepted[i])
        # the wait for draft admissions is not the step's: it is left out
        step_s -= group.poll_s
        self._chooser.observe(len(group.requests), ks, accepted, step_s, group.draft_s)

    def _proposals(self, group: _Group) -> DraftBlock:
        """The group's block; a malformed one from the draft counts as the draft failing."""
        self._propose(group)
        limit = self._config.max_support_size
        try:
            return DraftBlock.from_pb(group.block, max_support_size=limit)
        except ValueError as e:
            if not group.drafted:
                raise
            self._draft.down(f"The draft service sent a malformed DraftBlock: {e}")
        retry = _Group(group.requests)  # at k = 0 now, nothing was committed
        self._propose(retry)
        group.block, group.draft_s, group.transport_s = retry.block, 0.0, 0.0
        group.draft_graphed, group.drafted = True, False  # no drafts: it answered in vain
        group.ahead_hits = group.ahead_misses = group.ahead_backups = 0  # not used
        group.pushed = group.push_backups = 0
        group.fallback, group.num_fallback = retry.fallback, retry.num_fallback
        return DraftBlock.from_pb(group.block, max_support_size=limit)

    def _propose(self, group: _Group) -> None:
        """Fills group.block: the draft's proposals, then the local entries (ngram, k = 0)."""
        start = time.perf_counter()
        self._draft.poll(self._target_step_s)
        self._collect(group)  # if the last step failed before it read it
        group.poll_s = time.perf_counter() - start
        asks = [r for r in group.requests if r.on_draft]
        group.asked = bool(asks)
        answer = None
        pushed = None
        told = False
        if asks:
            entries = [self._ask(r) for r in asks]
            told = self._draft.tell(asks, entries, self._target_step_s)
            if not told:
                pushed = self._draft.from_push(asks, entries, self._target_step_s)
            if not told and pushed is None:
                answer = self._draft.propose(asks, entries, self._target_step_s)
        served: set[str] = set()
        if told:  # no ask wants drafts: the draft's answer is read after the verify
            group.drafted = True
        if pushed is not None:  # every ask's verdict had a chain or was backed up: no wait
            block, backups = pushed
            group.block, group.drafted, group.draft_graphed = block, True, True
            served = set(block.request_ids)
            group.ahead_hits = group.pushed = sum(n > 0 for n in block.num_draft_tokens)
            group.ahead_misses = group.ahead_backups = group.push_backups = backups
        if answer is not None:  # else the draft failed: this step goes on at k = 0
            response, round_trip = answer
            group.block, group.drafted = response.block, True
            served = set(response.block.request_ids)
            group.draft_s = response.timing.forward_s
            group.transport_s = max(0.0, round_trip - response.timing.service_s)
            group.draft_graphed = response.timing.graphed or response.timing.forward_s == 0
            group.ahead_hits = response.draft_ahead_hits
            group.ahead_misses = response.draft_ahead_misses
            group.ahead_s += response.draft_ahead_s
            group.ahead_backups = response.draft_ahead_backups
        if answer is None and pushed is None and not told:  # seeded requests sit out a stall
            group.requests = [r for r in group.requests if not self._draft.waits_for_draft(r)]
        host_span(self._trace, "wait for drafts", start)
        local = [r for r in group.requests if r.request_id not in served]
        self._append_local(group.block, local)
        # fallen back: draft requests that would have been drafted for (k > 0) but were not
        fallen = sum(r.proposer == "draft" and self._k(r) > 0 for r in local)
        if fallen and (self._draft.stalled or not self._draft.up):
            group.num_fallback = fallen
            group.fallback = (
                target_pb2.DRAFT_FALLBACK_DEADLINE if self._draft.stalled
                else target_pb2.DRAFT_FALLBACK_UNAVAILABLE
            )  # fmt: skip

    def _collect(self, group: _Group) -> None:
        """Reads the draft's answer to a block sent without waiting (`DraftSide.collect`); the
        passes ahead it reports ran during this group's verify. An answer that does not come
        (the draft failed or stalled) makes it a step that asked the draft in vain."""
        sending = self._draft.sending
        collected = self._draft.collect()
        if collected is not None:
            group.ahead_s += collected.draft_ahead_s
        elif sending:
            group.drafted = False

    def _ask(self, r: HubRequest) -> draft_pb2.ProposeEntry:
        return draft_pb2.ProposeEntry(
            request_id=r.request_id, step=r.next_step, new_token_ids=r.tokens[r.told :],
            committed_length=len(r.tokens), num_draft_tokens=self._k(r),
            fixed_num_draft_tokens=r.fixed_k,
        )  # fmt: skip

    def _k(self, r: HubRequest) -> int:
        """The request's k this step: its setting, within the services' limits and the
        request's max_length."""
        if r.proposer == "off":
            return 0
        k = min(r.num_draft_tokens, self._max_seq_len - len(r.tokens) - 1)
        if self._k_cap is not None and r.proposer == "draft" and not r.fixed_k:
            k = min(k, self._k_cap)
        if r.max_length:  # no drafts past the last token the orchestrator keeps
            k = min(k, r.max_length - len(r.tokens) - 1)
        if r.on_draft and self._draft.link is not None:
            info = self._draft.link.info
            k = min(k, info.max_num_draft_tokens, info.max_seq_len - len(r.tokens))
        return max(k, 0)

    def _append_local(self, block: common_pb2.DraftBlock, reqs: list[HubRequest]) -> None:
        """Entries with prompt-lookup drafts (no q) or none, appended as columns."""
        drafts = [
            propose_ngram(r.tokens, self._k(r), self._ngram) if r.proposer == "ngram" else []
            for r in reqs
        ]
        ids = [t for d in drafts for t in d]
        block.request_ids.extend([r.request_id for r in reqs])
        block.steps.extend([r.next_step for r in reqs])
        block.committed_lengths.extend([len(r.tokens) for r in reqs])
        block.num_draft_tokens.extend([len(d) for d in drafts])
        block.q_forms.extend([Q_NONE] * len(reqs))  # type: ignore[list-item]
        block.draft_token_ids += struct.pack(f"<{len(ids)}i", *ids)

    def _failed(self, group: _Group, e: Exception) -> VerifyResponse:
        verdicts = VerifyResponse.pending(
            [r.request_id for r in group.requests], [r.next_step for r in group.requests]
        )
        code, message = status_for(e)
        error = RequestError(ErrorReason.STEP_FAILED, code, f"The step failed: {message}")
        for i in range(len(verdicts)):
            verdicts.fail(i, error)
        return verdicts

    def _record(self, verdicts: VerifyResponse) -> None:
        """Applies the verdicts; a request with an error verdict is released."""
        failed = []
        for i, rid in enumerate(verdicts.request_ids):
            req = self._requests.get(rid)
            if req is None:
                continue
            if i in verdicts.errors:
                failed.append(rid)
            else:
                req.tokens.extend(verdicts.token_ids[i])
                req.next_step = verdicts.steps[i] + 1
        self._release(failed)


def _proposers(group: _Group, verdicts: VerifyResponse) -> list[int]:
    """Each verdict's proposer as it drafted the step: controls apply between steps."""
    proposer = {r.request_id: r.proposer for r in group.requests}
    return [TO_PB[proposer[rid]] for rid in verdicts.request_ids]


class HubServicer(TargetServicer):
    """The target's servicer plus Serve; one Serve stream at a time."""

    def __init__(self, engine: TargetEngine):
        super().__init__(engine)
        self._serving = threading.Lock()

    def Serve(
        self,
        request_iterator: Iterator[target_pb2.ServeControl],
        context: grpc.ServicerContext,
    ) -> Iterator[target_pb2.ServeEvent]:
        if not self._serving.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "A Serve stream is already open on this target service; it serves one "
                "orchestrator at a time.",
            )
        # The hub frees the gate when its loop has ended: after a cancellation gRPC may leave
        # this generator suspended instead of closing it.
        try:
            hub = Hub(self.engine, on_end=self._serving.release)
            context.add_callback(hub.stop)
            hub.start()
        except BaseException:
            self._serving.release()
            raise
        args = (request_iterator, hub)
        threading.Thread(target=_read_controls, args=args, daemon=True).start()
        try:
            yield from hub.events()
        finally:
            hub.stop()  # the client went away: the loop ends after its step


def _read_controls(request_iterator: Iterator[target_pb2.ServeControl], hub: Hub) -> None:
    """Feeds the stream's controls to the hub; its end (or cancellation) stops the hub."""
    try:
        for pb in request_iterator:
            hub.control(pb)
    except Exception as e:  # cancelled: the stream is gone either way
        log.info("Serve stream ended: %s", e)
    finally:
        hub.stop()
