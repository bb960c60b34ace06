"""The orchestrator's record of one request: the source of truth for its committed tokens.

The hub streams one verdict per request per step (an `orchestrator.core.pair.StepEvent`);
`RequestRecord.apply` takes each exactly once by (request id, step): a duplicate or stale step
(a verdict seen again after a reconnect) is dropped, a step beyond the next expected one is a
`StepGapError`. Applying a verdict commits its tokens one at a time, checking after each the
stop token ids, the stop strings (through the incremental detokenizer) and max_tokens; tokens
after the one that finished the request are dropped, so a length-limited request has exactly
max_tokens tokens. After a service restart, `readmission()` is what gets re-prefilled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from orchestrator.core.detokenizer import IncrementalDetokenizer
from orchestrator.core.pair import StepEvent
from specdec.pb.specdec.v1 import generate_pb2
from specdec.serving.messages import RequestError
from specdec.serving.proposers import TO_PB

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 64


class FinishReason(IntEnum):
    """Mirror of `specdec.v1.FinishReason` (a test checks the two agree)."""

    LENGTH = 1
    STOP_STRING = 2
    STOP_TOKEN = 3
    MAX_SEQ_LEN = 4
    CANCELLED = 5


class StepGapError(RuntimeError):
    """A verdict arrived for a step after the next expected one: verdicts were lost."""


@dataclass(frozen=True, slots=True)
class StopCriteria:
    """When a request ends. max_tokens None: only at a stop or at max_seq_len."""

    max_tokens: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}."
            )
        for i, s in enumerate(self.stop):
            if not 1 <= len(s) <= MAX_STOP_STRING_LEN:
                raise ValueError(
                    f"stop[{i}] must be 1 to {MAX_STOP_STRING_LEN} characters long, got {len(s)}."
                )

    @classmethod
    def from_pb(
        cls,
        request: generate_pb2.GenerateRequest,
        *,
        prompt_len: int,
        max_seq_len: int,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
    ) -> StopCriteria:
        """Checks the request's stop fields against the model; ValueError names the field."""
        room = max_seq_len - prompt_len
        if room < 1:
            raise ValueError(
                f"prompt holds {prompt_len} tokens, which leaves no room for one more below "
                f"max_seq_len {max_seq_len}."
            )
        max_tokens = request.max_tokens if request.HasField("max_tokens") else None
        if max_tokens is not None and not 1 <= max_tokens <= room:
            raise ValueError(
                f"max_tokens must be in [1, {room}] (max_seq_len {max_seq_len} minus the "
                f"prompt's {prompt_len} tokens), got {max_tokens}."
            )
        # the client's ids only: the model's EOS ids join them below and do not count
        if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids, "
                f"got {len(request.stop_token_ids)}."
            )
        for i, token in enumerate(request.stop_token_ids):
            if not 0 <= token < vocab_size:
                raise ValueError(f"stop_token_ids[{i}] must be in [0, {vocab_size}), got {token}.")
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids.update(eos_token_ids)
        return cls(
            max_tokens=max_tokens,
            stop_token_ids=frozenset(stop_ids),
            stop=tuple(request.stop),
            include_stop_str_in_output=request.include_stop_str_in_output,
            max_seq_len=max_seq_len,
        )


@dataclass(frozen=True, slots=True)
class StepAcceptance:
    """Drafted and accepted counts of one step of one request."""

    step: int
    num_draft_tokens: int
    num_accepted: int

    def to_pb(self) -> generate_pb2.StepAcceptance:
        return generate_pb2.StepAcceptance(
            step=self.step, num_draft_tokens=self.num_draft_tokens, num_accepted=self.num_accepted
        )


@dataclass(frozen=True, slots=True)
class Delta:
    """What one applied verdict (or a finish) adds to a request's output."""

    text: str
    token_ids: tuple[int, ...]
    acceptance: StepAcceptance | None
    finished: bool
    error: RequestError | None = None


