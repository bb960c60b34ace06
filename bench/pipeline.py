"""A direct driver of the two services over real gRPC, without the hub: the tests and the
system benchmark use it to drive the services step by step (`specdec serve` drives them through
the target's Serve stream instead, `orchestrator.core.pair`).

Each step: ask the draft for k_i tokens per request (passing the last verdict's tokens), send
its block unchanged to the target, record the verdicts. Without a draft channel the pipeline
is target-only: every step sends the target a block of k = 0 entries (plain decoding) and the
draft is never called.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from specdec.pb import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2_grpc
from specdec.sampling_params import SamplingParams
from specdec.serving.client import LockstepStream
from specdec.serving.messages import AdmitRequest, ProposeEntry, QForm
from specdec.serving.verdicts import VerifyResponse


@dataclass(slots=True)
class Tracked:
    """The driver's record of one request (the orchestrator owns committed tokens)."""

    tokens: list[int]
    prompt_length: int
    next_step: int = 0
    new_tokens: list[int] = field(default_factory=list)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    # a sampled request: its seed is its own (as the orchestrator's seeded requests), so its
    # k must not depend on draft-ahead's hits (ProposeEntry.fixed_num_draft_tokens)
    fixed_num_draft_tokens: bool = False

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length :]


@dataclass(slots=True)
class CallTiming:
    """One rpc of a step as the driver saw it: the round trip from handing the message to the
    stream to holding the response, and the service's own account (`specdec.v1.StepTiming`;
    all zeros from a service that does not report it)."""

    round_trip_s: float
    service: common_pb2.StepTiming


@dataclass(slots=True)
class StepTrace:
    """The last step's calls: `propose` is None for a target-only step."""

    propose: CallTiming | None
    verify: CallTiming


class Pipeline:
    """Admits requests on both services (or on the target only, `draft=None`) and runs
    lock-step propose → verify steps. `last_step` holds the timing of the last step's calls."""

    def __init__(
        self, draft: grpc.Channel | None, target: grpc.Channel, timeout_s: float = 60.0
    ) -> None:
        self.draft = None if draft is None else draft_pb2_grpc.DraftServiceStub(draft)
        self.target = target_pb2_grpc.TargetServiceStub(target)
        self.timeout_s = timeout_s
        self._propose = None if self.draft is None else LockstepStream(self.draft.Propose)
        self._verify = LockstepStream(self.target.Verify)
        self.requests: dict[str, Tracked] = {}
        self.last_step: StepTrace | None = None

    @property
    def _stubs(self) -> list[draft_pb2_grpc.DraftServiceStub | target_pb2_grpc.TargetServiceStub]:
        return [self.target] if self.draft is None else [self.draft, self.target]

    def admit(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams) -> None:
        pb = AdmitRequest(request_id, tuple(prompt), sampling).to_pb()
        for stub in self._stubs:
            stub.Admit(pb, timeout=self.timeout_s)
        tracked = Tracked(list(prompt), len(prompt))
        tracked.fixed_num_draft_tokens = not sampling.greedy
        self.requests[request_id] = tracked

    def release(self, request_ids: Sequence[str]) -> None:
        pb = common_pb2.ReleaseRequest(request_ids=request_ids)
        for stub in self._stubs:
            stub.Release(pb, timeout=self.timeout_s)
        for rid in request_ids:
            self.requests.pop(rid, None)

    def step(self, num_draft_tokens: Mapping[str, int]) -> VerifyResponse:
        """One propose → verify step for the given requests; the verdicts in the block's order.
        Target-only (no draft): every k must be 0."""
        if self._propose is None:
            if any(num_draft_tokens.values()):
                raise ValueError("a target-only pipeline (no draft) takes k = 0 for every request.")
            propose, block = None, self._decode_block(num_draft_tokens)
        else:
            propose, block = self._proposals(num_draft_tokens)
        start = time.perf_counter()
        response = self._verify(block)
        verify = CallTiming(time.perf_counter() - start, response.timing)
        self.last_step = StepTrace(propose, verify)
        verdicts = VerifyResponse.from_pb(response)
        for i, rid in enumerate(verdicts.request_ids):
            if i not in verdicts.errors:
                self._record(rid, verdicts, i)
        return verdicts

    def _proposals(
        self, num_draft_tokens: Mapping[str, int]
    ) -> tuple[CallTiming, common_pb2.DraftBlock]:
        assert self._propose is not None
        asks = []
        for rid, k in num_draft_tokens.items():
            seq = self.requests[rid]
            ask = ProposeEntry(rid, seq.next_step, tuple(seq.new_tokens), len(seq.tokens), k,
                               seq.fixed_num_draft_tokens)  # fmt: skip
            asks.append(ask.to_pb())
        start = time.perf_counter()
        proposed = self._propose(draft_pb2.ProposeBlock(entries=asks))
        timing = CallTiming(time.perf_counter() - start, proposed.timing)
        if proposed.errors:
            raise RuntimeError(f"the draft refused: {proposed.errors[0]}")
        return timing, proposed.block

    def _decode_block(self, num_draft_tokens: Mapping[str, int]) -> common_pb2.DraftBlock:
        """A block of k = 0 entries (the target decodes one token each), built as columns."""
        rids = list(num_draft_tokens)
        seqs = [self.requests[rid] for rid in rids]
        return common_pb2.DraftBlock(
            request_ids=rids,
            steps=[s.next_step for s in seqs],
            committed_lengths=[len(s.tokens) for s in seqs],
            num_draft_tokens=[0] * len(rids),
            q_forms=[QForm.NONE] * len(rids),  # type: ignore[list-item]
        )

    def _record(self, rid: str, verdicts: VerifyResponse, i: int) -> None:
        seq, tokens, k = self.requests[rid], verdicts.token_ids[i], verdicts.num_draft_tokens[i]
        seq.tokens.extend(tokens)
        seq.new_tokens = list(tokens)
        seq.next_step = verdicts.steps[i] + 1
        seq.num_drafts += k > 0
        seq.num_draft_tokens += k
        seq.num_accepted += verdicts.num_accepted[i]

    def generate(self, num_draft_tokens: Mapping[str, int], max_new_tokens: int) -> None:
        """Steps until every request has at least `max_new_tokens` generated tokens."""
        while True:
            ks = {
                rid: k
                for rid, k in num_draft_tokens.items()
                if len(self.requests[rid].generated) < max_new_tokens
            }
            if not ks:
                return
            verdicts = self.step(ks)
            if verdicts.errors:
                i = min(verdicts.errors)
                error = verdicts.errors[i]
                raise RuntimeError(f"request {verdicts.request_ids[i]}: {error.message}")

    def close(self) -> None:
        if self._propose is not None:
            self._propose.close()
        self._verify.close()
