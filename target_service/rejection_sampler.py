"""The rejection sampler's public entry point: validates a ragged batch, prepares it, and runs
the Triton kernels (or their pure-torch reference) from `target_service.kernels`.

A ragged batch of B requests: request b has k_b >= 0 draft tokens and k_b + 1 consecutive rows
of target logits (the scores after each draft prefix; the last row scores the bonus position).
Example, k = [2, 0, 1]: logits rows [a0, a1, a2, b0, c0, c1], draft tokens [a0', a1', c0'].

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

import torch

from specdec.rng import MAX_POSITION
from specdec.sampling_params import SamplingParams
from target_service import kernels
from target_service.kernels import PLACEHOLDER, KernelInputs, KernelOutputs
from target_service.logits_processing import logit_thresholds
from target_service.synthetic import SyntheticAcceptance

__all__ = [
    "PLACEHOLDER",
    "DenseProbs",
    "RequestSampling",
    "SampleStatus",
    "SamplerOutput",
    "SparseProbs",
    "SyntheticAcceptance",
    "rejection_sample",
    "status_message",
]

log = logging.getLogger(__name__)
MAX_VOCAB = 2**24  # token ids travel through float32 race buffers: exact below 2**24


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


@dataclass(frozen=True, slots=True)
class DenseProbs:
    probs: torch.Tensor  # [T, Vq] float32: the full distribution each draft token came from


@dataclass(frozen=True, slots=True)
class SparseProbs:
    """The exact truncated support each draft token was sampled from; pad with id -1, prob 0."""

    token_ids: torch.Tensor  # [T, S] int32
    probs: torch.Tensor  # [T, S] float32


DraftProbs = DenseProbs | SparseProbs | None


@dataclass(frozen=True, slots=True)
class RequestSampling:
    """Per-request sampling tensors [B]; position = absolute position of the first draft."""

    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int32
    top_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    position: torch.Tensor  # [B] int64

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], positions: Sequence[int], device: torch.device | str
    ) -> RequestSampling:
        if len(params) != len(positions):
            raise ValueError(
                f"positions must have one entry per request ({len(params)}), got {len(positions)}."
            )
        for i, pos in enumerate(positions):
            if not 0 <= pos <= MAX_POSITION:
                raise ValueError(f"positions[{i}] must be in [0, {MAX_POSITION}], got {pos}.")

        def t(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=t([p.temperature for p in params], torch.float32),
            top_k=t([p.top_k for p in params], torch.int32),
            top_p=t([p.top_p for p in params], torch.float32),
            seed=t([p.seed for p in params], torch.int64),
            position=t(list(positions), torch.int64),
        )


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B, max_k + 1] int32: accepted drafts, then one token; -1 padded
    num_committed: torch.Tensor  # [B] int32, 0 where status != OK
    accepted: torch.Tensor  # [B, max_k] bool: draft position j accepted
    status: torch.Tensor  # [B] int32 SampleStatus

    def committed(self, b: int) -> list[int]:
        """The tokens request b commits (empty on error)."""
        return self.token_ids[b, : int(self.num_committed[b])].tolist()


def rejection_sample(
    num_draft_tokens: torch.Tensor,  # [B] int32, k_b >= 0
    draft_token_ids: torch.Tensor,  # [T] int32, T = sum k_b
    target_logits: torch.Tensor,  # [T + B, >= vocab_size] float32 | bf16 | fp16
    draft_probs: DraftProbs,
    sampling: RequestSampling,
    *,
    synthetic: SyntheticAcceptance | None = None,
    vocab_size: int | None = None,
    impl: Literal["auto", "triton", "torch"] = "auto",
) -> SamplerOutput:
    """Decide what each request commits. `vocab_size` (default: the logits' width) is the
    number of real token ids; wider logits columns are padding and get probability 0.
    impl "auto" runs the Triton kernels on CUDA or under TRITON_INTERPRET=1, else the reference.
    """
    inputs = prepare(
        num_draft_tokens, draft_token_ids, target_logits, draft_probs, sampling,
        synthetic=synthetic, vocab_size=vocab_size,
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
    vocab_size: int | None = None,
) -> KernelInputs:
    """Validate the batch's structure and build the kernels' inputs."""
    device = target_logits.device
    k = _check_structure(num_draft_tokens, draft_token_ids, target_logits, sampling)
    vocab = target_logits.shape[1] if vocab_size is None else vocab_size
    if not 1 <= vocab <= min(target_logits.shape[1], MAX_VOCAB):
        raise ValueError(
            f"vocab_size must be in [1, {min(target_logits.shape[1], MAX_VOCAB)}] "
            f"(the logits' width), got {vocab}."
        )
    batch, total = k.shape[0], int(k.sum())
    max_k = int(k.max())  # batch >= 1: _check_structure refuses an empty batch
    if int(sampling.position.max()) + max_k + 1 > MAX_POSITION:
        raise ValueError(f"position + num_draft_tokens must stay below {MAX_POSITION}.")
    rows = k + 1
    row_start = torch.cumsum(rows, 0) - rows
    draft_start = torch.cumsum(k, 0) - k
    row_req = torch.repeat_interleave(torch.arange(batch, device=device), rows)
    row_j = torch.arange(total + batch, device=device) - row_start[row_req]
    row_draft = torch.where(row_j < k[row_req], draft_start[row_req] + row_j, -1)
    greedy = sampling.temperature == 0
    inv_t = torch.where(greedy, 1.0, 1.0 / sampling.temperature.clamp(min=1e-30)).float()
    top_k = torch.where(greedy, 0, sampling.top_k)[row_req]
    top_p = torch.where(greedy, 1.0, sampling.top_p)[row_req]
    thresholds = logit_thresholds(target_logits[:, :vocab], inv_t[row_req], top_k, top_p)
    status = torch.zeros(batch, dtype=torch.int32, device=device)
    q_mode, q_probs, q_ids = _prepare_q(draft_probs, total, vocab, k, status)
    rates = None
    if synthetic is not None:
        if max_k > synthetic.num_draft_tokens:
            raise ValueError(
                f"synthetic acceptance is configured for {synthetic.num_draft_tokens} draft "
                f"tokens but a request has {max_k}."
            )
        rates = torch.tensor(synthetic.conditional_rates(), dtype=torch.float32, device=device)
    i32 = torch.int32
    return KernelInputs(
        logits=target_logits, thresholds=thresholds, row_req=row_req.to(i32),
        row_draft=row_draft.to(i32), num_draft=k.to(i32), row_start=row_start.to(i32),
        draft_start=draft_start.to(i32), draft_ids=draft_token_ids.to(i32),
        inv_temperature=inv_t, greedy=greedy.to(i32), seed=sampling.seed.long(),
        position=sampling.position.long(), status_in=status, q_mode=q_mode, q_probs=q_probs,
        q_ids=q_ids, synthetic_rates=rates, vocab_size=vocab, max_k=max_k,
    )  # fmt: skip


def _check_structure(
    num_draft_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    sampling: RequestSampling,
) -> torch.Tensor:
    """Shape/dtype checks that concern the whole call; returns k as int64 [B]."""
    if num_draft_tokens.dim() != 1 or num_draft_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError("num_draft_tokens must be a 1-D int32 or int64 tensor.")
    k = num_draft_tokens.long()
    if bool((k < 0).any()):
        raise ValueError("num_draft_tokens must be >= 0 for every request.")
    batch, total = k.shape[0], int(k.sum())
    if batch == 0:
        raise ValueError("the batch must hold at least one request.")
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
    for name in ("temperature", "top_k", "top_p", "seed", "position"):
        if getattr(sampling, name).shape != (batch,):
            raise ValueError(f"sampling.{name} must have shape [{batch}] (one per request).")
    return k


def _prepare_q(
    draft_probs: DraftProbs,
    total: int,
    vocab: int,
    k: torch.Tensor,
    status: torch.Tensor,
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """(q_mode, probs, ids); sparse supports are checked here (per request, into `status`)
    and sorted by id with padding last, as the kernels expect."""
    if draft_probs is None:
        return kernels.Q_NONE, None, None
    if isinstance(draft_probs, DenseProbs):
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
    owner = torch.repeat_interleave(torch.arange(k.shape[0], device=k.device), k)
    for code, flags in ((SampleStatus.INVALID_DRAFT_PROBS, invalid),
                        (SampleStatus.DRAFT_PROBS_NOT_NORMALIZED, unnormalized)):  # fmt: skip
        hit = torch.zeros_like(k).index_add_(0, owner, flags.long()) > 0
        status.copy_(torch.where((status == 0) & hit, int(code), status))
    return kernels.Q_SPARSE, sorted_probs.contiguous(), sorted_ids.to(torch.int32).contiguous()
