"""The data plane: draft proposals (draft → target), verdicts (target → draft), propose asks.

A `DraftBlock` holds one entry per request, in any order, with k_i >= 0 draft tokens each and
q dense, sparse or absent. It is columnar: one repeated field per entry attribute, and the
draft token ids and q rows of all entries packed per block (one int32 buffer of ids, one int32
and one float32 buffer for the whole block's sparse q), decoded with one `frombuffer` per field
and split into per-entry views. Per-entry messages cost ~1 to 10 us of Python each, which at
batch 32 was most of the transport time (bench/results/transport_notes.md). The verdicts come
back the same way, as the columns of one `VerifyResponse` (`results_to_pb` / `results_from_pb`).

The domain objects here are `slots` dataclasses but not frozen: a frozen dataclass's `__init__`
costs ~0.45 us more per object, ~60 us per batch-32 step over its ~130 objects (measured).

`proposals_from_pb` checks shapes once for the block; a malformed buffer is a `ValueError`
naming the field, answered as every entry's error. A malformed entry (empty request_id, ...) is
returned as that entry's `ValueError`, and the target serves the rest of the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.pb import common_pb2, draft_pb2, target_pb2
from specdec.serving.arrays import pack, unpack
from specdec.serving.messages import RequestError

Q_NONE, Q_DENSE, Q_SPARSE = 0, 1, 2  # specdec.v1.QForm
_INT32_WIRE = np.dtype("<i4")


@dataclass(slots=True)
class DenseQ:
    """q over the draft's whole vocabulary."""

    probs: torch.Tensor  # [k, vocab_size] float32


@dataclass(slots=True)
class SparseQ:
    """q over a truncated support; padding entries have id -1 and probability 0."""

    token_ids: torch.Tensor  # [k, support_size] int32
    probs: torch.Tensor  # [k, support_size] float32


DraftQ = DenseQ | SparseQ | None


@dataclass(slots=True)
class DraftProposal:
    """One request's drafts for one verify step (one entry of a `specdec.v1.DraftBlock`)."""

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
        return _Q_FORMS[type(self.q)]


_Q_FORMS: dict[type, int] = {type(None): Q_NONE, DenseQ: Q_DENSE, SparseQ: Q_SPARSE}


def block_to_pb(proposals: list[DraftProposal]) -> common_pb2.DraftBlock:
    """One columnar DraftBlock; draft token ids and q rows of each form concatenated in order."""
    qs = [p.q for p in proposals]
    pb = common_pb2.DraftBlock(
        request_ids=[p.request_id for p in proposals],
        steps=[p.step for p in proposals],
        committed_lengths=[p.committed_length for p in proposals],
        num_draft_tokens=[len(p.draft_token_ids) for p in proposals],
        q_forms=[_Q_FORMS[type(q)] for q in qs],  # type: ignore[misc]
        draft_token_ids=_pack_ints([t for p in proposals for t in p.draft_token_ids]),
    )
    dense = [q.probs for q in qs if type(q) is DenseQ]
    if dense:
        widths = {q.shape[1] for q in dense}
        if len(widths) > 1:
            raise ValueError(f"dense q rows of one block must share a width, got {widths}.")
        pb.dense.vocab_size = widths.pop()
        pb.dense.probs = pack(torch.cat(dense))
    sparse = [q for q in qs if type(q) is SparseQ]
    if sparse:
        supports = [q.probs.shape[1] for q in sparse]
        width = max(supports)
        if min(supports) == width:  # the usual case: one support size for the whole block
            sparse_ids, probs = [q.token_ids for q in sparse], [q.probs for q in sparse]
        else:
            pad = [width - w for w in supports]
            sparse_ids = [torch.nn.functional.pad(q.token_ids, (0, w), value=-1)
                          for q, w in zip(sparse, pad, strict=True)]  # fmt: skip
            probs = [torch.nn.functional.pad(q.probs, (0, w))
                     for q, w in zip(sparse, pad, strict=True)]  # fmt: skip
        pb.sparse.support_size = width
        pb.sparse.token_ids = pack(torch.cat(sparse_ids))
        pb.sparse.probs = pack(torch.cat(probs))
    return pb


def _pack_ints(values: list[int]) -> bytes:
    return np.asarray(values, dtype=_INT32_WIRE).tobytes()


def _unpack(data: bytes, dtype: torch.dtype, shape: tuple[int, int], field: str) -> torch.Tensor:
    try:
        return unpack(data, dtype, shape, field)
    except ValueError as e:
        form = field.split(".")[0].upper()
        raise ValueError(
            f"{e} Rows: {shape[0]}, the draft tokens of the Q_FORM_{form} entries."
        ) from e


def _rows(ks: list[int], forms: list[int], form: int, name: str, present: bool) -> list[int]:
    """k_i of the entries of one q form; ValueError if they need a buffer the block lacks."""
    rows = [k for k, f in zip(ks, forms, strict=True) if f == form]
    if rows and not present:
        i = forms.index(form)
        raise ValueError(f"entries[{i}].q_form is {name.upper()} but the block has no {name}.")
    return rows


