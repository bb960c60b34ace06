"""A client request from validation to its last response: `parse_request` checks every field
of a GenerateRequest against the served models, `Job` carries it through the scheduler and
hands the servicer's thread its responses (or its error status) through a queue.
"""

from __future__ import annotations

import queue
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc

from orchestrator.core.detokenizer import IncrementalDetokenizer, TextTokenizer
from orchestrator.core.pair import Admitted, PairAdmission, Proposer, StepEvent
from orchestrator.core.records import FinishReason, RequestRecord, StepGapError, StopCriteria
from specdec.limits import MAX_SEED
from specdec.message_limits import MAX_CHARS_PER_TOKEN, max_prompt_chars
from specdec.pb.specdec.v1 import generate_pb2
from specdec.sampling_params import SamplingParams
from specdec.serving.messages import ModelInfo
from specdec.serving.proposers import FROM_PB, TO_PB

MAX_REQUEST_ID_LEN = 128


@dataclass(frozen=True, slots=True)
class Served:
    """What requests are checked against: the pair's shared limits and defaults."""

    name: str
    vocab_size: int  # the tokenizer's ids
    max_seq_len: int
    max_num_draft_tokens: int
    default_proposer: str
    default_num_draft_tokens: int
    has_draft: bool
    eos_token_ids: tuple[int, ...]


def _prompt(
    request: generate_pb2.GenerateRequest, served: Served, tokenizer: TextTokenizer
) -> list[int]:
    form = request.WhichOneof("prompt")
    if form is None:
        raise ValueError("prompt must be set: give either text or token_ids.")
    if form == "text":
        text = request.text
        if not text:
            raise ValueError("prompt text must be non-empty.")
        limit = max_prompt_chars(served.max_seq_len)
        if len(text) > limit:  # before tokenising: a huge text costs nothing but this check
            raise ValueError(
                f"prompt text must be at most {limit} characters (max_seq_len "
                f"{served.max_seq_len} × {MAX_CHARS_PER_TOKEN}, a bound on the characters of "
                f"any token), got {len(text)}."
            )
        ids = tokenizer.encode(text)
        if not ids:
            raise ValueError("prompt text tokenizes to no tokens.")
        return ids
    if not request.token_ids.ids:
        raise ValueError("prompt token_ids must hold at least one id.")
    return list(request.token_ids.ids)


def _sampling(request: generate_pb2.GenerateRequest) -> SamplingParams:
    """The request's sampling parameters, unset fields at their defaults; `SamplingParams`
    checks the ranges (one rule for the services and the client API)."""
    temperature = request.temperature if request.HasField("temperature") else 1.0
    top_p = request.top_p if request.HasField("top_p") else 1.0
    seed = request.seed if request.HasField("seed") else secrets.randbelow(MAX_SEED + 1)
    return SamplingParams(temperature, request.top_k, top_p, seed)


def speculation_of(spec: generate_pb2.Speculation, served: Served) -> tuple[str, int]:
    """(proposer, k) of a request's speculation settings, defaults applied; ValueError names
    the field for settings this server cannot run."""
    if spec.proposer == generate_pb2.PROPOSER_DEFAULT:
        proposer = served.default_proposer
    elif spec.proposer in FROM_PB:
        proposer = FROM_PB[spec.proposer]
    else:
        raise ValueError(
            f"speculation.proposer {spec.proposer} is not a known Proposer (DEFAULT, DRAFT, "
            f"NGRAM or OFF)."
        )
    if proposer == "draft" and not served.has_draft:
        raise ValueError(
            "speculation.proposer DRAFT needs a draft model, and this server runs none; use "
            "NGRAM or OFF."
        )
    k = spec.num_draft_tokens if spec.HasField("num_draft_tokens") else None
    if k is None:
        k = min(served.default_num_draft_tokens, served.max_num_draft_tokens)
    elif k > served.max_num_draft_tokens:
        raise ValueError(
            f"speculation.num_draft_tokens must be in [0, {served.max_num_draft_tokens}], got {k}."
        )
    return proposer, 0 if proposer == "off" else k


