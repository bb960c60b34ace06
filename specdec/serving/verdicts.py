"""The target → driver half of the data plane: the verdicts of one block.

`VerifyResponse` is the domain form of the message of the same name: its columns, position i
answering entry i of the block: the target's engine fills the columns in place and the driver
reads them back the same way, with no object per verdict (~1 to 3 us of Python each way at
batch 32, bench/results/transport_notes.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, pairwise

from specdec.pb import target_pb2
from specdec.serving.messages import RequestError


@dataclass(slots=True)
class VerifyResponse:
    """The verdicts of one block as columns, in the block's order.

    Verdict i committed token_ids[i]: its first num_accepted[i] of num_draft_tokens[i] drafts
    (the sampler stops at the first rejection), then one recovered or bonus token. An error
    verdict (errors[i]) commits nothing and has zeros, except ERROR_REASON_DUPLICATE_STEP,
    which repeats the original verdict.
    """

    request_ids: list[str]
    steps: list[int]
    token_ids: list[Sequence[int]]
    num_accepted: list[int]
    num_draft_tokens: list[int]
    committed_lengths: list[int]
    errors: dict[int, RequestError]

    @classmethod
    def pending(cls, request_ids: Sequence[str], steps: Sequence[int]) -> VerifyResponse:
        """VerifyResponse for these entries with nothing committed yet, to fill in place."""
        n = len(request_ids)
        return cls(list(request_ids), list(steps), [()] * n, [0] * n, [0] * n, [0] * n, {})

    def __len__(self) -> int:
        return len(self.request_ids)

    def commit(
        self,
        i: int,
        token_ids: Sequence[int],
        num_accepted: int,
        num_draft_tokens: int,
        committed_length: int,
    ) -> None:
        self.token_ids[i], self.num_accepted[i] = token_ids, num_accepted
        self.num_draft_tokens[i], self.committed_lengths[i] = num_draft_tokens, committed_length

    def fail(self, i: int, error: RequestError) -> None:
        self.errors[i] = error

    def to_pb(self) -> target_pb2.VerifyResponse:
        pb = target_pb2.VerifyResponse(
            request_ids=self.request_ids,
            steps=self.steps,
            num_accepted=self.num_accepted,
            num_draft_tokens=self.num_draft_tokens,
            committed_lengths=self.committed_lengths,
            num_token_ids=[len(t) for t in self.token_ids],
            token_ids=list(chain.from_iterable(self.token_ids)),
        )
        for i in sorted(self.errors):
            pb.errors.add(index=i, error=self.errors[i].to_pb())
        return pb

    @classmethod
    def from_pb(cls, pb: target_pb2.VerifyResponse) -> VerifyResponse:
        """ValueError if the response's columns disagree."""
        # [:] copies a repeated field into a list in half the time list() takes (measured)
        rids, tokens = pb.request_ids[:], pb.token_ids[:]
        columns = [c[:] for c in (pb.steps, pb.num_accepted, pb.num_draft_tokens,
                                  pb.committed_lengths, pb.num_token_ids)]  # fmt: skip
        if any(len(c) != len(rids) for c in columns) or len(tokens) != sum(columns[-1]):
            raise ValueError("VerifyResponse columns have different lengths.")
        if any(e.index >= len(rids) for e in pb.errors):
            raise ValueError(f"VerifyResponse errors name an index past its {len(rids)} verdicts.")
        steps, accepted, ks, lengths, counts = columns
        starts = accumulate(counts, initial=0)
        token_ids: list[Sequence[int]] = [tokens[a:b] for a, b in pairwise(starts)]
        errors = {}
        for e in pb.errors:
            error = RequestError.from_pb(e.error)
            if error is not None:
                errors[e.index] = error
        return cls(rids, steps, token_ids, accepted, ks, lengths, errors)