def _split_q(pb: common_pb2.DraftBlock, ks: list[int], forms: list[int]) -> dict[int, list[DraftQ]]:
    """Per-entry views of the block's dense and sparse q, by form (checked once per block)."""
    out: dict[int, list[DraftQ]] = {}
    bad = [i for i, f in enumerate(forms) if f not in (Q_NONE, Q_DENSE, Q_SPARSE)]
    if bad:
        raise ValueError(f"entries[{bad[0]}].q_form is {forms[bad[0]]}; "
                         "expected Q_FORM_NONE, Q_FORM_DENSE or Q_FORM_SPARSE.")  # fmt: skip
    rows = _rows(ks, forms, Q_DENSE, "dense", pb.HasField("dense"))
    if rows:
        if pb.dense.vocab_size == 0:
            raise ValueError("dense.vocab_size must be > 0.")
        shape = (sum(rows), pb.dense.vocab_size)
        probs = _unpack(pb.dense.probs, torch.float32, shape, "dense.probs")
        out[Q_DENSE] = [DenseQ(p) for p in probs.split(rows)]
    rows = _rows(ks, forms, Q_SPARSE, "sparse", pb.HasField("sparse"))
    if rows:
        if pb.sparse.support_size == 0:
            raise ValueError("sparse.support_size must be > 0.")
        shape = (sum(rows), pb.sparse.support_size)
        ids = _unpack(pb.sparse.token_ids, torch.int32, shape, "sparse.token_ids").split(rows)
        probs = _unpack(pb.sparse.probs, torch.float32, shape, "sparse.probs").split(rows)
        out[Q_SPARSE] = [SparseQ(i, p) for i, p in zip(ids, probs, strict=True)]
    return out


def _columns(pb: common_pb2.DraftBlock) -> tuple[list[int], list[int], list[int], list[int]]:
    """(steps, committed_lengths, num_draft_tokens, q_forms); ValueError if their lengths differ
    from request_ids' or draft_token_ids does not hold sum(num_draft_tokens) int32s."""
    n = len(pb.request_ids)
    names = ("steps", "committed_lengths", "num_draft_tokens", "q_forms")
    columns = [list(getattr(pb, name)) for name in names]
    for name, column in zip(names, columns, strict=True):
        if len(column) != n:
            raise ValueError(f"{name} has {len(column)} values for {n} request_ids; "
                             "every column needs one per entry.")  # fmt: skip
    total = sum(columns[2])
    if len(pb.draft_token_ids) != 4 * total:
        raise ValueError(
            f"draft_token_ids has {len(pb.draft_token_ids)} bytes; expected {4 * total} (the "
            f"entries' num_draft_tokens sum to {total}, little-endian int32)."
        )
    steps, lengths, ks, forms = columns
    return steps, lengths, ks, forms


def proposals_from_pb(pb: common_pb2.DraftBlock) -> list[DraftProposal | ValueError]:
    """The block's proposals in order; an entry that is malformed is its ValueError instead.

    Raises ValueError (naming the field) when the block's columns or buffers do not fit each
    other: e.g. sparse.probs must hold sum(k_i of sparse entries) x support_size float32s.
    """
    steps, lengths, ks, forms = _columns(pb)
    flat = np.frombuffer(pb.draft_token_ids, dtype=_INT32_WIRE).tolist()
    taken = {form: iter(q) for form, q in _split_q(pb, ks, forms).items()}
    out: list[DraftProposal | ValueError] = []
    start = 0
    for i, (rid, step, length, k, form) in enumerate(
        zip(pb.request_ids, steps, lengths, ks, forms, strict=True)
    ):
        tokens, start = tuple(flat[start : start + k]), start + k
        q = next(taken[form]) if form != Q_NONE else None
        try:
            out.append(DraftProposal(rid, step, length, tokens, q))
        except ValueError as err:
            out.append(ValueError(f"entries[{i}].{err}"))
    return out


@dataclass(slots=True)
class VerifyResult:
    """The verdict for one request of a block (one position of a `specdec.v1.VerifyResponse`)."""

    request_id: str
    step: int
    token_ids: tuple[int, ...] = ()
    accepted: tuple[bool, ...] = ()
    committed_length: int = 0
    error: RequestError | None = None

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted)


def results_to_pb(results: list[VerifyResult]) -> target_pb2.VerifyResponse:
    """The verdicts of one block as the columns of one VerifyResponse, in order."""
    num_accepted = [a.count(True) for a in (r.accepted for r in results)]
    prefixes = [r.accepted[:n] for r, n in zip(results, num_accepted, strict=True)]
    assert all(False not in a for a in prefixes), (
        "accepted drafts must be a prefix: the sampler stops at the first rejection"
    )
    pb = target_pb2.VerifyResponse(
        request_ids=[r.request_id for r in results],
        steps=[r.step for r in results],
        num_accepted=num_accepted,
        num_draft_tokens=[len(r.accepted) for r in results],
        committed_lengths=[r.committed_length for r in results],
        num_token_ids=[len(r.token_ids) for r in results],
        token_ids=[t for r in results for t in r.token_ids],
    )
    for i, r in enumerate(results):
        if r.error is not None:
            pb.errors.add(index=i, error=r.error.to_pb())
    return pb


def results_from_pb(pb: target_pb2.VerifyResponse) -> list[VerifyResult]:
    """The verdicts of a VerifyResponse, in order; ValueError if its columns disagree."""
    rids, tokens = list(pb.request_ids), list(pb.token_ids)
    columns = [list(c) for c in (pb.steps, pb.num_accepted, pb.num_draft_tokens,
                                 pb.committed_lengths, pb.num_token_ids)]  # fmt: skip
    if any(len(c) != len(rids) for c in columns) or len(tokens) != sum(columns[-1]):
        raise ValueError("VerifyResponse columns have different lengths.")
    errors = {e.index: RequestError.from_pb(e.error) for e in pb.errors}
    flags: dict[tuple[int, int], tuple[bool, ...]] = {}
    out, start = [], 0
    for i, (rid, step, a, k, length, m) in enumerate(zip(rids, *columns, strict=True)):
        accepted = flags.get((a, k))
        if accepted is None:
            accepted = flags[a, k] = (True,) * a + (False,) * (k - a)
        out.append(VerifyResult(rid, step, tuple(tokens[start : start + m]), accepted, length,
                                errors.get(i)))  # fmt: skip
        start += m
    return out


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
