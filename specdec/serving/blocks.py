"""The draft → target half of the data plane: draft proposals and propose asks.

A `DraftBlock` holds one entry per request, in any order, with k_i >= 0 draft tokens each and
q dense, sparse or absent. It is columnar: one repeated field per entry attribute, and the
draft token ids and q rows of all entries packed per block (one int32 buffer of ids, one int32
and one float32 buffer for the whole block's sparse q). The draft builds it from per-request
`DraftProposal`s (`block_to_pb`); the target reads it as columns (`DraftBlock`): one
`frombuffer` per field and whole [rows, S] q tensors that the rejection sampler takes as they
are. Per-entry objects and tensor views cost ~1 to 3 us of Python each, which at batch 32 was
most of the transport time (bench/results/transport_notes.md).

The domain objects here are `slots` dataclasses but not frozen: a frozen dataclass's `__init__`
costs ~0.45 us more per object (measured).

`DraftBlock.from_pb` checks shapes once for the block; a malformed buffer is a `ValueError`
naming the field, answered as every entry's error. A malformed entry (empty request_id, ...) is
recorded as that entry's error message, and the target serves the rest of the block.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np
import torch

from specdec.limits import (
    MAX_COMMITTED_LENGTH,
    MAX_STEP,
    MAX_VOCAB,
    MAX_WIRE_NUM_DRAFT_TOKENS,
    check_range,
)
from specdec.pb import common_pb2
from specdec.serving.arrays import pack, unpack
from specdec.serving.messages import QForm

Q_NONE, Q_DENSE, Q_SPARSE = int(QForm.NONE), int(QForm.DENSE), int(QForm.SPARSE)
_FORMS = (Q_NONE, Q_DENSE, Q_SPARSE)
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
        check_range(self.step, "step", 0, MAX_STEP)
        check_range(self.committed_length, "committed_length", 1, MAX_COMMITTED_LENGTH)
        rows = None if self.q is None else self.q.probs.shape[0]
        if rows is not None and rows != len(self.draft_token_ids):
            raise ValueError(
                f"q has {rows} rows for {len(self.draft_token_ids)} draft tokens; "
                "it needs one row per draft token."
            )

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)


_Q_FORMS: dict[type, int] = {type(None): Q_NONE, DenseQ: Q_DENSE, SparseQ: Q_SPARSE}
_FORM_NAMES = {Q_DENSE: "dense", Q_SPARSE: "sparse"}
_COLUMNS = ("steps", "committed_lengths", "num_draft_tokens", "q_forms")  # with request_ids


def block_to_pb(proposals: list[DraftProposal]) -> common_pb2.DraftBlock:
    """One columnar DraftBlock of per-request proposals (tests and the n-gram path)."""
    return DraftBlock.from_proposals(proposals).to_pb()


@dataclass(slots=True)
class DraftBlock:
    """One verify step's proposals for many requests as columns: a `specdec.v1.DraftBlock` as
    the draft builds it and the target reads it, with all draft token ids in one list and the
    q rows of each form in whole tensors.

    Entry i's draft tokens are draft_token_ids[token_starts[i] : token_starts[i + 1]]; its q is
    rows q_starts[i] .. q_starts[i] + k_i - 1 of `dense` or `sparse`, as q_forms[i] says.
    Example, k = [2, 0, 1], forms [SPARSE, NONE, SPARSE]: token_starts [0, 2, 2, 3], q_starts
    [0, 0, 2], and `sparse` has 3 rows. A malformed entry keeps its place, with its message in
    `errors`.
    """

    request_ids: list[str]
    steps: list[int]
    committed_lengths: list[int]
    num_draft_tokens: list[int]
    q_forms: list[int]
    draft_token_ids: list[int]  # [sum k_i]
    token_starts: list[int]  # [n + 1]
    q_starts: list[int]  # [n]: first row of entry i in its form's tensors
    dense: DenseQ | None  # [rows of dense entries, vocab_size]
    sparse: SparseQ | None  # [rows of sparse entries, support_size]
    errors: dict[int, str]  # entry index → "entries[i].field ..." for malformed entries

    @classmethod
    def build(
        cls,
        request_ids: list[str],
        steps: list[int],
        committed_lengths: list[int],
        num_draft_tokens: list[int],
        q_forms: list[int],
        draft_token_ids: list[int],
        dense: DenseQ | None = None,
        sparse: SparseQ | None = None,
    ) -> DraftBlock:
        """A block of these columns; ValueError if they do not fit each other."""
        _check_lengths(len(request_ids), steps, committed_lengths, num_draft_tokens, q_forms)
        _check_num_draft_tokens(num_draft_tokens)
        starts = list(accumulate(num_draft_tokens, initial=0))
        if len(draft_token_ids) != starts[-1]:
            raise ValueError(f"draft_token_ids has {len(draft_token_ids)} ids; the entries' "
                             f"num_draft_tokens sum to {starts[-1]}.")  # fmt: skip
        q_starts, rows = _q_starts(num_draft_tokens, q_forms, starts)
        for form, q in ((Q_DENSE, dense), (Q_SPARSE, sparse)):
            have, need = None if q is None else q.probs.shape[0], rows.get(form)
            if have != need:
                name = _FORM_NAMES[form]
                has = "no tensor" if have is None else f"{have} rows"
                entries = "no entries" if need is None else f"entries whose k_i sum to {need}"
                raise ValueError(
                    f"{name} q has {has}; the block has Q_FORM_{name.upper()} {entries}."
                )
        errors = _entry_errors(request_ids, steps, committed_lengths)
        return cls(request_ids, steps, committed_lengths, num_draft_tokens, q_forms,
                   draft_token_ids, starts, q_starts, dense, sparse, errors)  # fmt: skip

    @classmethod
    def from_proposals(cls, proposals: list[DraftProposal]) -> DraftBlock:
        """The proposals' columns; their q rows of each form concatenated in order."""
        qs = [p.q for p in proposals]
        forms = [_Q_FORMS[type(q)] for q in qs]
        dense = sparse = None
        if Q_DENSE in forms:
            probs = [q.probs for q in qs if type(q) is DenseQ]
            widths = {p.shape[1] for p in probs}
            if len(widths) > 1:
                raise ValueError(f"dense q rows of one block must share a width, got {widths}.")
            dense = DenseQ(torch.cat(probs))
        if Q_SPARSE in forms:
            sparse = _concat_sparse([q for q in qs if type(q) is SparseQ])
        return cls.build(
            [p.request_id for p in proposals], [p.step for p in proposals],
            [p.committed_length for p in proposals], [len(p.draft_token_ids) for p in proposals],
            forms, list(chain.from_iterable([p.draft_token_ids for p in proposals])), dense, sparse,
        )  # fmt: skip

    def to_pb(self) -> common_pb2.DraftBlock:
        ids = self.draft_token_ids
        pb = common_pb2.DraftBlock(
            request_ids=self.request_ids,
            steps=self.steps,
            committed_lengths=self.committed_lengths,
            num_draft_tokens=self.num_draft_tokens,
            q_forms=self.q_forms,  # type: ignore[arg-type]
            draft_token_ids=struct.pack(f"<{len(ids)}i", *ids),
        )
        if self.dense is not None:
            pb.dense.vocab_size = self.dense.probs.shape[1]
            pb.dense.probs = pack(self.dense.probs)
        if self.sparse is not None:
            pb.sparse.support_size = self.sparse.probs.shape[1]
            pb.sparse.token_ids = pack(self.sparse.token_ids)
            pb.sparse.probs = pack(self.sparse.probs)
        return pb

    @classmethod
    def from_pb(
        cls,
        pb: common_pb2.DraftBlock,
        *,
        max_support_size: int | None = None,
        vocab_size: int | None = None,
    ) -> DraftBlock:
        """Raises ValueError (naming the field) when the block's columns or buffers do not fit
        each other: e.g. sparse.probs must hold sum(k_i of sparse entries) x support_size
        float32s. sparse.support_size is refused above `max_support_size` and `vocab_size`
        (the reader's limits, when given) before anything is allocated."""
        steps, lengths, ks, forms = _columns(pb)
        starts = list(accumulate(ks, initial=0))
        q_starts, rows = _q_starts(ks, forms, starts)
        dense = sparse = None
        if Q_DENSE in rows:
            _check_present(pb, forms, Q_DENSE)
            check_range(pb.dense.vocab_size, "dense.vocab_size", 1, MAX_VOCAB)
            shape = (rows[Q_DENSE], pb.dense.vocab_size)
            dense = DenseQ(_unpack(pb.dense.probs, torch.float32, shape, "dense.probs"))
        if Q_SPARSE in rows:
            _check_present(pb, forms, Q_SPARSE)
            _check_support_size(pb.sparse.support_size, max_support_size, vocab_size)
            shape = (rows[Q_SPARSE], pb.sparse.support_size)
            sparse = SparseQ(
                _unpack(pb.sparse.token_ids, torch.int32, shape, "sparse.token_ids"),
                _unpack(pb.sparse.probs, torch.float32, shape, "sparse.probs"),
            )
        ids = np.frombuffer(pb.draft_token_ids, dtype=_INT32_WIRE).tolist()
        rids = pb.request_ids[:]
        errors = _entry_errors(rids, steps, lengths)
        return cls(rids, steps, lengths, ks, forms, ids, starts, q_starts, dense, sparse, errors)

    def __len__(self) -> int:
        return len(self.request_ids)

    def tokens(self, i: int) -> list[int]:
        """Entry i's draft token ids."""
        return self.draft_token_ids[self.token_starts[i] : self.token_starts[i + 1]]

    def draft_tokens(self, entries: list[int]) -> list[int]:
        """The draft token ids of `entries` (ascending), concatenated."""
        if len(entries) == len(self.request_ids):
            return self.draft_token_ids
        return list(chain.from_iterable([self.tokens(i) for i in entries]))

    def q_rows(self, form: int, entries: list[int]) -> DraftQ:
        """q of `entries` (ascending, all of q form `form`), their rows concatenated: the
        block's own tensors when `entries` are all its entries of that form."""
        q = self.dense if form == Q_DENSE else self.sparse if form == Q_SPARSE else None
        if q is None or len(entries) == self.q_forms.count(form):
            return q
        ks, starts = self.num_draft_tokens, self.q_starts
        rows = [r for i in entries for r in range(starts[i], starts[i] + ks[i])]
        index = torch.tensor(rows, dtype=torch.long)
        if isinstance(q, DenseQ):
            return DenseQ(q.probs[index])
        return SparseQ(q.token_ids[index], q.probs[index])


