"""Fakes for the hub's step loop (`target_service.hub.Hub`): a target engine and a draft link
with no model and no network, so that each case (a draft that stalls, fails, or has not yet
admitted a request; a request near its last token) is set up exactly and checked without a
sleep. Both follow one deterministic greedy "model", `next_token`; the draft drafts it too,
except at the positions it is told to get wrong.

The fake engine checks what the real one checks of a block: each entry's committed length is
the length it holds, so a hub that lost track of a request's tokens fails here too.
"""

from __future__ import annotations

import queue
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from specdec.pb import common_pb2, draft_pb2, target_pb2
from specdec.runner.timing import StepTimes
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import Q_NONE, DraftBlock
from specdec.serving.messages import AdmitRequest, ModelInfo
from specdec.serving.proposers import TO_PB
from specdec.serving.verdicts import VerifyResponse
from target_service.config import TargetConfig
from target_service.draft_link import DraftDown, DraftStalled
from target_service.hub import Hub
from tests.target_service.hub_helpers import GREEDY

VOCAB = 97
MAX_SEQ_LEN = 256
INFO = ModelInfo("fake", VOCAB, VOCAB, "fake-tokenizer", MAX_SEQ_LEN, 64, 8, 1 << 20, "float32")
FAILED: list[str] = []  # checks that failed inside a fake, for the test's own message


def _check(ok: bool, what: object) -> None:
    if not ok:
        FAILED.append(repr(what))
        raise AssertionError(what)


def next_token(tokens: Sequence[int]) -> int:
    """The fake model's greedy next token after `tokens`."""
    return (7 * tokens[-1] + len(tokens)) % VOCAB