@dataclass(slots=True)
class _Counts:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, acceptance: StepAcceptance) -> None:
        k, accepted = acceptance.num_draft_tokens, acceptance.num_accepted
        if k == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted += accepted
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos.extend([0] * (k - len(self.accepted_per_pos)))
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1


class RequestRecord:
    """One request's prompt, committed tokens in order, next step, output text and counts.

    Not thread-safe: the orchestrator applies a request's verdicts from one thread.
    """

    def __init__(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        criteria: StopCriteria,
        *,
        detokenizer: IncrementalDetokenizer | None = None,
        proposer: str = "off",
        num_draft_tokens: int = 0,
        first_step: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token.")
        if proposer not in TO_PB:
            raise ValueError(f"proposer must be one of {sorted(TO_PB)}, got {proposer!r}.")
        self.request_id = request_id
        self.prompt_ids = tuple(prompt_ids)
        self.criteria = criteria
        self.proposer = proposer
        self.num_draft_tokens = num_draft_tokens
        # k stays num_draft_tokens under dynamic speculation: a seeded sampled request
        self.fixed_num_draft_tokens = False
        self.next_step = first_step
        self.committed: list[int] = []
        self.steps: list[StepAcceptance] = []
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None
        self.error: RequestError | None = None
        self._detok = detokenizer
        self._counts = _Counts()
        self._clock = clock
        self.arrival_s = clock()
        self.sent_s: float | None = None  # first sent to a pair
        self.admitted_s: float | None = None  # first admission answered
        self.prefill_s = 0.0  # the services' own time for that admission
        self.first_token_s: float | None = None
        self.finished_s: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def stop_string(self) -> str | None:
        return self._detok.stop_string if self._detok is not None else None

    def mark_sent(self) -> None:
        if self.sent_s is None:
            self.sent_s = self._clock()

    def mark_admitted(self, prefill_s: float) -> None:
        if self.admitted_s is None:
            self.admitted_s, self.prefill_s = self._clock(), prefill_s

    def readmission(self) -> tuple[tuple[int, ...], int]:
        """What a fresh service prefills: prompt plus committed tokens, and the next step."""
        return (*self.prompt_ids, *self.committed), self.next_step

    def apply(self, event: StepEvent) -> Delta | None:
        """Applies one verdict; None when it is a duplicate, stale, or after the request ended."""
        assert event.request_id == self.request_id, "a verdict for another request"
        if self.done or event.step < self.next_step:
            return None
        if event.step > self.next_step:
            raise StepGapError(
                f"request {self.request_id!r} expected the verdict of step {self.next_step}, "
                f"got step {event.step}: verdicts were lost."
            )
        self.next_step += 1
        if event.error is not None:
            self.error = event.error
            self.finished_s = self._clock()
            return Delta("", (), None, finished=True, error=event.error)
        acceptance = StepAcceptance(event.step, event.num_draft_tokens, event.num_accepted)
        self.steps.append(acceptance)
        self._counts.add(acceptance)
        if event.token_ids and self.first_token_s is None:
            self.first_token_s = self._clock()
        token_ids, text = self._commit(event.token_ids)
        return Delta(text, token_ids, acceptance, finished=self.done)

    def finish(self, reason: FinishReason = FinishReason.CANCELLED) -> Delta | None:
        """Ends the request from outside (shutdown, drain); None if it had already ended."""
        if self.done:
            return None
        tail = self._end(reason)
        self.text += tail
        return Delta(tail, (), None, finished=True)

    def _commit(self, token_ids: Sequence[int]) -> tuple[tuple[int, ...], str]:
        """Commits tokens until one finishes the request; returns those kept and new text."""
        kept: list[int] = []
        text: list[str] = []
        for token in token_ids:
            kept.append(token)
            self.committed.append(token)
            reason = self._check(token, text)
            if reason is not None:
                text.append(self._end(reason))
                break
        delta = "".join(text)
        self.text += delta
        return tuple(kept), delta

    def _check(self, token: int, text: list[str]) -> FinishReason | None:
        """Finish reason after `token`, in vLLM's order: stop token, stop string, lengths."""
        c = self.criteria
        if token in c.stop_token_ids:
            self.stop_token_id = token  # its text is not output
            return FinishReason.STOP_TOKEN
        if self._detok is not None:
            text.append(self._detok.add(token))
            if self._detok.stop_string is not None:
                return FinishReason.STOP_STRING
        if c.max_tokens is not None and len(self.committed) >= c.max_tokens:
            return FinishReason.LENGTH
        if (
            c.max_seq_len is not None
            and len(self.prompt_ids) + len(self.committed) >= c.max_seq_len
        ):
            return FinishReason.MAX_SEQ_LEN
        return None

    def _end(self, reason: FinishReason) -> str:
        """Marks the request finished; returns the text the detokenizer still held."""
        tail = ""
        if self._detok is not None and reason != FinishReason.STOP_STRING:
            tail = self._detok.finish()
            if self._detok.stop_string is not None:
                # The flushed text held a stop string: the output ends before it, as for any
                # stop-string finish.
                reason = FinishReason.STOP_STRING
                self.stop_token_id = None
        self.finish_reason = reason
        self.finished_s = self._clock()
        return tail

    # Responses ---------------------------------------------------------------------------

    def usage(self) -> generate_pb2.Usage:
        c = self._counts
        return generate_pb2.Usage(
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.committed),
            num_steps=len(self.steps),
            num_drafts=c.num_drafts,
            num_draft_tokens=c.num_draft_tokens,
            num_accepted_tokens=c.num_accepted,
            num_accepted_tokens_per_pos=c.accepted_per_pos,
            proposer=TO_PB[self.proposer],
            num_draft_tokens_per_step=self.num_draft_tokens,
        )

    def timing(self) -> generate_pb2.Timing:
        end = self.finished_s if self.finished_s is not None else self._clock()
        return generate_pb2.Timing(
            queue_s=(self.sent_s if self.sent_s is not None else end) - self.arrival_s,
            time_to_first_token_s=(
                self.first_token_s - self.arrival_s if self.first_token_s is not None else 0.0
            ),
            e2e_s=end - self.arrival_s,
            admission_s=(self.admitted_s if self.admitted_s is not None else end) - self.arrival_s,
            prefill_s=self.prefill_s,
        )

    def response(self, delta: Delta) -> generate_pb2.GenerateResponse:
        """The streamed GenerateResponse of a delta; the final one carries the summary."""
        assert delta.error is None, "an error ends the call with its status, not a response"
        pb = generate_pb2.GenerateResponse(
            request_id=self.request_id,
            text=delta.text,
            token_ids=delta.token_ids,
            steps=[delta.acceptance.to_pb()] if delta.acceptance is not None else [],
        )
        if delta.finished:
            self._summarise(pb)
        return pb

    def complete_response(self) -> generate_pb2.GenerateResponse:
        """The whole output as one GenerateResponse (the unary Complete rpc)."""
        assert self.finish_reason is not None, "the request has not finished"
        pb = generate_pb2.GenerateResponse(
            request_id=self.request_id,
            text=self.text,
            token_ids=self.committed,
            steps=[s.to_pb() for s in self.steps],
        )
        self._summarise(pb)
        return pb

    def _summarise(self, pb: generate_pb2.GenerateResponse) -> None:
        assert self.finish_reason is not None
        pb.finish_reason = int(self.finish_reason)  # type: ignore[assignment]
        if self.finish_reason == FinishReason.STOP_STRING and self.stop_string is not None:
            pb.stop_string = self.stop_string
        elif self.stop_token_id is not None:
            pb.stop_token_id = self.stop_token_id
        pb.usage.CopyFrom(self.usage())
        pb.timing.CopyFrom(self.timing())
