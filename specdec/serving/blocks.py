"""The data plane: draft proposals (draft → target), verdicts (target → draft), propose asks.

A `DraftBlock` holds one entry per request, in any order, with k_i >= 0 draft tokens each and
q dense, sparse or absent. The q rows of all entries travel packed per form (one int32 and one
float32 buffer for the whole block's sparse q), and are decoded with one `frombuffer` per field
and split into per-entry views: per-entry messages cost ~10 us of Python each, which at batch
32 was most of the transport time (bench/results/transport.md).

`proposals_from_pb` checks shapes once for the block; a malformed buffer is a `ValueError`
naming the field, answered as every entry's error. A malformed entry (empty request_id, ...) is
returned as that entry's `ValueError`, and the target serves the rest of the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.pb import common_pb2, draft_pb2, target_pb2
from specdec.serving.arrays import pack, unpack
from specdec.serving.messages import RequestError

Q_NONE, Q_DENSE, Q_SPARSE = 0, 1, 2  # specdec.v1.QForm


@dataclass(frozen=True, slots=True)
class DenseQ:
    """q over the draft's whole vocabulary."""

    probs: torch.Tensor  # [k, vocab_size] float32


@dataclass(frozen=True, slots=True)
class SparseQ:
    """q over a truncated support; padding entries have id -1 and probability 0."""

    token_ids: torch.Tensor  # [k, support_size] int32
    probs: torch.Tensor  # [k, support_size] float32


DraftQ = DenseQ | SparseQ | None


@dataclass(frozen=True, slots=True)
class DraftProposal:
    """One request's drafts for one verify step (`specdec.v1.DraftEntry` plus its q rows)."""

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
        if rows is not None and rows != len(self.draft_token_ids):
            raise ValueError(
                f"q has {rows} rows for {len(self.draft_token_ids)} draft tokens; "
                "it needs one row per draft token."
            )

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def q_form(self) -> int:
        return Q_DENSE if isinstance(self.q, DenseQ) else Q_SPARSE if self.q else Q_NONE


def block_to_pb(proposals: list[DraftProposal]) -> common_pb2.DraftBlock:
    """One DraftBlock; the q rows of each form concatenated in entry order."""
    entries = [
        common_pb2.DraftEntry(
            request_id=p.request_id,
            step=p.step,
            committed_length=p.committed_length,
            draft_token_ids=p.draft_token_ids,
            q_form=p.q_form,  # type: ignore[arg-type]
        )
        for p in proposals
    ]
    pb = common_pb2.DraftBlock(entries=entries)
    dense = [p.q.probs for p in proposals if isinstance(p.q, DenseQ)]
    if dense:
        widths = {q.shape[1] for q in dense}
        if len(widths) > 1:
            raise ValueError(f"dense q rows of one block must share a width, got {widths}.")
        pb.dense.vocab_size = widths.pop()
        pb.dense.probs = pack(torch.cat(dense))
    sparse = [p.q for p in proposals if isinstance(p.q, SparseQ)]
    if sparse:
        width = max(q.probs.shape[1] for q in sparse)
        pad = [width - q.probs.shape[1] for q in sparse]
        ids = [torch.nn.functional.pad(q.token_ids, (0, w), value=-1) if w else q.token_ids
               for q, w in zip(sparse, pad, strict=True)]  # fmt: skip
        probs = [torch.nn.functional.pad(q.probs, (0, w)) if w else q.probs
                 for q, w in zip(sparse, pad, strict=True)]  # fmt: skip
        pb.sparse.support_size = width
        pb.sparse.token_ids = pack(torch.cat(ids))
        pb.sparse.probs = pack(torch.cat(probs))
    return pb


def _unpack(data: bytes, dtype: torch.dtype, shape: tuple[int, int], field: str) -> torch.Tensor:
    try:
        return unpack(data, dtype, shape, field)
    except ValueError as e:
        form = field.split(".")[0].upper()
        raise ValueError(
            f"{e} Rows: {shape[0]}, the draft tokens of the Q_FORM_{form} entries."
        ) from e


def _rows(
    entries: list[common_pb2.DraftEntry], ks: list[int], form: int, name: str, present: bool
) -> list[int]:
    """k_i of the entries of one q form; ValueError if they need a buffer the block lacks."""
    forms = [e.q_form for e in entries]
    rows = [k for k, f in zip(ks, forms, strict=True) if f == form]
    if rows and not present:
        i = forms.index(form)  # type: ignore[arg-type]
        raise ValueError(f"entries[{i}].q_form is {name.upper()} but the block has no {name}.")
    return rows


def _split_q(
    pb: common_pb2.DraftBlock, entries: list[common_pb2.DraftEntry], ks: list[int]
) -> dict[int, list[DraftQ]]:
    """Per-entry views of the block's dense and sparse q, by form (checked once per block)."""
    out: dict[int, list[DraftQ]] = {}
    bad = [i for i, e in enumerate(entries) if e.q_form not in (Q_NONE, Q_DENSE, Q_SPARSE)]
    if bad:
        raise ValueError(f"entries[{bad[0]}].q_form is {entries[bad[0]].q_form}; "
                         "expected Q_FORM_NONE, Q_FORM_DENSE or Q_FORM_SPARSE.")  # fmt: skip
    rows = _rows(entries, ks, Q_DENSE, "dense", pb.HasField("dense"))
    if rows:
        if pb.dense.vocab_size == 0:
            raise ValueError("dense.vocab_size must be > 0.")
        shape = (sum(rows), pb.dense.vocab_size)
        probs = _unpack(pb.dense.probs, torch.float32, shape, "dense.probs")
        out[Q_DENSE] = [DenseQ(p) for p in probs.split(rows)]
    rows = _rows(entries, ks, Q_SPARSE, "sparse", pb.HasField("sparse"))
    if rows:
        if pb.sparse.support_size == 0:
            raise ValueError("sparse.support_size must be > 0.")
        shape = (sum(rows), pb.sparse.support_size)
        ids = _unpack(pb.sparse.token_ids, torch.int32, shape, "sparse.token_ids").split(rows)
        probs = _unpack(pb.sparse.probs, torch.float32, shape, "sparse.probs").split(rows)
        out[Q_SPARSE] = [SparseQ(i, p) for i, p in zip(ids, probs, strict=True)]
    return out


def proposals_from_pb(pb: common_pb2.DraftBlock) -> list[DraftProposal | ValueError]:
    """The block's proposals in order; an entry that is malformed is its ValueError instead.

    Raises ValueError (naming the field) when the block's q buffers do not fit its entries:
    e.g. sparse.probs must hold sum(k_i of sparse entries) x support_size float32s.
    """
    entries = list(pb.entries)
    ids = [tuple(e.draft_token_ids) for e in entries]
    qs = _split_q(pb, entries, [len(t) for t in ids])
    taken = {form: iter(q) for form, q in qs.items()}
    out: list[DraftProposal | ValueError] = []
    for i, (e, tokens) in enumerate(zip(entries, ids, strict=True)):
        q = next(taken[e.q_form]) if e.q_form != Q_NONE else None
        try:
            out.append(DraftProposal(e.request_id, e.step, e.committed_length, tokens, q))
        except ValueError as err:
            out.append(ValueError(f"entries[{i}].{err}"))
    return out


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
