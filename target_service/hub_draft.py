"""The hub's draft side: which draft service it uses, and which of its requests are admitted
there with how many of their tokens told (`target_service.hub` runs the loop).

A request admitted to the draft service has `on_draft`; `told` of its tokens are known there,
so the next ask carries the rest as new_token_ids. When the draft service fails every request
loses `on_draft` (they run at k = 0) until `replace` admits them to a new one: from the
orchestrator's record where it fits, and the next ask tops up what was committed after it.

A draft that misses its deadline (a Propose, Admit or Release not answered in time: a stopped
or overloaded process, a cut link) is *stalled*, not down: every request loses `on_draft` and
runs at k = 0, nothing more is sent there but one probe, and each step looks whether the probe
has been answered. Once it has, the draft is resynchronised: the requests it may still hold are
released there (whatever it did with the late call, nothing it answered was read), every
PROPOSER_DRAFT request is admitted again from the target's tokens, and speculation resumes. A
probe that fails makes the draft down. The deadline is `TargetConfig.draft_deadline_s`, or
DEADLINE_FACTOR times the median of the recent round trips where that is longer, so that a
loaded draft answering slowly but steadily is not taken for a stalled one.

A seeded sampled request (`fixed_k`) keeps its k whatever the draft's timing, because a step
at k = 0 draws other tokens than a speculative one: a Propose that asks for one waits up to
the longer `seeded_deadline_s` (DEADLINE_FACTOR deadlines), and while the draft is stalled such
requests sit steps out (`waits_for_draft`) instead of running at k = 0. A stall that outlasts
`seeded_deadline_s` takes the draft as down: only then does their k change (to 0, as their
responses' steps show), and the output stays the target's distribution either way.
"""

from __future__ import annotations

import logging
import statistics
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from specdec.pb import common_pb2, draft_pb2, target_pb2
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DenseQ, DraftBlock, DraftProposal, SparseQ, block_to_pb
from specdec.serving.messages import AdmitRequest, ModelInfo, chain_serves, check_compatible
from target_service.config import TargetConfig
from target_service.draft_link import DraftDown, DraftLink, DraftStalled, PendingAdmits

log = logging.getLogger(__name__)
_T = TypeVar("_T")
DEADLINE_FACTOR = 10.0  # the deadline is at least this many times the median round trip
ROUND_TRIPS = 64  # the recent Propose round trips that median is taken over


@dataclass(slots=True)
class HubRequest:
    """The hub's state of one running request."""

    request_id: str
    sampling: SamplingParams
    proposer: str  # "draft", "ngram" or "off"
    num_draft_tokens: int
    tokens: list[int]  # prompt + committed tokens, as the target holds them
    next_step: int
    on_draft: bool = False  # admitted on the current draft service
    told: int = 0  # how many of `tokens` the draft service knows
    max_length: int = 0  # left out of steps once it holds this many tokens; 0: no limit
    fixed_k: bool = False  # keeps num_draft_tokens under dynamic speculation (seeded, sampled)

    @property
    def done(self) -> bool:
        """It holds every token the orchestrator will keep: a step for it would be wasted."""
        return 0 < self.max_length <= len(self.tokens)


Emit = Callable[..., None]  # ServeEvent fields, e.g. emit(draft_down=...)


@dataclass(slots=True)
class _Admitting:
    """Draft admissions in flight, not settled yet; `waited`: a step already waited for them
    (it waits once: past that, they are looked at without waiting)."""

    pending: PendingAdmits
    reqs: list[HubRequest]
    waited: bool = False


@dataclass(slots=True)
class _Stall:
    """A draft that missed its deadline: the probe waiting for its answer, and the requests
    it may still hold."""

    probe: grpc.Future
    held: set[str] = field(default_factory=set)
    since: float = field(default_factory=time.monotonic)


PUSH_EXPLORE_EVERY = 256  # steps between two runs of the way not in use, to measure it again
PUSH_EXPLORE_STEPS = 8  # steps each such run lasts
PUSH_WAIT_WEIGHT = 0.25  # of each new measurement in PushChoice's averages


