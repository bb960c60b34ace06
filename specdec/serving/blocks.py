"""The data plane: draft proposals (draft → target), verdicts (target → draft), propose asks.

A `DraftBlock` holds one `DraftProposal` per request, in any order, with k_i >= 0 draft tokens
each and q dense, sparse or absent. Shapes are checked in `from_pb`, so a malformed entry is a
`ValueError` naming its field (the target answers it as that request's error and serves the
rest of the block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.pb import common_pb2, draft_pb2, target_pb2
from specdec.serving.arrays import pack, unpack
from specdec.serving.messages import RequestError


@dataclass(frozen=True, slots=True)
class DenseQ:
    """q over the draft's whole vocabulary."""

    probs: torch.Tensor  # [k, vocab_size] float32

    def __post_init__(self) -> None:
        assert self.probs.dtype == torch.float32 and self.probs.dim() == 2, "probs: f32 [k, V]"

    @classmethod
    def from_pb(cls, pb: common_pb2.DenseProbs, k: int, prefix: str) -> DenseQ:
        if pb.vocab_size == 0:
            raise ValueError(f"{prefix}.vocab_size must be > 0.")
        shape = (k, pb.vocab_size)
        return cls(unpack(pb.probs, torch.float32, shape, f"{prefix}.probs"))

    def to_pb(self) -> common_pb2.DenseProbs:
        return common_pb2.DenseProbs(vocab_size=self.probs.shape[1], probs=pack(self.probs))


@dataclass(frozen=True, slots=True)
class SparseQ:
    """q over a truncated support; padding entries have id -1 and probability 0."""

    token_ids: torch.Tensor  # [k, support_size] int32
    probs: torch.Tensor  # [k, support_size] float32

    def __post_init__(self) -> None:
        assert self.token_ids.dtype == torch.int32 and self.probs.dtype == torch.float32
        assert self.token_ids.shape == self.probs.shape and self.probs.dim() == 2

    @classmethod
    def from_pb(cls, pb: common_pb2.SparseProbs, k: int, prefix: str) -> SparseQ:
        if pb.support_size == 0:
            raise ValueError(f"{prefix}.support_size must be > 0.")
        shape = (k, pb.support_size)
        ids = unpack(pb.token_ids, torch.int32, shape, f"{prefix}.token_ids")
        return cls(ids, unpack(pb.probs, torch.float32, shape, f"{prefix}.probs"))

    def to_pb(self) -> common_pb2.SparseProbs:
        return common_pb2.SparseProbs(
            support_size=self.probs.shape[1],
            token_ids=pack(self.token_ids),
            probs=pack(self.probs),
        )


DraftQ = DenseQ | SparseQ | None


@dataclass(frozen=True, slots=True)
class DraftProposal:
    """One request's drafts for one verify step (`specdec.v1.DraftEntry`)."""

    request_id: str
    step: int
    committed_length: int
    draft_token_ids: tuple[int, ...]
    q: DraftQ = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string.")
        if self.committed_length < 1:
            raise ValueError(f"committed_length must be >= 1, got {self.committed_length}.")
        rows = None if self.q is None else self.q.probs.shape[0]
        if rows is not None and rows != self.num_draft_tokens:
            raise ValueError(
                f"q has {rows} rows for {self.num_draft_tokens} draft tokens; "
                "it needs one row per draft token."
            )

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @classmethod
    def from_pb(cls, pb: common_pb2.DraftEntry, prefix: str = "entry") -> DraftProposal:
        k = len(pb.draft_token_ids)
        kind = pb.WhichOneof("draft_probs")
        q: DraftQ = None
        if kind == "dense":
            q = DenseQ.from_pb(pb.dense, k, f"{prefix}.dense")
        elif kind == "sparse":
            q = SparseQ.from_pb(pb.sparse, k, f"{prefix}.sparse")
        try:
            return cls(pb.request_id, pb.step, pb.committed_length, tuple(pb.draft_token_ids), q)
        except ValueError as e:
            raise ValueError(f"{prefix}: {e}") from e

    def to_pb(self) -> common_pb2.DraftEntry:
        pb = common_pb2.DraftEntry(
            request_id=self.request_id,
            step=self.step,
            committed_length=self.committed_length,
            draft_token_ids=self.draft_token_ids,
        )
        if isinstance(self.q, DenseQ):
            pb.dense.CopyFrom(self.q.to_pb())
        elif isinstance(self.q, SparseQ):
            pb.sparse.CopyFrom(self.q.to_pb())
        return pb


def block_to_pb(proposals: list[DraftProposal]) -> common_pb2.DraftBlock:
    return common_pb2.DraftBlock(entries=[p.to_pb() for p in proposals])


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """The verdict for one request of a block (`specdec.v1.VerifyResult`)."""

    request_id: str
    step: int
    token_ids: tuple[int, ...] = ()
    accepted: tuple[bool, ...] = ()
    committed_length: int = 0
    error: RequestError | None = None

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted)

    @classmethod
    def from_pb(cls, pb: target_pb2.VerifyResult) -> VerifyResult:
        error = RequestError.from_pb(pb.error) if pb.HasField("error") else None
        return cls(
            pb.request_id, pb.step, tuple(pb.token_ids), tuple(pb.accepted),
            pb.committed_length, error,
        )  # fmt: skip

    def to_pb(self) -> target_pb2.VerifyResult:
        pb = target_pb2.VerifyResult(
            request_id=self.request_id,
            step=self.step,
            token_ids=self.token_ids,
            num_accepted=self.num_accepted,
            accepted=self.accepted,
            committed_length=self.committed_length,
        )
        if self.error is not None:
            pb.error.CopyFrom(self.error.to_pb())
        return pb


@dataclass(frozen=True, slots=True)
class ProposeAsk:
    """One request's ask for drafts (`specdec.v1.ProposeEntry`)."""

    request_id: str
    step: int
    new_token_ids: tuple[int, ...]
    committed_length: int
    num_draft_tokens: int

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string.")

    @classmethod
    def from_pb(cls, pb: draft_pb2.ProposeEntry) -> ProposeAsk:
        return cls(
            pb.request_id, pb.step, tuple(pb.new_token_ids), pb.committed_length,
            pb.num_draft_tokens,
        )  # fmt: skip

    def to_pb(self) -> draft_pb2.ProposeEntry:
        return draft_pb2.ProposeEntry(
            request_id=self.request_id,
            step=self.step,
            new_token_ids=self.new_token_ids,
            committed_length=self.committed_length,
            num_draft_tokens=self.num_draft_tokens,
        )