def _concat_sparse(sparse: list[SparseQ]) -> SparseQ:
    """The rows of all `sparse` in order, narrower supports padded to the widest."""
    probs = [q.probs for q in sparse]
    try:  # the usual case: one support size for the whole block (torch.cat checks it)
        cat = torch.cat(probs)
        return SparseQ(torch.cat([q.token_ids for q in sparse]), cat)
    except RuntimeError:
        pass
    width = max(p.shape[1] for p in probs)
    pad = torch.nn.functional.pad
    ids = [pad(q.token_ids, (0, width - q.probs.shape[1]), value=-1) for q in sparse]
    padded = [pad(p, (0, width - p.shape[1])) for p in probs]
    return SparseQ(torch.cat(ids), torch.cat(padded))


def _unpack(data: bytes, dtype: torch.dtype, shape: tuple[int, int], field: str) -> torch.Tensor:
    try:
        return unpack(data, dtype, shape, field)
    except ValueError as e:
        form = field.split(".")[0].upper()
        raise ValueError(
            f"{e} Rows: {shape[0]}, the draft tokens of the Q_FORM_{form} entries."
        ) from e


def _columns(pb: common_pb2.DraftBlock) -> tuple[list[int], list[int], list[int], list[int]]:
    """(steps, committed_lengths, num_draft_tokens, q_forms); ValueError if their lengths differ
    from request_ids' or draft_token_ids does not hold sum(num_draft_tokens) int32s."""
    # [:] copies a repeated field into a list in half the time list() takes (measured)
    steps, lengths, ks, forms = [getattr(pb, name)[:] for name in _COLUMNS]
    _check_lengths(len(pb.request_ids), steps, lengths, ks, forms)
    _check_num_draft_tokens(ks)
    total = sum(ks)
    if len(pb.draft_token_ids) != 4 * total:
        raise ValueError(
            f"draft_token_ids has {len(pb.draft_token_ids)} bytes; expected {4 * total} (the "
            f"entries' num_draft_tokens sum to {total}, little-endian int32)."
        )
    return steps, lengths, ks, forms