@dataclass(slots=True)
class PushChoice:
    """Whether the next block asks the draft to push its chains (ProposeBlock.push_chains),
    by which way the hub waits less for drafts after a verify, as measured.

    A pushed chain saves the ask's round trip only where the draft's pass ahead ends before
    the verify: the draft learns which chain the target took from the block the hub sends at
    the verify's start, so with pushes its next pass starts that block's transit later than
    after an answer. Where the pass ahead is longer than the verify (8B / 1B at batch 1 on
    H200s: 6 ms against 5 ms) that lands on every step: pushes made steps 10.4 ms against
    8.3 ms with asks. So each way's wait for drafts (with pushes: the wait for the push, and
    the ask after it on a miss; else the ask's round trip) is averaged, the shorter one is
    used, and the other runs PUSH_EXPLORE_STEPS steps in every PUSH_EXPLORE_EVERY so that its
    average follows the load. The choice moves time only: a pushed chain is the answer its
    ask would get, so the tokens are the same either way."""

    always: bool = False  # push with every block (TargetConfig.draft_push_always)
    wait_s: dict[bool, float] = field(default_factory=dict)  # per way: pushed (True) or asked
    counts: dict[bool, int] = field(default_factory=dict)  # steps measured per way
    steps: int = 0
    best: bool | None = None  # the way in use, once both are measured
    last: bool | None = None  # the way of the last step measured

    def waited(self, pushed: bool, seconds: float) -> None:
        """A step that used the way `pushed` waited `seconds` for its drafts. The first step
        after a change of way is counted but not averaged: the draft's timing is still the
        other way's then (a first wait of all can be a cold outlier too)."""
        self.counts[pushed] = self.counts.get(pushed, 0) + 1
        changed, self.last = pushed != self.last, pushed
        if changed:
            return
        old = self.wait_s.get(pushed)
        self.wait_s[pushed] = seconds if old is None else old + PUSH_WAIT_WEIGHT * (seconds - old)

    def next(self) -> bool:
        """The way of the next step: True to ask for a push with this block."""
        self.steps += 1
        if self.always:
            return True
        for way in (True, False):  # each way measured PUSH_EXPLORE_STEPS times first
            if self.counts.get(way, 0) < PUSH_EXPLORE_STEPS or way not in self.wait_s:
                return way
        best = self.wait_s[True] <= self.wait_s[False]
        if best != self.best:
            log.info("draft: %s (waits for drafts: %.2f ms with pushes, %.2f ms with asks)",
                     "pushes chains" if best else "asked for chains", self.wait_s[True] * 1e3,
                     self.wait_s[False] * 1e3)  # fmt: skip
            self.best = best
        exploring = self.steps % PUSH_EXPLORE_EVERY < PUSH_EXPLORE_STEPS
        return not best if exploring else best