def _request_id(request: generate_pb2.GenerateRequest) -> str:
    if len(request.request_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(
            f"request_id must be at most {MAX_REQUEST_ID_LEN} characters, "
            f"got {len(request.request_id)}."
        )
    return request.request_id or f"req-{uuid.uuid4().hex}"


def parse_request(
    request: generate_pb2.GenerateRequest, served: Served, tokenizer: TextTokenizer
) -> tuple[RequestRecord, SamplingParams]:
    """The request's record and sampling parameters; ValueError names the bad field."""
    if request.model and request.model != served.name:
        raise ValueError(f"model must be empty or {served.name!r}, got {request.model!r}.")
    request_id = _request_id(request)
    prompt = _prompt(request, served, tokenizer)
    for i, token in enumerate(prompt):
        if not 0 <= token < served.vocab_size:
            raise ValueError(
                f"prompt token_ids[{i}] must be in [0, {served.vocab_size}), got {token}."
            )
    sampling = _sampling(request)
    proposer, k = speculation_of(request.speculation, served)
    criteria = StopCriteria.from_pb(
        request,
        prompt_len=len(prompt),
        max_seq_len=served.max_seq_len,
        vocab_size=served.vocab_size,
        eos_token_ids=served.eos_token_ids,
    )
    detok = IncrementalDetokenizer(
        tokenizer,
        prompt_ids=prompt,
        stop=criteria.stop,
        include_stop_str_in_output=criteria.include_stop_str_in_output,
    )
    record = RequestRecord(
        request_id, prompt, criteria, detokenizer=detok, proposer=proposer, num_draft_tokens=k
    )
    # its output must not depend on the batch, so the target may not change its k per step
    record.fixed_num_draft_tokens = request.HasField("seed") and not sampling.greedy
    return record, sampling


class RequestFailed(Exception):
    """A request that failed after it was accepted: the status its call ends with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


END = object()  # the last item of a job's outbox


class Outbox(Protocol):
    """Where a job's responses go, from the scheduler's thread, in order: GenerateResponses,
    then a RequestFailed or nothing, then END."""

    def put(self, item: object) -> None: ...


def response_of(item: object) -> generate_pb2.GenerateResponse:
    """An outbox item other than END as a response; raises the RequestFailed it holds."""
    if isinstance(item, RequestFailed):
        raise item
    assert isinstance(item, generate_pb2.GenerateResponse)
    return item


class JobMetrics(Protocol):
    """What a job reports as it runs (`orchestrator.core.metrics.Metrics` does)."""

    def on_first_token(self, time_to_first_token_s: float) -> None: ...

    def on_finish(self, final: generate_pb2.GenerateResponse) -> None: ...

    def on_error(self, code: grpc.StatusCode) -> None: ...


class Job:
    """One request inside the scheduler: the scheduler's thread applies its verdicts to the
    record and puts the responses in its outbox; a client API's thread or event loop reads
    them (`responses` blocks on the default queue)."""

    def __init__(
        self,
        record: RequestRecord,
        sampling: SamplingParams,
        deadline: float | None,
        metrics: JobMetrics | None = None,
        outbox: Outbox | None = None,
    ):
        self.record = record
        self.sampling = sampling
        self.deadline = deadline
        self._metrics = metrics
        self._first_seen = False
        # between an admission and its answer, verdicts for this id are a released request's
        # (one that ended with the same id): the hub answers the admission before any of its own
        self.awaiting_admission = False
        self._outbox: Outbox = queue.SimpleQueue() if outbox is None else outbox

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def proposer(self) -> str:
        return self.record.proposer

    def admission(self) -> PairAdmission:
        """The admission the scheduler is about to send (the first one ends queue_s)."""
        tokens, next_step = self.record.readmission()
        r = self.record
        r.mark_sent()
        self.awaiting_admission = True
        proposer: Proposer = r.proposer  # type: ignore[assignment]
        limit = r.criteria.max_tokens
        return PairAdmission(
            r.request_id, tokens, self.sampling, proposer, r.num_draft_tokens, next_step,
            max_length=0 if limit is None else len(r.prompt_ids) + limit,
            fixed_num_draft_tokens=r.fixed_num_draft_tokens,
        )  # fmt: skip

    def readmission(self) -> tuple[tuple[int, ...], int]:
        return self.record.readmission()

    def set_speculation(self, proposer: str, num_draft_tokens: int) -> None:
        self.record.proposer, self.record.num_draft_tokens = proposer, num_draft_tokens

    def on_admitted(self, admitted: Admitted) -> None:
        self.awaiting_admission = False
        self.record.mark_admitted(admitted.prefill_s)

    def on_event(self, event: StepEvent) -> bool:
        try:
            delta = self.record.apply(event)
        except StepGapError as e:
            self.on_error(grpc.StatusCode.INTERNAL, str(e))
            return True
        if delta is None:
            return self.record.done
        if delta.error is not None:
            self.on_error(delta.error.code, delta.error.message)
            return True
        r = self.record
        if self._metrics is not None and r.first_token_s is not None and not self._first_seen:
            self._first_seen = True
            self._metrics.on_first_token(r.first_token_s - r.arrival_s)
        self._publish(r.response(delta), delta.finished)
        return delta.finished

    def on_error(self, code: grpc.StatusCode, message: str) -> None:
        self._outbox.put(RequestFailed(code, message))
        self._outbox.put(END)
        if self._metrics is not None:
            self._metrics.on_error(code)

    def on_shutdown(self) -> None:
        delta = self.record.finish(FinishReason.CANCELLED)
        if delta is not None:
            self._publish(self.record.response(delta), finished=True)

    def _publish(self, response: generate_pb2.GenerateResponse, finished: bool) -> None:
        self._outbox.put(response)
        if finished:
            self._outbox.put(END)
            if self._metrics is not None:
                self._metrics.on_finish(response)

    def responses(self, context: grpc.ServicerContext) -> Iterator[generate_pb2.GenerateResponse]:
        """The request's responses in order (blocking on the default outbox); a failure aborts
        the call with its status."""
        assert isinstance(self._outbox, queue.SimpleQueue), "a job with its own outbox"
        while (item := self._outbox.get()) is not END:
            try:
                yield response_of(item)
            except RequestFailed as e:
                context.abort(e.code, e.message)


def deadline_of(context: grpc.ServicerContext) -> float | None:
    """The call's deadline on time.monotonic()'s clock; None without one."""
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e9:
        return None
    return time.monotonic() + remaining


def served_model_pb(
    served: Served,
    target_dir: str,
    draft_dir: str | None,
    target: ModelInfo,
    draft: ModelInfo | None,
    draft_up: bool,
) -> generate_pb2.ServedModel:
    """The ServedModel that GetModelInfo reports for the served pair."""
    pb = generate_pb2.ServedModel(
        name=served.name,
        target_model=target_dir,
        draft_model=draft_dir or "",
        vocab_size=served.vocab_size,
        max_seq_len=served.max_seq_len,
        default_proposer=TO_PB[served.default_proposer],
        default_num_draft_tokens=served.default_num_draft_tokens,
        max_num_draft_tokens=served.max_num_draft_tokens,
        eos_token_ids=served.eos_token_ids,
        draft_up=draft_up,
        target=target.to_pb(),
    )
    if draft is not None:
        pb.draft.CopyFrom(draft.to_pb())
    return pb
