"""One entry of a parsed block or one verdict as an object, for tests to compare: the product
code reads both as columns (`specdec.serving.blocks.DraftBlock`, `...verdicts.VerifyResponse`)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.serving.blocks import DraftBlock, DraftProposal
from specdec.serving.messages import RequestError
from specdec.serving.verdicts import VerifyResponse


@dataclass(slots=True)
class VerifyResult:
    """The verdict for one request of a block (one position of a `specdec.v1.VerifyResponse`)."""

    request_id: str
    step: int
    token_ids: tuple[int, ...] = ()
    accepted: tuple[bool, ...] = ()
    committed_length: int = 0
    error: RequestError | None = None


def results(verdicts: VerifyResponse) -> list[VerifyResult]:
    """Every verdict as one object, in the block's order."""
    out = []
    for i, rid in enumerate(verdicts.request_ids):
        a, k = verdicts.num_accepted[i], verdicts.num_draft_tokens[i]
        out.append(VerifyResult(
            rid, verdicts.steps[i], tuple(verdicts.token_ids[i]),
            (True,) * a + (False,) * (k - a), verdicts.committed_lengths[i],
            verdicts.errors.get(i),
        ))  # fmt: skip
    return out


def proposal(block: DraftBlock, i: int) -> DraftProposal:
    """Entry i as one DraftProposal; ValueError if it is malformed."""
    if i in block.errors:
        raise ValueError(block.errors[i])
    return DraftProposal(
        block.request_ids[i], block.steps[i], block.committed_lengths[i],
        tuple(block.tokens(i)), block.q_rows(block.q_forms[i], [i]),
    )  # fmt: skip