class DraftSide:
    """The current draft service (or none) of a hub whose requests are `requests`."""

    def __init__(
        self,
        config: TargetConfig,
        target: ModelInfo,
        requests: Mapping[str, HubRequest],
        emit: Emit,
        open_link: Callable[[str], DraftLink] | None = None,
    ):
        self._config, self._target, self._requests, self._emit = config, target, requests, emit
        self._open_link = open_link or self._open_grpc_link
        self.link: DraftLink | None = None
        self._stall: _Stall | None = None
        self._admitting: list[_Admitting] = []  # not settled yet
        # a stalled draft taken as down may still hold requests: its address and their ids,
        # released there if it is named again (`replace`)
        self._left: tuple[str, set[str]] | None = None
        self._round_trips: deque[float] = deque(maxlen=ROUND_TRIPS)
        self._deadline_s = config.draft_deadline_s
        # a block sent without waiting (its pushed chains verified, or it asked for no drafts):
        # its asks, and the drafts verified for each request, until `collect` reads the
        # draft's answer; and whether its wait counts for the push's way (`_had_drafts`)
        self._sent: tuple[list[HubRequest], dict[str, list[int]], bool] | None = None
        # the block `tell` holds until `flush` sends it: its entries and target_step_s
        self._unsent: tuple[list[draft_pb2.ProposeEntry], float] | None = None
        self.push_mismatches = 0  # answers to such blocks that differed from the push
        self.push_choice = PushChoice(always=config.draft_push_always)
        # this step's wait for drafts: whether it came by a push (its last block asked for
        # one) and when it began, until the drafts are had (`PushChoice.waited`); and when
        # `collect` began waiting for the answer to a block sent without waiting (that wait
        # belongs to the push's way too)
        self._waiting: tuple[bool, float] | None = None
        self._collect_started: float | None = None

    @property
    def up(self) -> bool:
        return self.link is not None

    @property
    def stalled(self) -> bool:
        return self._stall is not None

    @property
    def seeded_deadline_s(self) -> float:
        """How long a step waits for the drafts of a seeded sampled request, and how long such
        requests wait out a stall before the draft is taken as down."""
        return DEADLINE_FACTOR * self._deadline_s

    def waits_for_draft(self, req: HubRequest) -> bool:
        """Whether the request sits this step out: seeded, sampled, drafted, and the draft is
        stalled (at k = 0 its output would depend on the draft's timing)."""
        stalled = self._stall is not None
        return stalled and req.fixed_k and req.proposer == "draft" and not req.done

    def poll(self, step_s: float = 0.0) -> None:
        """Settles the admissions made since the last step, and resynchronises a stalled
        draft that has answered its probe (or, if the probe failed, takes it as down); called
        at every step. The first step after an admission waits for it up to the deadline, or
        up to `step_s` (the target's recent step) where that is shorter: a longer wait would
        cost every running request more than this one loses by decoding at k = 0 meanwhile
        (a long prompt's prefill on the draft); later steps do not wait for it again."""
        wait_s = min(self._deadline_s, step_s) if step_s > 0 else self._deadline_s
        end = time.monotonic() + wait_s
        for item in list(self._admitting):
            if item not in self._admitting:  # cleared by an earlier settle (the draft down)
                continue
            # a seeded sampled request is waited for: at k = 0 meanwhile, its output would
            # depend on how fast the draft prefilled (a k = 0 step draws other tokens)
            fixed = any(r.fixed_k for r in item.reqs if self._requests.get(r.request_id) is r)
            until = time.monotonic() + self._admit_timeout_s() if fixed else end
            if item.waited and not fixed:
                until = time.monotonic()
            item.waited = True
            if item.pending.done(max(0.0, until - time.monotonic())):
                self._admitting.remove(item)
                self.settle(item.pending, item.reqs)
        stall = self._stall
        if stall is None:
            return
        if not stall.probe.done():
            waited = time.monotonic() - stall.since
            waiting = any(map(self.waits_for_draft, self._requests.values()))
            if waiting and waited > self.seeded_deadline_s and self.link is not None:
                self._left = (self.link.address, set(stall.held))
                self.down(f"The draft service has not answered for {waited:.1f} s; seeded "
                          "requests waiting for their drafts go on at k = 0.")  # fmt: skip
            return
        self._stall = None
        error = stall.probe.exception()
        if error is not None:
            self.down(f"The draft service stalled and then failed: {error}")
            return
        assert self.link is not None
        reqs = [r for r in self._requests.values() if r.proposer == "draft"]
        log.warning("the draft service answered again after %.2f s; resynchronising %d "
                    "request(s)", time.monotonic() - stall.since, len(reqs))  # fmt: skip
        self.link.reopen()
        self._release_ids(sorted(stall.held), self.link.timeout_s)
        self.admit(reqs, {})

    def _open_grpc_link(self, address: str) -> DraftLink:
        c = self._config
        try:
            # read at each connect: a draft that comes back after a certificate rotation works
            root = None if c.draft_tls_root_cert is None else c.draft_tls_root_cert.read_bytes()
        except OSError as e:
            raise DraftDown(
                f"Reading the draft's TLS root certificate {c.draft_tls_root_cert}: {e}"
            ) from e
        return DraftLink(
            address, c.server.max_message_bytes, c.draft_wait_s, root, c.draft_tls_server_name,
            push=c.draft_push_chains,
        )  # fmt: skip

    def connect(self, address: str) -> str | None:
        """Connects to the draft service at `address` and checks its tokenizer; else why not."""
        try:
            link = self._open_link(address)
        except DraftDown as e:
            return str(e)
        try:
            check_compatible(self._target, link.info)
        except ValueError as e:
            link.close()
            return f"Refusing the draft service at {address}: {e}"
        self.link = link
        return None

    def replace(self, address: str, records: Mapping[str, target_pb2.DraftRecord]) -> None:
        """Leaves the current draft service for the one at `address` (none if empty) and admits
        every PROPOSER_DRAFT request there; answers draft_up or draft_down."""
        self.release([r for r in self._requests.values() if r.on_draft])
        old = self.link.address if self.link is not None else None
        held = sorted(self._stall.held) if self._stall is not None else []
        if self._left is not None and old is None:  # went down from a stall
            old, held = self._left[0], sorted(self._left[1])
        self._left = None
        self.close()
        if not address:
            return
        failure = self.connect(address)
        if failure is not None:
            self._emit(draft_down=target_pb2.DraftDown(message=failure))
            return
        if address == old:  # the same service, back from a stall: it may hold them still
            self._release_ids(held, self.link.timeout_s if self.link else None)
        self.admit([r for r in self._requests.values() if r.proposer == "draft"], records)
        if self.link is not None:
            self._emit(draft_up=target_pb2.DraftUp(draft=self.link.info.to_pb()))

    def down(self, message: str) -> None:
        """The draft service failed: every request runs at k = 0; draft_down goes out."""
        if self.link is None:
            return
        log.warning("draft service down, requests run at k = 0: %s", message)
        self.close(graceful=False)
        self._emit(draft_down=target_pb2.DraftDown(message=message))

    def _stalled(self, message: str, held: list[str]) -> None:
        """The draft missed a deadline: every request runs at k = 0 until it answers."""
        assert self.link is not None
        self._sent = self._unsent = None  # its answer is never read: the stream is cancelled
        if self._stall is None:
            log.warning("draft service stalled, requests run at k = 0 until it answers: %s",
                        message)  # fmt: skip
            self._stall = _Stall(self.link.probe())
        self._stall.held.update(held)
        for item in self._admitting:
            item.pending.cancel()
            self._stall.held.update(a.request_id for a in item.pending.admissions)
        self._admitting.clear()
        for r in self._requests.values():
            if r.on_draft:
                self._stall.held.add(r.request_id)
                r.on_draft = False

    def close(self, graceful: bool = True) -> None:
        """Leaves the draft service; `graceful` (the stream's end, a new draft named), first
        settles the admissions still in flight (each within its timeout), so that what they
        admitted for requests gone is undone there rather than left holding its KV."""
        while graceful and self.link is not None and self._stall is None and self._admitting:
            item = self._admitting.pop(0)
            self.settle(item.pending, item.reqs)
        # a block sent: a graceful close reads its answer (`DraftLink.close`); one not sent
        # yet is dropped (every request leaves the draft below)
        self._sent = self._unsent = None
        if self.link is not None:
            self.link.close(graceful and self._stall is None)
            self.link = None
        if self._stall is not None:
            self._stall.probe.cancel()
            self._stall = None
        for item in self._admitting:
            item.pending.cancel()
        self._admitting.clear()
        for r in self._requests.values():
            r.on_draft = False

    def from_push(
        self,
        asks: list[HubRequest],
        entries: list[draft_pb2.ProposeEntry],
        target_step_s: float = 0.0,
    ) -> tuple[common_pb2.DraftBlock, int] | None:
        """The step's drafts from the chains the draft pushed ahead, and how many asks were
        backed up, if every ask's verdict has one or the misses may be backed up (None
        otherwise: ask with `propose`). Then the block of asks is sent, and the draft's
        answer, which takes the same chains, is read at the next step (`collect`): the verify
        starts without a round trip. Exact as a hit is (`draft_service.ahead`): a chain is
        taken only for the very verdict it assumed, with the q it was drawn from.

        A miss (the push holds chains of its request, none for its verdict) is backed up, with
        no drafts this step and ProposeEntry.backup set, where fewer than the push's
        backup_miss_share of the asks wanting drafts missed and none of those has a fixed k:
        the hits keep their chains and the step waits for no draft pass. An ask whose request
        has no chain in the push (just admitted, or left out of the pass by its budget) is
        drafted now by the draft, so such a step asks."""
        link = self.link
        self._waiting = None
        since, self._collect_started = self._collect_started, None
        if link is None or not link.push or self._stall is not None or self._sent is not None:
            return None
        self._waiting = (link.push_due, since if since is not None else time.perf_counter())
        push = self._in_time(asks, link.take_push)
        if push is None:
            return None
        try:
            found = _from_push(push, entries, self._config.max_support_size)
        except ValueError as e:
            log.warning("ignoring a malformed push from the draft service: %s", e)
            return None
        if found is None:
            return None
        chosen, missed = found
        if missed:
            wanted = sum(e.num_draft_tokens > 0 for e in entries)
            seeded = any(entries[i].fixed_num_draft_tokens for i in missed)
            # a NaN or negative share asks too
            if seeded or not len(missed) < push.backup_miss_share * wanted:
                return None
            for i in missed:
                entries[i].backup = True
        self._had_drafts()
        link.send(entries, target_step_s, self.push_choice.next())
        self._sent = (asks, {p.request_id: list(p.draft_token_ids) for p in chosen}, True)
        for r, entry in zip(asks, entries, strict=True):
            r.told = entry.committed_length
        return block_to_pb(chosen), len(missed)

    def tell(
        self,
        asks: list[HubRequest],
        entries: list[draft_pb2.ProposeEntry],
        target_step_s: float = 0.0,
    ) -> bool:
        """Holds the block for `flush` to send where none of its asks wants drafts (dynamic
        speculation's k = 0, or requests at their last token); its answer is not waited for:
        the draft learns the tokens committed since its last ask and catches its KV up while
        the target verifies, and `collect` reads its answer, drafts of none, after the verify.
        False (nothing held) where an ask wants drafts, or the draft is down or stalled: ask
        with `propose`. Such a step decodes as one without a draft would and waits for no
        round trip: `flush` sends the block once the verify's device work is queued, so that
        gRPC's threads take the GIL while the hub's waits on the GPU, and the link's reader
        thread has the answer by the verify's end (docs/design.md, "What a step at k = 0
        still costs")."""
        if self.link is None or self._stall is not None or self._sent is not None:
            return False
        if any(e.num_draft_tokens > 0 for e in entries):
            return False
        self._waiting, self._collect_started = None, None  # no wait for drafts to count
        self._unsent = (entries, target_step_s)
        self._sent = (asks, {r.request_id: [] for r in asks}, False)
        for r, entry in zip(asks, entries, strict=True):
            r.told = entry.committed_length
        return True

    def flush(self) -> None:
        """Sends the block `tell` holds, if it is not sent yet: the hub calls this once the
        verify's device work is queued (`TargetEngine.verify_timed`'s `launched`), and
        `collect` does where that never came (a step that scored nothing, or failed). The
        draft drafts nothing from it, so it is sent without waiting for its hand-off."""
        unsent, self._unsent = self._unsent, None
        if unsent is None or self.link is None:
            return
        try:
            self.link.send(unsent[0], unsent[1], push=False, handoff=False)
        except Exception as e:  # it runs inside the target's verify: that step must go on
            log.exception("sending a block to the draft service failed")
            self.down(f"Sending a block to the draft service failed: {e}")

    @property
    def sending(self) -> bool:
        """Whether a block sent without waiting (`from_push`, `tell`, the latter maybe not
        flushed yet) is still to be read."""
        return self._sent is not None

    def _had_drafts(self) -> None:
        """The step's drafts are had: its wait counts for the way it came by."""
        if self._waiting is not None:
            pushed, since = self._waiting
            self.push_choice.waited(pushed, time.perf_counter() - since)
            self._waiting = None

    def collect(self) -> draft_pb2.ProposeResponse | None:
        """The draft's answer to the block the last step sent without waiting (`from_push`,
        `tell`), read now (None if there is none, or the draft failed or stalled meanwhile); a
        request it refused runs at k = 0 as after `propose`. Its drafts are the pushed ones the
        target verified (none after `tell`); where they are not (a chain dropped in between),
        its KV holds its own, and the next verdict rolls back what the target did not
        commit."""
        self.flush()
        if self._sent is None or self.link is None:
            self._sent = None
            return None
        asks, used, pushed = self._sent
        self._sent = None
        if pushed:  # the wait for its answer is the push's way's (`from_push`)
            self._collect_started = time.perf_counter()
        answer = self._in_time(asks, self.link.collect)
        if answer is None:
            return None
        response, _ = answer
        try:
            block = DraftBlock.from_pb(
                response.block, max_support_size=self._config.max_support_size
            )
        except ValueError as e:
            self.down(f"The draft service sent a malformed DraftBlock: {e}")
            return None
        for i, rid in enumerate(block.request_ids):
            if used.get(rid) != block.tokens(i):
                self.push_mismatches += 1
                log.warning("the draft answered %r with other drafts than it pushed", rid)
        self._refused(response)
        return response

    def _in_time(self, asks: list[HubRequest], call: Callable[[float], _T]) -> _T | None:
        """`call(deadline_s)` with the asks' deadline (a seeded request's, longer, if one is
        among them); None, the draft taken as down or stalled, if it fails or misses it."""
        seeded = any(r.fixed_k for r in asks)
        try:
            return call(self.seeded_deadline_s if seeded else self._deadline_s)
        except DraftDown as e:
            self.down(str(e))
        except DraftStalled as e:
            self._stalled(str(e), [])
        return None

    def _refused(self, response: draft_pb2.ProposeResponse) -> None:
        for err in response.errors:
            log.warning("draft refused %r, it runs at k = 0: %s", err.request_id, err.error.message)
        self.release([self._requests[err.request_id] for err in response.errors
                      if err.request_id in self._requests])  # fmt: skip

    def propose(
        self,
        asks: list[HubRequest],
        entries: list[draft_pb2.ProposeEntry],
        target_step_s: float = 0.0,
    ) -> tuple[draft_pb2.ProposeResponse, float] | None:
        """The draft's answer to `entries` (the asks of `asks`) and its round trip; None if the
        draft service failed (it is down now). `target_step_s`: ProposeBlock.target_step_s."""
        self.collect()  # a block sent without waiting is answered first
        if self.link is None or self._stall is not None:  # down or stalled (maybe just now)
            self._waiting = None
            return None
        if self._waiting is None:
            self._waiting = (False, time.perf_counter())
        link = self.link
        push = link.push and self.push_choice.next()
        answer = self._in_time(
            asks, lambda deadline_s: link.propose(entries, deadline_s, target_step_s, push)
        )
        if answer is None:
            self._waiting = None
            return None
        response, round_trip = answer
        self._had_drafts()
        self._round_trips.append(round_trip)
        if len(self._round_trips) % 16 == 0:
            typical = DEADLINE_FACTOR * statistics.median(self._round_trips)
            self._deadline_s = max(self._config.draft_deadline_s, typical)
        served = set(response.block.request_ids)
        for r, entry in zip(asks, entries, strict=True):
            if r.request_id in served:
                r.told = entry.committed_length
        self._refused(response)
        return response, round_trip

    @property
    def admitting(self) -> bool:
        """Whether draft admissions are in flight (a released one's undo among them)."""
        return bool(self._admitting)

    def settle_done(self) -> None:
        """Settles the admissions that have ended, without waiting: while no step runs (the
        hub idle), this is what undoes a released request's admission once the draft ends
        it."""
        for item in [i for i in self._admitting if i.pending.done(0.0)]:
            if item in self._admitting:  # not cleared by an earlier settle (the draft down)
                self._admitting.remove(item)
                self.settle(item.pending, item.reqs)

    def start_admit(self, admission: AdmitRequest) -> PendingAdmits | None:
        """Admits a new request while the target prefills it; `settle` finishes."""
        if self.link is None or self._stall is not None:
            return None  # a stalled draft gets it when it is resynchronised
        rid = admission.request_id
        for item in [i for i in self._admitting if rid in i.pending.request_ids]:
            # an earlier request of this id, released while the draft admitted it: its undo
            # (a release of the id) must reach the draft before this admission does
            self._admitting.remove(item)
            self.settle(item.pending, item.reqs)
        if self.link is None or self._stall is not None:
            return None
        return self.link.start_admit([admission], self._admit_timeout_s())

    def _admit_timeout_s(self) -> float:
        """An admission prefills, which takes longer than a step: the deadline's multiple."""
        return min(self.link.timeout_s if self.link else 0.0, DEADLINE_FACTOR * self._deadline_s)

    def admit(self, reqs: list[HubRequest], records: Mapping[str, target_pb2.DraftRecord]) -> None:
        """Admits running requests from their records (or the target's tokens)."""
        if self.link is None or self._stall is not None or not reqs:
            return
        admissions = []
        for r in reqs:
            record = records.get(r.request_id)
            tokens = record.token_ids[:] if record is not None and _fits(r, record) else r.tokens
            admissions.append(AdmitRequest(r.request_id, tuple(tokens), r.sampling, r.next_step))
        self.settle(self.link.start_admit(admissions), reqs)

    def defer(self, pending: PendingAdmits, reqs: list[HubRequest]) -> None:
        """Settles `pending` at the next step (`poll`): the hub does not wait for it before."""
        self._admitting.append(_Admitting(pending, reqs))

    def settle(self, pending: PendingAdmits, reqs: list[HubRequest]) -> None:
        """Waits for draft admissions: `reqs` admitted there go on the draft, the others run at
        k = 0; admissions of requests not in `reqs` (their target admission failed, or they
        were released meanwhile, or no longer draft requests) are undone."""
        reqs = [r for r in reqs if self._requests.get(r.request_id) is r and r.proposer == "draft"]
        try:
            errors = pending.wait()
        except DraftDown as e:
            self.down(str(e))
            return
        except DraftStalled as e:  # whichever of them were admitted are released on its return
            self._stalled(str(e), [a.request_id for a in pending.admissions])
            return
        told = {a.request_id: len(a.prompt_token_ids) for a in pending.admissions}
        wanted = {r.request_id for r in reqs}
        for r in reqs:
            error = errors.get(r.request_id)
            if error is None:
                r.on_draft, r.told = True, told[r.request_id]
            else:
                log.warning("draft admission of %r failed: %s", r.request_id, error)
        undo = [rid for rid, err in errors.items() if err is None and rid not in wanted]
        self._release_ids(undo)

    def release(self, reqs: list[HubRequest]) -> None:
        """Frees the requests' KV on the draft service; they run at k = 0 if they stay."""
        gone = {r.request_id for r in reqs}
        for item in [i for i in self._admitting if gone & i.pending.request_ids]:
            if item in self._admitting and item.pending.done(0.0):  # settled now: undone
                self._admitting.remove(item)
                self.settle(item.pending, item.reqs)
            # else the draft is still admitting it (a long prompt's prefill): the hub does not
            # wait for it here; a later step's `poll` settles it and undoes what it admitted
        ids = [r.request_id for r in reqs if r.on_draft]
        for r in reqs:
            r.on_draft = False
        self._release_ids(ids)

    def _release_ids(self, request_ids: list[str], timeout_s: float | None = None) -> None:
        if not request_ids or self.link is None:
            return
        if self._stall is not None:  # released when it answers again
            self._stall.held.update(request_ids)
            return
        try:
            self.link.release(request_ids, self._deadline_s if timeout_s is None else timeout_s)
        except DraftDown as e:
            self.down(str(e))
        except DraftStalled as e:
            self._stalled(str(e), request_ids)
        except grpc.RpcError as e:
            log.warning("release on the draft service failed: %s", e)


