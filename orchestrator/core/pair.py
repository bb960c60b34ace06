"""The orchestrator's side of a draft/target pair: one `TargetService.Serve` stream to the target,
which runs the step loop as the hub (it pulls drafts from its draft service, verifies them and
streams every step's verdicts). Torch-free.

The orchestrator is not on a step's critical path: `admit`, `release`, `set_speculation` and
`set_draft` only queue a control message that the hub applies at its next step boundary, and a
reader thread turns the hub's events into callbacks (`on_step`, `on_admitted`, ...). Callbacks
run on that thread and must be quick: hand the work to the orchestrator's own threads.

A StepEvent with an error committed nothing and ends the request on both services; to go on,
admit it again from the orchestrator's record (prompt plus committed tokens, next step).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from specdec.pb import common_pb2, target_pb2, target_pb2_grpc
from specdec.sampling_params import SamplingParams
from specdec.serving.client import make_channel
from specdec.serving.messages import ModelInfo, RequestError, sampling_to_pb
from specdec.serving.proposers import FROM_PB, TO_PB, Proposer
from specdec.serving.verdicts import VerifyResponse

log = logging.getLogger(__name__)

FALLBACKS: dict[int, str] = {
    target_pb2.DRAFT_FALLBACK_DEADLINE: "deadline",
    target_pb2.DRAFT_FALLBACK_UNAVAILABLE: "unavailable",
}
_CLOSE = object()


def _check_speculation(proposer: str, num_draft_tokens: int) -> None:
    if proposer not in TO_PB:
        raise ValueError(f"proposer must be 'draft', 'ngram' or 'off', got {proposer!r}.")
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}.")


@dataclass(frozen=True, slots=True)
class PairAdmission:
    """A request to admit on the pair (or to re-admit from the orchestrator's record)."""

    request_id: str
    token_ids: tuple[int, ...]  # prompt (plus committed tokens on a re-admission)
    sampling: SamplingParams
    proposer: Proposer
    num_draft_tokens: int  # k for this request (ignored when proposer == "off")
    first_step: int = 0
    max_length: int = 0  # prompt + tokens the orchestrator keeps at most; 0: no limit
    fixed_num_draft_tokens: bool = False  # k kept under dynamic speculation (seeded, sampled)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string.")
        if not self.token_ids:
            raise ValueError("token_ids must hold at least one token id.")
        if self.first_step < 0:
            raise ValueError(f"first_step must be >= 0, got {self.first_step}.")
        if self.max_length < 0:
            raise ValueError(f"max_length must be >= 0, got {self.max_length}.")
        _check_speculation(self.proposer, self.num_draft_tokens)

    def to_pb(self) -> target_pb2.ServeAdmit:
        return target_pb2.ServeAdmit(
            request=common_pb2.AdmitRequest(
                request_id=self.request_id,
                prompt_token_ids=self.token_ids,
                sampling=sampling_to_pb(self.sampling),
                first_step=self.first_step,
            ),
            proposer=TO_PB[self.proposer],
            num_draft_tokens=self.num_draft_tokens,
            max_length=self.max_length,
            fixed_num_draft_tokens=self.fixed_num_draft_tokens,
        )


@dataclass(frozen=True, slots=True)
class Admitted:
    """A successful admission: the committed length, the services' own time for it (the
    target's prefill and first token, to the device's completion) and the verdict of the
    request's first step, decoded in the prefill's own forward (None from a hub that sends
    none)."""

    committed_length: int
    prefill_s: float
    first: StepEvent | None = None


@dataclass(frozen=True, slots=True)
class StepEvent:
    """One request's verdict of one step."""

    request_id: str
    step: int
    token_ids: tuple[int, ...]  # committed this step; empty on error
    num_draft_tokens: int  # drafts verified this step (k_i actually proposed)
    num_accepted: int
    error: RequestError | None = None
    proposer: Proposer | None = None  # the one that drafted this step; None: not told


@dataclass(frozen=True, slots=True)
class StepReport:
    """One step of the hub: its verdicts and where its time went (seconds)."""

    events: tuple[StepEvent, ...]
    draft_s: float  # the draft service's forward time, 0 if none
    transport_s: float  # the hub's Propose round trip minus the draft's own time
    verify_s: float  # the target's verify forward
    sampler_s: float  # the target's rejection sampler
    step_s: float  # the hub's wall time of the whole step
    draft_up: bool
    graphed: bool = False  # every forward of the step replayed a captured CUDA graph
    draft_ahead_hits: int = 0  # the draft's asks answered from drafts made ahead
    draft_ahead_misses: int = 0  # asks with drafts made ahead, none for their verdict
    # why PROPOSER_DRAFT requests ran at k = 0 ("deadline", "unavailable"; "" if none did),
    # and how many
    fallback: str = ""
    num_fallback_requests: int = 0
    draft_ahead_s: float = 0.0  # the draft's passes ahead since the last step it answered
    draft_ahead_backups: int = 0  # misses answered with no drafts: the step did not wait
    # the target's prefix cache since the last step: prompt tokens looked up, and found
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    draft_ahead_pushed: int = 0  # hits from chains pushed before the verdict: no wait
    draft_ahead_push_backups: int = 0  # misses of the pushed chains, verified with no drafts

    @classmethod
    def from_pb(cls, pb: target_pb2.ServeStep) -> StepReport:
        return cls(step_events(pb.verdicts, pb.proposers), pb.draft_s, pb.transport_s, pb.verify_s,
                   pb.sampler_s, pb.step_s, pb.draft_up, pb.graphed, pb.draft_ahead_hits,
                   pb.draft_ahead_misses, FALLBACKS.get(pb.draft_fallback, ""),
                   pb.num_fallback_requests, pb.draft_ahead_s,
                   pb.draft_ahead_backups, pb.prefix_cache_queried_tokens,
                   pb.prefix_cache_hit_tokens, pb.draft_ahead_pushed,
                   pb.draft_ahead_push_backups)  # fmt: skip


def step_events(
    pb: target_pb2.VerifyResponse, proposers: Sequence[int] = ()
) -> tuple[StepEvent, ...]:
    """The verdicts as events; `proposers` (ServeStep.proposers) name who drafted each."""
    v = VerifyResponse.from_pb(pb)
    errors = v.errors
    names = [FROM_PB.get(p) for p in proposers] if len(proposers) == len(v) else [None] * len(v)
    return tuple(
        StepEvent(
            rid, v.steps[i], () if i in errors else tuple(v.token_ids[i]),
            v.num_draft_tokens[i], v.num_accepted[i], errors.get(i), names[i],
        )
        for i, rid in enumerate(v.request_ids)
    )  # fmt: skip


def _nothing() -> None:
    pass


class PairClient:
    """One Serve stream to the target service at `target_address` (see the module docstring).

    Raises ConnectionError if the target cannot be reached within `timeout_s` or refuses the
    stream (it serves one orchestrator at a time). `on_close` gets the stream's error, or None
    after `close`. TLS when `tls_root_cert` (PEM) is given, checking `tls_server_name` in the
    target's certificate if set, else the address's host, and presenting `tls_identity` (cert
    chain, key) where the target requires a client certificate.
    """

    def __init__(
        self,
        target_address: str,
        *,
        on_step: Callable[[StepReport], None],
        on_admitted: Callable[[str, Admitted | RequestError], None],
        on_draft_down: Callable[[], None] = _nothing,
        on_draft_up: Callable[[], None] = _nothing,
        on_close: Callable[[BaseException | None], None] | None = None,
        timeout_s: float = 60.0,
        tls_root_cert: bytes | None = None,
        tls_server_name: str | None = None,
        tls_identity: tuple[bytes, bytes] | None = None,
    ):
        self._on_step, self._on_admitted = on_step, on_admitted
        self._on_draft_down, self._on_draft_up, self._on_close = (
            on_draft_down,
            on_draft_up,
            on_close,
        )
        self._lock = threading.Lock()
        self._running: set[str] = set()
        # per request id, its admissions not answered yet: whether it was released since
        self._unanswered: dict[str, list[bool]] = {}
        self._info: tuple[ModelInfo, ModelInfo | None] | None = None
        self._draft_up = False
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._closing = False
        self._channel = make_channel(
            target_address, tls_root_cert=tls_root_cert, tls_server_name=tls_server_name,
            tls_identity=tls_identity,
        )  # fmt: skip
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError as e:
            self._channel.close()
            raise ConnectionError(
                f"The target service at {target_address} did not answer within {timeout_s} s."
            ) from e
        self._controls: queue.SimpleQueue[object] = queue.SimpleQueue()
        stub = target_pb2_grpc.TargetServiceStub(self._channel)
        self._call = stub.Serve(iter(self._controls.get, _CLOSE))
        self._reader = threading.Thread(target=self._read, name="pair-reader", daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout_s) or self._info is None:
            self._call.cancel()
            self._channel.close()
            why = f"no answer within {timeout_s} s"
            if isinstance(self._failure, grpc.RpcError):
                why = f"{self._failure.code().name}: {self._failure.details()}"  # type: ignore[attr-defined]
            raise ConnectionError(
                f"The target service at {target_address} did not open the Serve stream: {why}"
            ) from self._failure

    # Controls

    def admit(self, admission: PairAdmission) -> None:
        """Admits at the hub's next step boundary; `on_admitted` answers."""
        pb = target_pb2.ServeControl(admit=admission.to_pb())
        with self._lock:  # the queue's order is the order the hub answers in
            self._unanswered.setdefault(admission.request_id, []).append(False)
            self._send(pb)

    def release(self, request_ids: Sequence[str]) -> None:
        """Frees the requests' KV on the target and the draft at the hub's next step boundary;
        their verdicts of the steps before it may still arrive."""
        pb = target_pb2.ServeControl(release=common_pb2.ReleaseRequest(request_ids=request_ids))
        with self._lock:
            self._running.difference_update(request_ids)
            for rid in request_ids:
                if rid in self._unanswered:
                    self._unanswered[rid] = [True] * len(self._unanswered[rid])
            self._send(pb)

    def set_speculation(self, request_id: str, proposer: str, num_draft_tokens: int) -> None:
        _check_speculation(proposer, num_draft_tokens)
        pb = target_pb2.SetSpeculation(
            request_id=request_id,
            proposer=TO_PB[proposer],
            num_draft_tokens=num_draft_tokens,
        )
        self._send(target_pb2.ServeControl(set_speculation=pb))

    def set_draft(
        self, address: str | None, records: Mapping[str, tuple[tuple[int, ...], int]]
    ) -> None:
        """Points the hub at a (restarted) draft service; `records` maps request id → (prompt +
        committed tokens, next step) from the orchestrator's record. `on_draft_up` or
        `on_draft_down` answers; None runs every request at k = 0."""
        pb = target_pb2.SetDraft(address=address or "")
        for rid, (tokens, next_step) in records.items():
            pb.records.add(request_id=rid, token_ids=tokens, next_step=next_step)
        self._send(target_pb2.ServeControl(set_draft=pb))

    def _send(self, pb: target_pb2.ServeControl) -> None:
        if self._closing:
            raise RuntimeError("The PairClient is closed.")
        self._controls.put(pb)

    # State

    def model_info(self) -> tuple[ModelInfo, ModelInfo | None]:
        """The target's ModelInfo and the latest draft service's (None if there never was one)."""
        assert self._info is not None, "set before __init__ returns"
        return self._info

    @property
    def num_running(self) -> int:
        """Requests admitted and neither released nor failed."""
        with self._lock:
            return len(self._running)

    @property
    def draft_up(self) -> bool:
        return self._draft_up

    def close(self) -> None:
        """Ends the stream (the hub releases every request on both services) and waits for the
        reader thread."""
        if not self._closing:
            self._closing = True
            self._controls.put(_CLOSE)
        if threading.current_thread() is not self._reader:  # not from inside a callback
            self._reader.join()
        self._channel.close()

    # The reader thread

    def _read(self) -> None:
        error: BaseException | None = None
        try:
            for event in self._call:
                self._dispatch(event)
        except grpc.RpcError as e:
            error = e
            if not self._closing:
                log.warning("the Serve stream failed: %s", e)
        finally:
            self._failure = error
            self._ready.set()
            if self._on_close is not None and self._info is not None:
                self._on_close(error)

    def _dispatch(self, event: target_pb2.ServeEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "step":
            report = StepReport.from_pb(event.step)
            self._draft_up = report.draft_up
            failed = [e.request_id for e in report.events if e.error is not None]
            if failed:
                with self._lock:
                    self._running.difference_update(failed)
            self._on_step(report)
        elif kind == "admitted":
            self._admitted(event.admitted)
        elif kind == "started":
            draft = event.started.draft
            self._info = (
                ModelInfo.from_pb(event.started.target),
                ModelInfo.from_pb(draft) if event.started.HasField("draft") else None,
            )
            self._draft_up = event.started.HasField("draft")
            self._ready.set()
        elif kind == "draft_down":
            log.warning("draft service down: %s", event.draft_down.message)
            self._draft_up = False
            self._on_draft_down()
        elif kind == "draft_up":
            assert self._info is not None
            self._info = (self._info[0], ModelInfo.from_pb(event.draft_up.draft))
            self._draft_up = True
            self._on_draft_up()

    def _admitted(self, pb: target_pb2.ServeAdmitted) -> None:
        rid, error = pb.request_id, RequestError.from_pb(pb.error)
        with self._lock:
            flags = self._unanswered.get(rid) or [False]
            released = flags.pop(0)
            if not flags:
                self._unanswered.pop(rid, None)
            if error is None and not released:
                self._running.add(rid)
        if released:  # an answer for a request released meanwhile: its id may be in use again
            return
        result: Admitted | RequestError = error or Admitted(
            pb.committed_length,
            pb.prefill_s,
            next(iter(step_events(pb.verdicts)), None) if pb.HasField("verdicts") else None,
        )
        self._on_admitted(rid, result)
