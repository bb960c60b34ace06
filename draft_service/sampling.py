"""The draft's sampling head: one pure tensor function, no host syncs, fixed output shapes (so
a draft step can run inside a CUDA graph).

Processing is the target's own rule (`specdec.sampling`): temperature, then top-k, then top-p
over the top-k survivors renormalised, as a per-row logit threshold (ties at the boundary kept),
so the draft keeps exactly the tokens the target would. The draft then samples from q and
returns q itself, bit for bit (docs/design.md, "Sending q cheaply"):

- dense: q is the processed distribution over the whole vocabulary, float32 [B, V];
- sparse: q is the processed distribution restricted to its `support_size` most likely tokens
  and renormalised (softmax over the kept logits), float32 [B, K'] with int32 ids, K' =
  min(support_size, V); rows whose support is smaller pad with id -1 and probability 0.

The token is drawn by an exponential race, argmax_x q(x) / E_x, with E_x ~ Exp(1) from
`specdec.rng` keyed by (seed, absolute position of the drafted token, Stream.DRAFT, x): the
same noise for the same token id whatever the q form, batch or slot. Greedy rows
(temperature 0) take the first argmax of the logits; their q is not meant to be sent.

Saguaro sampling (SSD, arXiv 2603.03251), for draft-ahead at temperature > 0: with
`top_scale` C < 1 the row samples from q' = q with its `top_count` most likely tokens'
probabilities multiplied by C and renormalised, and returns q', so after a rejection the
target's residual max(0, p - q') / Z falls mostly on those tokens, the ones draft-ahead guesses
(`drafting.with_guesses` takes the same count). Exact for any C: the q returned, and so sent, is
the one sampled from. Example: q = (0.6, 0.3, 0.1), top_count 1, C = 0.5 gives
q' = (0.3, 0.3, 0.1) / 0.7 = (0.43, 0.43, 0.14); if the target's p is q, the residual after a
rejection is all on token 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.rng import Stream, exponential, ids_bits, vocab_exponential
from specdec.sampling import sorted_thresholds

PAD_ID = -1


@dataclass(frozen=True, slots=True)
class DraftSample:
    """Draft tokens and the q they were sampled from."""

    token_ids: torch.Tensor  # [B] int32
    probs: torch.Tensor  # [B, K'] float32 (sparse) or [B, V] float32 (dense)
    support_ids: torch.Tensor | None  # [B, K'] int32, PAD_ID padded; None when dense
    greedy: torch.Tensor  # [B] bool; q of these rows is not meaningful


def sample_draft(
    logits: torch.Tensor,  # [B, V] float32
    temperature: torch.Tensor,  # [B] float32; 0 = greedy
    top_k: torch.Tensor,  # [B] int32; 0 = off
    top_p: torch.Tensor,  # [B] float32; 1 = off
    seed: torch.Tensor,  # [B] int64
    position: torch.Tensor,  # [B] int64; absolute position of the token being drafted
    support_size: int | None,  # K for sparse q; None for dense q
    top_scale: float = 1.0,  # Saguaro's C in (0, 1]: 1 = off
    top_count: int = 0,  # how many of each row's most likely tokens C scales
) -> DraftSample:
    """Samples one draft token per row and returns the exact q it was sampled from."""
    if support_size is not None and support_size < 1:
        raise ValueError(f"support_size must be >= 1 (or None for dense), got {support_size}.")
    if not 0.0 < top_scale <= 1.0 or top_count < 0:
        raise ValueError(
            f"top_scale must be in (0, 1] and top_count >= 0, got {top_scale} and {top_count}."
        )
    saguaro = top_scale < 1.0 and top_count > 0
    logits = logits.float()
    greedy = temperature == 0
    inv_t = torch.where(greedy, 1.0, 1.0 / temperature.clamp(min=1e-30))
    # One sort of every row (no host sync to pick rows): it gives the threshold and the
    # sparse support; stable, so ties at the support's edge go to the lower id.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    threshold = sorted_thresholds(sorted_logits, inv_t, top_k, top_p)  # [B]
    argmax = logits.argmax(dim=-1)
    if support_size is None:
        kept = logits >= threshold[:, None]
        scaled = logits * inv_t[:, None]
        if saguaro:  # log C added to the top tokens' logits: softmax renormalises
            top = order[:, : min(top_count, logits.shape[1])]
            scaled = scaled.scatter_add(1, top, _log_scale(greedy, top_scale, top.shape[1]))
        probs = torch.softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)
        noise = vocab_exponential(seed, position, Stream.DRAFT, logits.shape[1])
        sampled = (probs / noise).argmax(dim=-1)
        token_ids = torch.where(greedy, argmax, sampled).to(torch.int32)
        return DraftSample(token_ids, probs, None, greedy)
    width = min(support_size, logits.shape[1])
    top = sorted_logits[:, :width]
    keep = top >= threshold[:, None]
    scaled = top * inv_t[:, None]
    if saguaro:  # the support is sorted: its first columns are the most likely tokens
        count = min(top_count, width)
        scaled = torch.cat(
            [scaled[:, :count] + _log_scale(greedy, top_scale, count), scaled[:, count:]], dim=1
        )
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    ids = order[:, :width]
    stream = torch.full_like(position, int(Stream.DRAFT))
    noise = exponential(ids_bits(seed, position, stream, ids))
    choice = (probs / noise).argmax(dim=-1, keepdim=True)
    sampled = ids.gather(1, choice).squeeze(1)
    token_ids = torch.where(greedy, argmax, sampled).to(torch.int32)
    support_ids = torch.where(keep, ids, PAD_ID).to(torch.int32)
    return DraftSample(token_ids, probs, support_ids, greedy)


def _log_scale(greedy: torch.Tensor, scale: float, count: int) -> torch.Tensor:
    """[B, count] float32: log(scale) for sampled rows, 0 for greedy ones (left untouched)."""
    row = torch.where(greedy, 0.0, math.log(scale)).to(torch.float32)
    return row[:, None].expand(-1, count)