def _fits(req: HubRequest, record: target_pb2.DraftRecord) -> bool:
    """Whether the record is a past state of the request (a prefix of its tokens)."""
    n = len(record.token_ids)
    ok = 0 < n <= len(req.tokens) and record.next_step <= req.next_step
    if ok and req.tokens[:n] == record.token_ids[:]:
        return True
    log.warning("record of %r does not fit its tokens; using the target's", req.request_id)
    return False


def _from_push(
    push: draft_pb2.ProposeResponse, entries: list[draft_pb2.ProposeEntry], max_support: int
) -> tuple[list[DraftProposal], list[int]] | None:
    """Each ask's drafts from the push: the chain for its step that assumed its verdict (its
    new_token_ids), cut to the k it asks for; and the misses, the asks whose request has
    chains for its step but none for its verdict (or a shorter one), which get no drafts here.
    None if an ask that wants drafts has no chain at all (the draft drafts it now), or a chain
    does not fit its ask. ValueError if the push is malformed."""
    block = DraftBlock.from_pb(push.block, max_support_size=max_support)
    lengths = list(push.verdict_lengths)
    if len(push.verdict_token_ids) % 4:
        raise ValueError("verdict_token_ids is not a whole number of int32s")
    flat = struct.unpack(f"<{len(push.verdict_token_ids) // 4}i", push.verdict_token_ids)
    if len(lengths) != len(block) or sum(lengths) != len(flat) or block.errors:
        raise ValueError("its verdicts do not fit its block")
    anyone = list(push.any_verdict_of_length) or [False] * len(block)
    if len(anyone) != len(block):
        raise ValueError("any_verdict_of_length does not fit its block")
    keys, start = [], 0
    for n in lengths:
        keys.append(tuple(flat[start : start + n]))
        start += n
    by_request: dict[str, list[int]] = {}
    for i, rid in enumerate(block.request_ids):
        by_request.setdefault(rid, []).append(i)
    chosen, missed = [], []
    for n, e in enumerate(entries):
        k, verdict = e.num_draft_tokens, tuple(e.new_token_ids)
        if k == 0:  # the draft answers no drafts, chains or not
            chosen.append(DraftProposal(e.request_id, e.step, e.committed_length, ()))
            continue
        mine = [i for i in by_request.get(e.request_id, ()) if block.steps[i] == e.step]
        if not mine:
            return None
        # BENCHMARKING ONLY first: a synthetic hit serves its chain to any verdict of its length
        pick = next((i for i in mine if anyone[i] and len(keys[i]) == len(verdict)), None)
        if pick is None:
            pick = next((i for i in mine if keys[i] == verdict), None)
        fixed = e.fixed_num_draft_tokens
        if pick is None or not chain_serves(block.num_draft_tokens[pick], k, fixed):
            missed.append(n)
            chosen.append(DraftProposal(e.request_id, e.step, e.committed_length, ()))
            continue
        if block.committed_lengths[pick] != e.committed_length:
            return None
        q = block.q_rows(block.q_forms[pick], [pick])
        if isinstance(q, DenseQ):
            q = DenseQ(q.probs[:k])
        elif isinstance(q, SparseQ):
            q = SparseQ(q.token_ids[:k], q.probs[:k])
        tokens = tuple(block.tokens(pick)[:k])
        chosen.append(DraftProposal(e.request_id, e.step, e.committed_length, tokens, q))
    return chosen, missed
