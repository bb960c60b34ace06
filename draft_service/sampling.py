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
"""

from __future__ import annotations

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
) -> DraftSample:
    """Samples one draft token per row and returns the exact q it was sampled from."""
    if support_size is not None and support_size < 1:
        raise ValueError(f"support_size must be >= 1 (or None for dense), got {support_size}.")
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
        probs = torch.softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)
        noise = vocab_exponential(seed, position, Stream.DRAFT, logits.shape[1])
        sampled = (probs / noise).argmax(dim=-1)
        token_ids = torch.where(greedy, argmax, sampled).to(torch.int32)
        return DraftSample(token_ids, probs, None, greedy)
    width = min(support_size, logits.shape[1])
    top = sorted_logits[:, :width]
    keep = top >= threshold[:, None]
    probs = torch.softmax((top * inv_t[:, None]).masked_fill(~keep, float("-inf")), dim=-1)
    ids = order[:, :width]
    stream = torch.full_like(position, int(Stream.DRAFT))
    noise = exponential(ids_bits(seed, position, stream, ids))
    choice = (probs / noise).argmax(dim=-1, keepdim=True)
    sampled = ids.gather(1, choice).squeeze(1)
    token_ids = torch.where(greedy, argmax, sampled).to(torch.int32)
    support_ids = torch.where(keep, ids, PAD_ID).to(torch.int32)
    return DraftSample(token_ids, probs, support_ids, greedy)
