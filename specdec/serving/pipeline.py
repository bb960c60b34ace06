"""A minimal driver of the draft → target loop over real gRPC (the demo and the tests use it;
the orchestrator does the same with pipelining and scheduling).

Each step: ask the draft for k_i tokens per request (passing the last verdict's tokens), send
its block unchanged to the target, record the verdicts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from specdec.pb import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2_grpc
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import ProposeAsk
from specdec.serving.client import LockstepStream
from specdec.serving.messages import Admission
from specdec.serving.verdicts import Verdicts


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

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length :]


class Pipeline:
    """Admits requests on both services and runs lock-step propose → verify steps."""

    def __init__(self, draft: grpc.Channel, target: grpc.Channel, timeout_s: float = 60.0):
        self.draft = draft_pb2_grpc.DraftServiceStub(draft)
        self.target = target_pb2_grpc.TargetServiceStub(target)
        self.timeout_s = timeout_s
        self._propose = LockstepStream(self.draft.Propose)
        self._verify = LockstepStream(self.target.Verify)
        self.requests: dict[str, Tracked] = {}

    def admit(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams) -> None:
        pb = Admission(request_id, tuple(prompt), sampling).to_pb()
        for stub in (self.draft, self.target):
            stub.Admit(pb, timeout=self.timeout_s)
        self.requests[request_id] = Tracked(list(prompt), len(prompt))

    def release(self, request_ids: Sequence[str]) -> None:
        pb = common_pb2.ReleaseRequest(request_ids=request_ids)
        for stub in (self.draft, self.target):
            stub.Release(pb, timeout=self.timeout_s)
        for rid in request_ids:
            self.requests.pop(rid, None)

    def step(self, num_draft_tokens: Mapping[str, int]) -> Verdicts:
        """One propose → verify step for the given requests; the verdicts in the block's order."""
        asks = []
        for rid, k in num_draft_tokens.items():
            seq = self.requests[rid]
            ask = ProposeAsk(rid, seq.next_step, tuple(seq.new_tokens), len(seq.tokens), k)
            asks.append(ask.to_pb())
        proposed = self._propose(draft_pb2.ProposeBlock(entries=asks))
        if proposed.errors:
            raise RuntimeError(f"the draft refused: {proposed.errors[0]}")
        verdicts = Verdicts.from_pb(self._verify(proposed.block))
        for i, rid in enumerate(verdicts.request_ids):
            if i not in verdicts.errors:
                self._record(rid, verdicts, i)
        return verdicts

    def _record(self, rid: str, verdicts: Verdicts, i: int) -> None:
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
        self._propose.close()
        self._verify.close()