def greedy(prompt: Sequence[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakeEngine:
    """The target engine's part the hub uses: greedy verification of `next_token`."""

    def __init__(self, config: TargetConfig):
        self.config, self.info = config, INFO
        self.held: dict[str, list[int]] = {}
        self.runner = SimpleNamespace(synchronize=lambda: None)
        self.blocks: list[DraftBlock] = []
        # None: verifies at once; else each verify takes one permit (`allow`), so a test can
        # hold the loop still while it sends controls, however slow this machine is
        self.pace: threading.Semaphore | None = None

    def allow(self, steps: int) -> None:
        """From now on at most `steps` more verifies run until the next `allow`."""
        if self.pace is None:
            self.pace = threading.Semaphore(0)
        self.pace.release(steps)

    def unpace(self) -> None:
        """Verifies at once again, a held one too."""
        pace, self.pace = self.pace, None
        if pace is not None:
            pace.release(1 << 20)

    def admit(self, adm: AdmitRequest) -> tuple[int, int]:
        self.held[adm.request_id] = list(adm.prompt_token_ids)
        return len(adm.prompt_token_ids), adm.first_step

    def admit_decoding(self, adm: AdmitRequest) -> tuple[VerifyResponse, StepTimes]:
        tokens = list(adm.prompt_token_ids)
        tokens.append(next_token(tokens))
        self.held[adm.request_id] = tokens
        out = VerifyResponse.pending([adm.request_id], [adm.first_step])
        out.commit(0, tokens[-1:], 0, 0, len(tokens))
        return out, StepTimes()

    def release(self, request_ids: Iterable[str]) -> int:
        return sum(self.held.pop(rid, None) is not None for rid in request_ids)

    def verify_timed(
        self, block: DraftBlock, launched: Callable[[], None] | None = None
    ) -> tuple[VerifyResponse, StepTimes]:
        if self.pace is not None:
            _check(self.pace.acquire(timeout=10.0), "the test never allowed this step")
        self.blocks.append(block)
        if launched is not None and block.request_ids:  # as the engine: once it is queued
            launched()
        out = VerifyResponse.pending(block.request_ids, block.steps)
        for i, rid in enumerate(block.request_ids):
            tokens = self.held[rid]
            _check(block.committed_lengths[i] == len(tokens), (rid, block, tokens))
            drafts = block.draft_token_ids[block.token_starts[i] : block.token_starts[i + 1]]
            new: list[int] = []
            for d in drafts:
                if d != next_token(tokens + new):
                    break
                new.append(d)
            accepted = len(new)
            new.append(next_token(tokens + new))
            tokens.extend(new)
            out.commit(i, new, accepted, len(drafts), len(tokens))
        return out, StepTimes(forward_s=0.001)


class FakeFuture:
    """A probe or an Admit call: done once `finish` is called."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.cancelled = False

    def finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        return self._error

    def cancel(self) -> None:
        self.cancelled = True


class FakePendingAdmits:
    """Admissions in flight: the draft holds them at once; the hub sees them end with `gate`,
    and waiting for their answers takes `wait_s` (a prefill's time)."""

    def __init__(self, admissions: Sequence[AdmitRequest], gate: FakeFuture, wait_s: float):
        self.admissions, self._gate, self._wait_s = list(admissions), gate, wait_s
        self.request_ids = {a.request_id for a in self.admissions}

    def done(self, timeout_s: float) -> bool:
        return self._gate.done()  # no waiting: a gate left shut is a deadline that passed

    def cancel(self) -> None:
        pass

    def wait(self) -> dict[str, str | None]:
        time.sleep(self._wait_s)
        return {a.request_id: None for a in self.admissions}


@dataclass
class FakeLink:
    """A draft service reached at `address`. `script[n]` says what its n-th Propose does:
    "ok" (the default), "stall" or "down"; `wrong_at` is the set of absolute positions it
    drafts a wrong token at. `admitting` False holds admissions in flight (the hub sees them
    miss its deadline) until `admit_gate.finish()`; a cleared `hold` holds a Propose once it
    has `entered`, so that controls sent meanwhile reach the hub together at the step's end."""

    address: str
    script: dict[int, str] = field(default_factory=dict)
    wrong_at: set[int] = field(default_factory=set)
    ahead_hits: int = 0
    info: ModelInfo = INFO
    timeout_s: float = 5.0
    held: dict[str, list[int]] = field(default_factory=dict)
    next_steps: dict[str, int] = field(default_factory=dict)  # the step each ask must carry
    proposes: list[list[draft_pb2.ProposeEntry]] = field(default_factory=list)
    deadlines: list[float] = field(default_factory=list)  # each Propose's
    released: list[str] = field(default_factory=list)
    admitting: bool = True
    admit_s: float = 0.0  # how long the hub waits for an admission's answer
    admit_gate: FakeFuture = field(default_factory=FakeFuture)
    probes: list[FakeFuture] = field(default_factory=list)
    hold: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)
    closed: bool = False
    on_stall: Callable[[], None] = lambda: None  # called as a scripted stall begins
    # pushes (ProposeBlock.push_chains): after each answer, the chain for the verdict the
    # greedy target will give (`next_token`), keyed by it, unless `push_keys` changes the key
    # (e.g. to a verdict that will not come); `answer_other` answers a block sent without
    # waiting with other drafts than it pushed; `collect_script[n]` ("stall" or "down") is
    # what the n-th collect does
    push: bool = False
    push_keys: Callable[[tuple[int, ...]], tuple[int, ...]] = lambda key: key
    answer_other: bool = False
    collect_script: dict[int, str] = field(default_factory=dict)
    take_push_script: dict[int, str] = field(default_factory=dict)  # likewise, n-th take_push
    pushes: list[draft_pb2.ProposeResponse] = field(default_factory=list)  # every one made
    push_flags: list[bool] = field(default_factory=list)  # each block's push_chains
    handoffs: list[bool] = field(default_factory=list)  # each block sent: waited to be sent
    push_wait_s: float = 0.0  # how long a due push takes to come
    # partial pushes: each push's backup_miss_share, and which (request, step) chains the push
    # keys by a verdict that will not come (a miss); a backup ask (ProposeEntry.backup) is
    # answered with no drafts, and its push holds the chain for the token its verdict adds
    push_share: float = 0.0
    push_miss: Callable[[str, int], bool] = lambda rid, step: False
    ask_wait_s: float = 0.0  # how long an asked block's answer takes
    sent: list[list[draft_pb2.ProposeEntry]] = field(default_factory=list)  # blocks sent
    _push: draft_pb2.ProposeResponse | None = None
    _answer: draft_pb2.ProposeResponse | None = None
    _collects: int = 0
    _due: bool = False
    _takes: int = 0

    def __post_init__(self) -> None:
        if self.admitting:
            self.admit_gate.finish()
        self.hold.set()

    def propose(
        self,
        entries: Sequence[draft_pb2.ProposeEntry],
        deadline_s: float,
        target_step_s: float = 0.0,
        push: bool = True,
    ) -> tuple[draft_pb2.ProposeResponse, float]:
        self.push_flags.append(push)
        time.sleep(self.ask_wait_s)
        self.deadlines.append(deadline_s)
        self.entered.set()
        assert self.hold.wait(10.0), "the test never let the Propose go on"
        self.proposes.append(list(entries))
        action = self.script.get(len(self.proposes), "ok")
        if action == "stall":
            self.on_stall()
            raise DraftStalled("the fake draft did not answer")
        if action == "down":
            raise DraftDown("the fake draft is gone")
        return self._answer_block(entries, push=push), 0.002

    def _drafts(self, tokens: list[int], k: int) -> list[int]:
        mine: list[int] = []
        for _ in range(k):
            t = next_token(tokens + mine)
            mine.append((t + 1) % VOCAB if len(tokens) + len(mine) in self.wrong_at else t)
        return mine

    def _answer_block(
        self, entries: Sequence[draft_pb2.ProposeEntry], other: bool = False, push: bool = True
    ) -> draft_pb2.ProposeResponse:
        """The answer to a block: greedy drafts (wrong at `wrong_at`); with `self.push` and
        `push` (the block's push_chains), the push that follows it is made too."""
        block = common_pb2.DraftBlock()
        drafts: list[int] = []
        chains = []  # the push: (request, step, committed length, drafts, verdict)
        for e in entries:
            tokens = self.held[e.request_id]
            # the draft's rule (`checks.step_error`): the next step, the last one again, or a
            # later one whose new tokens bring it to the committed length (checked below)
            expected = self.next_steps[e.request_id]
            _check(e.step >= expected - 1, ("step", e, expected))
            self.next_steps[e.request_id] = e.step + 1
            _check(len(tokens) + len(e.new_token_ids) == e.committed_length, (e, tokens))
            tokens.extend(e.new_token_ids)
            mine = [] if e.backup else self._drafts(tokens, e.num_draft_tokens)
            if other and mine:  # the answer only: the push assumes the drafts verified
                drafts += [*mine[:-1], (mine[-1] + 3) % VOCAB]
            else:
                drafts += mine
            block.request_ids.append(e.request_id)
            block.steps.append(e.step)
            block.committed_lengths.append(e.committed_length)
            block.num_draft_tokens.append(len(mine))
            block.q_forms.append(Q_NONE)  # type: ignore[arg-type]
            if self.push and (mine or e.backup):  # the verdict the greedy target will give
                new: list[int] = []
                for d in mine:
                    if d != next_token(tokens + new):
                        break
                    new.append(d)
                new.append(next_token(tokens + new))
                after = tokens + new
                chains.append((e.request_id, e.step + 1, len(after),
                               self._drafts(after, e.num_draft_tokens), tuple(new)))  # fmt: skip
        block.draft_token_ids = struct.pack(f"<{len(drafts)}i", *drafts)
        timing = common_pb2.StepTiming(service_s=0.001, forward_s=0.001)
        response = draft_pb2.ProposeResponse(
            block=block, timing=timing, draft_ahead_hits=self.ahead_hits
        )
        self._push = self._make_push(chains) if chains and push else None
        self._due = push
        return response

    def _make_push(self, chains: list[tuple[str, int, int, list[int], tuple[int, ...]]]) -> Any:
        block = common_pb2.DraftBlock()
        ids: list[int] = []
        keys: list[int] = []
        push = draft_pb2.ProposeResponse(pushed=True, backup_miss_share=self.push_share)
        for rid, step, length, mine, key in chains:
            if self.push_miss(rid, step):
                key = (*key[:-1], (key[-1] + 1) % VOCAB)
            block.request_ids.append(rid)
            block.steps.append(step)
            block.committed_lengths.append(length)
            block.num_draft_tokens.append(len(mine))
            block.q_forms.append(Q_NONE)  # type: ignore[arg-type]
            ids += mine
            key = self.push_keys(key)
            keys += key
            push.verdict_lengths.append(len(key))
        block.draft_token_ids = struct.pack(f"<{len(ids)}i", *ids)
        push.block.CopyFrom(block)
        push.verdict_token_ids = struct.pack(f"<{len(keys)}i", *keys)
        self.pushes.append(push)
        return push

    @property
    def push_due(self) -> bool:
        return self.push and self._due

    def take_push(self, deadline_s: float) -> draft_pb2.ProposeResponse | None:
        _check(self._answer is None, "take_push with an answer not collected")
        if self._due:
            time.sleep(self.push_wait_s)
        self._due = False
        self._takes += 1
        action = self.take_push_script.get(self._takes, "ok")
        push, self._push = self._push, None
        if action == "stall":
            raise DraftStalled("the fake draft did not push")
        if action == "down":
            raise DraftDown("the fake draft is gone")
        return push

    def send(
        self,
        entries: Sequence[draft_pb2.ProposeEntry],
        target_step_s: float = 0.0,
        push: bool = True,
        handoff: bool = True,
    ) -> None:
        self.push_flags.append(push)
        self.handoffs.append(handoff)
        self.sent.append(list(entries))
        self._answer = self._answer_block(entries, self.answer_other, push)

    def collect(self, deadline_s: float) -> tuple[draft_pb2.ProposeResponse, float] | None:
        if self._answer is None:
            return None
        self._collects += 1
        answer, self._answer = self._answer, None
        action = self.collect_script.get(self._collects, "ok")
        if action == "stall":
            self._push = None
            raise DraftStalled("the fake draft did not answer a block sent")
        if action == "down":
            raise DraftDown("the fake draft is gone")
        return answer, 0.002

    def start_admit(
        self, admissions: Sequence[AdmitRequest], timeout_s: float | None = None
    ) -> FakePendingAdmits:
        for a in admissions:
            self.held[a.request_id] = list(a.prompt_token_ids)
            self.next_steps[a.request_id] = a.first_step
        return FakePendingAdmits(admissions, self.admit_gate, self.admit_s)

    def release(self, request_ids: Sequence[str], timeout_s: float | None = None) -> None:
        for rid in request_ids:
            self.held.pop(rid, None)
            self.released.append(rid)

    def probe(self) -> FakeFuture:
        self.probes.append(FakeFuture())
        return self.probes[-1]

    def reopen(self) -> None:
        pass

    def close(self, graceful: bool = True) -> None:
        self.closed = True


class HubRun:
    """A hub over a FakeEngine and FakeLinks (`links[address]`), driven as the orchestrator
    drives it: controls in, events out."""

    def __init__(self, draft: FakeLink | None, **config: Any):
        from specdec.runner import RunnerConfig

        self.config = TargetConfig(
            RunnerConfig("unused"), draft_address=None if draft is None else draft.address,
            max_num_draft_tokens=8, **config,
        )  # fmt: skip
        self.engine = FakeEngine(self.config)
        self.links = {} if draft is None else {draft.address: draft}
        self.hub = Hub(self.engine, open_link=self._open)  # type: ignore[arg-type]
        self.events: queue.SimpleQueue[target_pb2.ServeEvent] = queue.SimpleQueue()
        self.steps: list[target_pb2.ServeStep] = []
        self.tokens: dict[str, list[int]] = {}
        threading.Thread(target=self._drain, daemon=True).start()
        self.hub.start()
        self.next(lambda e: e.HasField("started"))

    def _open(self, address: str) -> FakeLink:
        if address not in self.links:
            raise DraftDown(f"no fake draft at {address}")
        return self.links[address]

    def _drain(self) -> None:
        for event in self.hub.events():
            self.events.put(event)

    def next(self, wanted: Callable[[target_pb2.ServeEvent], bool]) -> target_pb2.ServeEvent:
        """The next event `wanted` takes; steps on the way are recorded. A check that failed
        inside a fake (the hub turns it into a failed step) is raised here, and so is waiting
        30 s in all (a loop that steps on but never gives the event must not hang the run)."""
        give_up = time.monotonic() + 30.0
        while True:
            if time.monotonic() > give_up:
                raise AssertionError(f"no such event in 30 s of {len(self.steps)} steps")
            try:
                event = self.events.get(timeout=10.0)
            except queue.Empty:
                raise AssertionError(f"no such event in 10 s; the fakes saw: {FAILED}") from None
            if event.HasField("step"):
                self._record(event.step)
            if wanted(event):
                return event

    def _record(self, step: target_pb2.ServeStep) -> None:
        self.steps.append(step)
        v = VerifyResponse.from_pb(step.verdicts)
        for i, rid in enumerate(v.request_ids):
            if i not in v.errors:
                self.tokens.setdefault(rid, []).extend(v.token_ids[i])

    def send_admit(
        self, rid: str, prompt: list[int], proposer: str = "draft", k: int = 4,
        max_length: int = 0, sampling: SamplingParams = GREEDY, fixed: bool = False,
    ) -> None:  # fmt: skip
        """Sends the admission (`fixed`: a seeded sampled request's k, kept whatever the
        draft's timing); `admitted` waits for its answer."""
        adm = AdmitRequest(rid, tuple(prompt), sampling, 0)
        pb = target_pb2.ServeAdmit(
            request=adm.to_pb(), proposer=TO_PB[proposer], num_draft_tokens=k,  # type: ignore[arg-type]
            max_length=max_length, fixed_num_draft_tokens=fixed,
        )  # fmt: skip
        self.hub.control(target_pb2.ServeControl(admit=pb))

    def admit(self, rid: str, prompt: list[int], *args: Any, **kwargs: Any) -> None:
        self.send_admit(rid, prompt, *args, **kwargs)
        self.admitted(rid)

    def admitted(self, rid: str) -> None:
        admitted = self.next(lambda e: e.HasField("admitted") and e.admitted.request_id == rid)
        assert not admitted.admitted.HasField("error"), admitted
        v = VerifyResponse.from_pb(admitted.admitted.verdicts)
        self.tokens[rid] = [t for ids in v.token_ids for t in ids]

    def release(self, *request_ids: str) -> None:
        pb = common_pb2.ReleaseRequest(request_ids=request_ids)
        self.hub.control(target_pb2.ServeControl(release=pb))

    def until_length(self, rid: str, n: int) -> None:
        """Waits for the steps that give `rid` at least `n` generated tokens."""
        if len(self.tokens.get(rid, ())) < n:
            self.next(lambda e: len(self.tokens.get(rid, ())) >= n)

    def stop(self) -> None:
        self.engine.unpace()
        self.hub.stop()
        self.hub.join()