def _check_lengths(n: int, *columns: list[int]) -> None:
    """ValueError unless steps, committed_lengths, num_draft_tokens and q_forms have n values."""
    for name, column in zip(_COLUMNS, columns, strict=True):
        if len(column) != n:
            raise ValueError(f"{name} has {len(column)} values for {n} request_ids; "
                             "every column needs one per entry.")  # fmt: skip


def _check_num_draft_tokens(ks: list[int]) -> None:
    """ValueError for the whole block if a k_i is out of range: the entries after it could not
    be located in the block's buffers."""
    if ks and max(ks) > MAX_WIRE_NUM_DRAFT_TOKENS:
        i = next(i for i, k in enumerate(ks) if k > MAX_WIRE_NUM_DRAFT_TOKENS)
        check_range(ks[i], f"entries[{i}].num_draft_tokens", 0, MAX_WIRE_NUM_DRAFT_TOKENS)


def _check_support_size(size: int, max_support_size: int | None, vocab_size: int | None) -> None:
    """ValueError unless 1 <= size <= every given limit: a huge claimed support would make the
    sampler allocate rows x size entries even when the block holds no sparse rows."""
    limit, why = MAX_VOCAB, "the largest vocabulary the sampler takes"
    if vocab_size is not None and vocab_size < limit:
        limit, why = vocab_size, "the vocabulary"
    if max_support_size is not None and max_support_size < limit:
        limit, why = max_support_size, "this service's max_support_size"
    if not 1 <= size <= limit:
        raise ValueError(f"sparse.support_size must be in [1, {limit}] ({why}), got {size}.")


