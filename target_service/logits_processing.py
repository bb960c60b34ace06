"""Top-k / top-p as per-row logit thresholds, and the exact target distribution for tests.

The sampler keeps token j of a row iff logit_j >= threshold (ties at the boundary are kept, as
in vLLM), so the kernels read the raw logits once and mask on the fly. Order of processing:
temperature, then top-k, then top-p over the top-k survivors renormalised. Sorting happens only
for the rows of requests that ask for top-k or top-p.
"""

from __future__ import annotations

import torch


def logit_thresholds(
    logits: torch.Tensor,  # [R, V] float32 | bf16
    inv_temperature: torch.Tensor,  # [R] float32; 1/T (1 for greedy rows)
    top_k: torch.Tensor,  # [R] int32; 0 = off
    top_p: torch.Tensor,  # [R] float32; 1 = off
    *,
    rows: torch.Tensor | None = None,  # [r] int32 | int64: the rows with top-k or top-p
) -> torch.Tensor:
    """Per-row threshold [R] float32: -inf where a row keeps every token.

    `rows` (from the caller's host-side knowledge) saves finding them on the device, which
    reads a count back (a sync); rows it names that need no threshold still get -inf.
    """
    thresholds = torch.full((logits.shape[0],), float("-inf"), device=logits.device)
    if rows is None:
        rows = ((top_k > 0) | (top_p < 1.0)).nonzero().flatten()
    if rows.numel() == 0:
        return thresholds
    rows = rows.long()
    top_k, top_p = top_k.index_select(0, rows), top_p.index_select(0, rows)
    sorted_logits = logits.index_select(0, rows).float().sort(dim=-1, descending=True).values
    vocab = sorted_logits.shape[1]  # sorted_logits: [r, V]
    k = top_k.long()
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    positions = torch.arange(vocab, device=logits.device)
    in_top_k = positions[None, :] < k[:, None]
    scaled = torch.where(
        in_top_k, sorted_logits * inv_temperature.index_select(0, rows)[:, None], float("-inf")
    )
    probs = torch.softmax(scaled, dim=-1)
    # Smallest prefix whose mass reaches top_p: count the entries strictly before it.
    mass_before = probs.cumsum(dim=-1) - probs
    keep = in_top_k & (mass_before < top_p[:, None])
    last_kept = keep.sum(dim=-1).clamp(min=1) - 1
    found = sorted_logits.gather(1, last_kept[:, None]).squeeze(1)
    found = torch.where((top_k > 0) | (top_p < 1.0), found, float("-inf"))
    return thresholds.scatter_(0, rows, found)


def target_distribution(
    logits: torch.Tensor,  # [R, V]
    temperature: torch.Tensor,  # [R] float32; 0 = greedy (one-hot at the first argmax)
    top_k: torch.Tensor,  # [R] int32
    top_p: torch.Tensor,  # [R] float32
) -> torch.Tensor:
    """float64 [R, V]: the distribution a target-only sampler draws from (the exactness oracle)."""
    logits64 = logits.double()
    greedy = temperature == 0
    inv_t = torch.where(greedy, 1.0, 1.0 / temperature.clamp(min=1e-30)).float()
    thr = logit_thresholds(logits, inv_t, top_k, top_p).double()
    scaled = torch.where(logits64 >= thr[:, None], logits64 * inv_t.double()[:, None], -torch.inf)
    probs = torch.softmax(scaled, dim=-1)
    one_hot = torch.nn.functional.one_hot(logits64.argmax(-1), logits.shape[1]).double()
    return torch.where(greedy[:, None], one_hot, probs)
