"""The rejection sampler's public entry point: validates a ragged batch, prepares it, and runs
the Triton kernels (or their pure-torch reference) from `target_service.kernels`.

A ragged batch of B requests: request b has k_b >= 0 draft tokens and k_b + 1 consecutive rows
of target logits (the scores after each draft prefix; the last row scores the bonus position).
Example, k = [2, 0, 1]: logits rows [a0, a1, a2, b0, c0, c1], draft tokens [a0', a1', c0'].

The caller may pass what it knows on the host (`HostShape`): then preparing the batch reads
nothing back from the device, and a verify step synchronises once, when it reads its results
(`SamplerOutput.to_host`). Without it the same facts are read from the tensors.

Structural mistakes by the caller (shapes, dtypes, lengths) raise ValueError for the whole
call. Bad values inside one request (NaN logits, an invalid q, a token outside the vocabulary or
outside q's support) give that request a non-OK status and placeholder tokens; every other
request still gets its exact result.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal

import numpy as np
import torch

from specdec.limits import MAX_POSITION
from specdec.limits import MAX_VOCAB as MAX_VOCAB
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DenseQ, SparseQ
from target_service import kernels
from target_service.batch_layout import BatchLayout, batch_layout, upload
from target_service.kernels import PLACEHOLDER, KernelInputs, KernelOutputs
from target_service.logits_processing import logit_thresholds
from target_service.synthetic import SyntheticAcceptance

__all__ = [
    "PLACEHOLDER",
    "DenseQ",
    "HostOutput",
    "HostShape",
    "RequestSampling",
    "SampleStatus",
    "SamplerOutput",
    "SparseQ",
    "SyntheticAcceptance",
    "rejection_sample",
    "status_message",
]

log = logging.getLogger(__name__)


class SampleStatus(IntEnum):
    OK = kernels.OK
    NONFINITE_LOGITS = kernels.NONFINITE_LOGITS
    INVALID_DRAFT_PROBS = kernels.INVALID_DRAFT_PROBS
    DRAFT_PROBS_NOT_NORMALIZED = kernels.DRAFT_PROBS_NOT_NORMALIZED
    DRAFT_TOKEN_OUT_OF_SUPPORT = kernels.DRAFT_TOKEN_OUT_OF_SUPPORT
    TOKEN_OUT_OF_VOCAB = kernels.TOKEN_OUT_OF_VOCAB


_MESSAGES = {
    SampleStatus.OK: "ok",
    SampleStatus.NONFINITE_LOGITS: "target logits contain NaN or inf for this request.",
    SampleStatus.INVALID_DRAFT_PROBS: (
        "draft_probs contain NaN, inf, a negative value, a duplicate id or an id outside the "
        "vocabulary."
    ),
    SampleStatus.DRAFT_PROBS_NOT_NORMALIZED: (
        f"draft_probs rows must sum to 1 within {kernels.Q_SUM_TOLERANCE}."
    ),
    SampleStatus.DRAFT_TOKEN_OUT_OF_SUPPORT: (
        "a draft token has probability 0 under the draft_probs it was claimed to be sampled from."
    ),
    SampleStatus.TOKEN_OUT_OF_VOCAB: "a draft token id is outside [0, vocab_size).",
}


def status_message(code: int) -> str:
    """A whole sentence for a SampleStatus code."""
    return _MESSAGES[SampleStatus(code)]


# q as the draft sent it: the block's own types, one for the wire and the sampler
DraftProbs = DenseQ | SparseQ | None


@dataclass(frozen=True, slots=True)
class RequestSampling:
    """Per-request sampling tensors [B]; position = absolute position of the first draft.

    `truncated` is host knowledge: per request, whether top-k or top-p applies (temperature >
    0), so that only those rows are sorted without asking the device which; `from_params` fills
    it, None means "read it from the tensors" (a device→host sync).
    """

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int32
    top_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    position: torch.Tensor  # [B] int64
    truncated: tuple[bool, ...] | None = None

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], positions: Sequence[int], device: torch.device | str
    ) -> RequestSampling:
        """The tensors on `device`, moved in one copy that does not synchronise."""
        if len(params) != len(positions):
            raise ValueError(
                f"positions must have one entry per request ({len(params)}), got {len(positions)}."
            )
        for i, pos in enumerate(positions):
            if not 0 <= pos <= MAX_POSITION:
                raise ValueError(f"positions[{i}] must be in [0, {MAX_POSITION}], got {pos}.")
        seed, position, temperature, top_k, top_p = upload(
            [
                np.array([p.seed for p in params], dtype=np.int64),
                np.array(positions, dtype=np.int64),
                np.array([p.temperature for p in params], dtype=np.float32),
                np.array([p.top_k for p in params], dtype=np.int32),
                np.array([p.top_p for p in params], dtype=np.float32),
            ],
            torch.device(device),
        )
        truncated = tuple(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params)
        return cls(temperature, top_k, top_p, seed, position, truncated)

    def read_truncated(self) -> tuple[bool, ...]:
        """`truncated`, read from the tensors when it is not known (synchronises)."""
        if self.truncated is not None:
            return self.truncated
        on = ((self.top_k > 0) | (self.top_p < 1.0)) & (self.temperature != 0)
        return tuple(on.tolist())


@dataclass(frozen=True, slots=True)
class HostShape:
    """What the caller knows on the host about a batch: k_b per request and the largest
    sampling.position. Given to `rejection_sample`, it replaces every read of those tensors,
    so it must describe them; only its shapes are checked against them."""

    num_draft_tokens: tuple[int, ...]
    max_position: int

    def __post_init__(self) -> None:
        ks = self.num_draft_tokens
        if not ks:
            raise ValueError("the batch must hold at least one request.")
        if min(ks) < 0:
            raise ValueError("num_draft_tokens must be >= 0 for every request.")
        if not 0 <= self.max_position <= MAX_POSITION:
            raise ValueError(
                f"max_position must be in [0, {MAX_POSITION}], got {self.max_position}."
            )
        if self.max_position + max(ks) + 1 > MAX_POSITION:
            raise ValueError(f"position + num_draft_tokens must stay below {MAX_POSITION}.")

    @classmethod
    def read(cls, num_draft_tokens: torch.Tensor, sampling: RequestSampling) -> HostShape:
        """The same facts read from the tensors (synchronises with the device)."""
        return cls(tuple(num_draft_tokens.tolist()), int(sampling.position.max()))

    @property
    def total(self) -> int:
        return sum(self.num_draft_tokens)

    @property
    def max_k(self) -> int:
        return max(self.num_draft_tokens)


@dataclass(frozen=True, slots=True)
class HostOutput:
    """A `SamplerOutput` as plain Python lists (one row per request)."""

    status: list[int]
    num_committed: list[int]
    token_ids: list[list[int]]  # [B][max_k + 1]: the committed tokens first, then -1
    accepted: list[list[bool]]  # [B][max_k]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B, max_k + 1] int32: accepted drafts, then one token; -1 padded
    num_committed: torch.Tensor  # [B] int32, 0 where status != OK
    accepted: torch.Tensor  # [B, max_k] bool: draft position j accepted
    status: torch.Tensor  # [B] int32 SampleStatus

    def committed(self, b: int) -> list[int]:
        """The tokens request b commits (empty on error)."""
        return self.token_ids[b, : int(self.num_committed[b])].tolist()

    def to_host(self) -> HostOutput:
        """Everything on the host with one device→host copy (the verify step's one sync)."""
        batch, cols = self.token_ids.shape
        parts = (self.status, self.num_committed, self.token_ids, self.accepted)
        flat = torch.cat([t.reshape(-1).to(torch.int32) for t in parts]).cpu().tolist()
        ids = flat[2 * batch : 2 * batch + batch * cols]
        acc = flat[2 * batch + batch * cols :]
        max_k = cols - 1
        return HostOutput(
            flat[:batch],
            flat[batch : 2 * batch],
            [ids[b * cols : (b + 1) * cols] for b in range(batch)],
            [[bool(a) for a in acc[b * max_k : (b + 1) * max_k]] for b in range(batch)],
        )


def rejection_sample(
    num_draft_tokens: torch.Tensor,  # [B] int32, k_b >= 0
    draft_token_ids: torch.Tensor,  # [T] int32, T = sum k_b
    target_logits: torch.Tensor,  # [T + B, >= vocab_size] float32 | bf16 | fp16
    draft_probs: DraftProbs,
    sampling: RequestSampling,
    *,
    synthetic: SyntheticAcceptance | None = None,
    synthetic_keys: Sequence[str] | None = None,
    vocab_size: int | None = None,
    impl: Literal["auto", "triton", "torch"] = "auto",
    host: HostShape | None = None,
) -> SamplerOutput:
    """Decide what each request commits. `vocab_size` (default: the logits' width) is the
    number of real token ids; wider logits columns are padding and get probability 0.
    `synthetic_keys` (the request ids) give each request its own synthetic acceptance where
    `synthetic` has a length_spread.
    impl "auto" runs the Triton kernels on CUDA or under TRITON_INTERPRET=1, else the reference.
    With `host` (and `sampling` from `RequestSampling.from_params`) the Triton path reads
    nothing back from the device.
    """
    inputs = prepare(
        num_draft_tokens, draft_token_ids, target_logits, draft_probs, sampling,
        synthetic=synthetic, synthetic_keys=synthetic_keys, vocab_size=vocab_size, host=host,
    )  # fmt: skip
    if impl == "auto":
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        impl = "triton" if target_logits.is_cuda or interpret else "torch"
    run = kernels.rejection_sample_triton if impl == "triton" else kernels.rejection_sample_torch
    out: KernelOutputs = run(inputs)
    return SamplerOutput(out.token_ids, out.num_committed, out.accepted, out.status)


def prepare(
    num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    draft_probs: DraftProbs,
    sampling: RequestSampling,
    *,
    synthetic: SyntheticAcceptance | None = None,
    synthetic_keys: Sequence[str] | None = None,
    vocab_size: int | None = None,
    host: HostShape | None = None,
) -> KernelInputs:
    """Validate the batch's structure and build the kernels' inputs."""
    device = target_logits.device
    host = _check_structure(num_draft_tokens, draft_token_ids, target_logits, sampling, host)
    vocab = target_logits.shape[1] if vocab_size is None else vocab_size
    if not 1 <= vocab <= min(target_logits.shape[1], MAX_VOCAB):
        raise ValueError(
            f"vocab_size must be in [1, {min(target_logits.shape[1], MAX_VOCAB)}] "
            f"(the logits' width), got {vocab}."
        )
    if synthetic is not None and host.max_k > synthetic.num_draft_tokens:
        raise ValueError(
            f"synthetic acceptance is configured for {synthetic.num_draft_tokens} draft "
            f"tokens but a request has {host.max_k}."
        )
    rates = None
    if synthetic is not None:  # [B, max_k]: each request's conditional rates
        batch = len(host.num_draft_tokens)
        if synthetic_keys is not None and len(synthetic_keys) != batch:
            raise ValueError(
                f"synthetic_keys must have one entry per request ({batch}), got "
                f"{len(synthetic_keys)}."
            )
        width = max(host.max_k, 1)
        rates = np.broadcast_to(synthetic.conditional_rates_for(synthetic_keys, width),
                                (batch, width))  # fmt: skip
    layout = batch_layout(host.num_draft_tokens, sampling.read_truncated(), rates, device)
    thresholds, inv_t, greedy = _thresholds(target_logits[:, :vocab], sampling, layout)
    status = torch.zeros(len(host.num_draft_tokens), dtype=torch.int32, device=device)
    q_mode, q_probs, q_ids = _prepare_q(draft_probs, host.total, vocab, layout.token_req, status)
    return KernelInputs(
        logits=target_logits, thresholds=thresholds, row_req=layout.row_req,
        row_draft=layout.row_draft, num_draft=layout.num_draft, row_start=layout.row_start,
        draft_start=layout.draft_start, draft_ids=draft_token_ids.to(torch.int32),
        inv_temperature=inv_t, greedy=greedy.to(torch.int32), seed=sampling.seed.long(),
        position=sampling.position.long(), status_in=status, q_mode=q_mode, q_probs=q_probs,
        q_ids=q_ids, synthetic_rates=layout.rates, vocab_size=vocab, max_k=host.max_k,
    )  # fmt: skip


def _thresholds(
    logits: torch.Tensor,  # [R, vocab]
    sampling: RequestSampling,
    layout: BatchLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-row top-k/top-p thresholds [R], 1/temperature [B], greedy [B] bool)."""
    greedy = sampling.temperature == 0
    inv_t = torch.where(greedy, 1.0, 1.0 / sampling.temperature.clamp(min=1e-30)).float()
    row_req = layout.row_req
    top_k = torch.where(greedy, 0, sampling.top_k).index_select(0, row_req)
    top_p = torch.where(greedy, 1.0, sampling.top_p).index_select(0, row_req)
    thresholds = logit_thresholds(
        logits, inv_t.index_select(0, row_req), top_k, top_p, rows=layout.sorted_rows
    )
    return thresholds, inv_t, greedy


def _check_structure(
    num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    sampling: RequestSampling,
    host: HostShape | None,
) -> HostShape:
    """Shape/dtype checks that concern the whole call; returns `host`, read from the tensors
    when it is not given."""
    if num_draft_tokens.dim() != 1 or num_draft_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError("num_draft_tokens must be a 1-D int32 or int64 tensor.")
    if num_draft_tokens.shape[0] == 0:
        raise ValueError("the batch must hold at least one request.")
    for name in ("temperature", "top_k", "top_p", "seed", "position"):
        if getattr(sampling, name).shape != num_draft_tokens.shape:
            raise ValueError(
                f"sampling.{name} must have shape [{num_draft_tokens.shape[0]}] (one per request)."
            )
    if host is None:
        host = HostShape.read(num_draft_tokens, sampling)
    batch, total = len(host.num_draft_tokens), host.total
    if num_draft_tokens.shape[0] != batch:
        raise ValueError(
            f"host describes {batch} requests but num_draft_tokens has {num_draft_tokens.shape[0]}."
        )
    if sampling.truncated is not None and len(sampling.truncated) != batch:
        raise ValueError(f"sampling.truncated must have {batch} flags (one per request).")
    if draft_token_ids.shape != (total,) or draft_token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"draft_token_ids must be an int tensor of shape [{total}] (sum of "
            f"num_draft_tokens), got {tuple(draft_token_ids.shape)} {draft_token_ids.dtype}."
        )
    if target_logits.dim() != 2 or target_logits.shape[0] != total + batch:
        raise ValueError(
            f"target_logits must have shape [{total + batch}, vocab] (k_b + 1 rows per "
            f"request), got {tuple(target_logits.shape)}."
        )
    if target_logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"target_logits must be float32, bf16 or fp16, got {target_logits.dtype}.")
    if target_logits.stride(1) != 1:
        raise ValueError("target_logits rows must be contiguous.")
    return host


def _prepare_q(
    draft_probs: DraftProbs,
    total: int,
    vocab: int,
    token_req: torch.Tensor,  # [T] int32: owning request of each draft token
    status: torch.Tensor,  # [B] int32, updated in place
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """(q_mode, probs, ids); sparse supports are checked here (per request, into `status`)
    and sorted by id with padding last, as the kernels expect."""
    if draft_probs is None:
        return kernels.Q_NONE, None, None
    if isinstance(draft_probs, DenseQ):
        q = draft_probs.probs
        if q.dim() != 2 or q.shape[0] != total or q.shape[1] < 1 or q.dtype != torch.float32:
            raise ValueError(
                f"draft_probs.probs must be float32 [{total}, vocab] with vocab >= 1, got "
                f"{tuple(q.shape)} {q.dtype}."
            )
        return kernels.Q_DENSE, q.contiguous(), None
    ids, probs = draft_probs.token_ids, draft_probs.probs
    if ids.dim() != 2 or ids.shape[0] != total or probs.shape != ids.shape:
        raise ValueError(
            f"sparse draft_probs token_ids and probs must both have shape [{total}, S], got "
            f"{tuple(ids.shape)} and {tuple(probs.shape)}."
        )
    if probs.dtype != torch.float32 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("sparse draft_probs must be int32 token_ids and float32 probs.")
    ids = ids.long()
    pad = ids == -1
    sorted_ids, order = torch.where(pad, kernels.SPARSE_PAD_ID, ids).sort(dim=1)
    sorted_probs = probs.gather(1, order)
    duplicate = (sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (
        sorted_ids[:, 1:] != kernels.SPARSE_PAD_ID
    )
    invalid = (
        ~torch.isfinite(probs)
        | (probs < 0)
        | (pad & (probs != 0))
        | (~pad & ((ids < 0) | (ids >= vocab)))
    ).any(dim=1) | duplicate.any(dim=1)
    unnormalized = (probs.sum(dim=1) - 1.0).abs() > kernels.Q_SUM_TOLERANCE
    for code, flags in ((SampleStatus.INVALID_DRAFT_PROBS, invalid),
                        (SampleStatus.DRAFT_PROBS_NOT_NORMALIZED, unnormalized)):  # fmt: skip
        hit = torch.zeros_like(status).index_add_(0, token_req, flags.to(torch.int32)) > 0
        status.copy_(torch.where((status == 0) & hit, int(code), status))
    return kernels.Q_SPARSE, sorted_probs.contiguous(), sorted_ids.to(torch.int32).contiguous()