def _q_starts(
    ks: list[int], forms: list[int], starts: list[int]
) -> tuple[list[int], dict[int, int]]:
    """(first q row of each entry in its form's tensors, rows per q form present)."""
    if len(set(forms)) == 1 and forms[0] in _FORMS:  # the usual case: one q form in the block
        return starts, {forms[0]: starts[-1]}
    q_starts: list[int] = []
    rows: dict[int, int] = {}
    for i, (k, form) in enumerate(zip(ks, forms, strict=True)):
        if form not in _FORMS:
            raise ValueError(f"entries[{i}].q_form is {form}; "
                             "expected Q_FORM_NONE, Q_FORM_DENSE or Q_FORM_SPARSE.")  # fmt: skip
        q_starts.append(rows.get(form, 0))
        rows[form] = q_starts[-1] + k
    return q_starts, rows


def _check_present(pb: common_pb2.DraftBlock, forms: list[int], form: int) -> None:
    name = _FORM_NAMES[form]
    if not pb.HasField(name):  # type: ignore[arg-type]
        i = forms.index(form)
        raise ValueError(f"entries[{i}].q_form is {name.upper()} but the block has no {name}.")


def _entry_errors(
    request_ids: list[str], steps: list[int], committed_lengths: list[int]
) -> dict[int, str]:
    """Messages of the malformed entries, by index (the checks `DraftProposal` makes). The
    usual block has none, so each column is scanned only when its extremes are out of range."""
    errors: dict[int, str] = {}
    for name, column, low, high in (("step", steps, 0, MAX_STEP),
                                    ("committed_length", committed_lengths, 1,
                                     MAX_COMMITTED_LENGTH)):  # fmt: skip
        if column and (min(column) < low or max(column) > high):
            for i, value in enumerate(column):
                if not low <= value <= high:
                    errors[i] = (f"entries[{i}].{name} must be >= {low} and <= {high}, "
                                 f"got {value}.")  # fmt: skip
    if "" in request_ids:
        for i, rid in enumerate(request_ids):
            if not rid:
                errors[i] = f"entries[{i}].request_id must be a non-empty string."
    return errors
