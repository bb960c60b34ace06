"""Top-k / top-p as per-row logit thresholds: the one rule the draft and the target share.

A row keeps token j iff logit_j >= threshold (ties at the boundary are kept, as in vLLM), so
the target's kernels read the raw logits once and mask on the fly, and the draft's q has
exactly the support the target would give the same logits and parameters. Order of
processing: temperature, then top-k, then top-p over the top-k survivors renormalised.
A row with neither top-k nor top-p gets -inf (keeps every token).
"""

from __future__ import annotations

import torch


def sorted_thresholds(
    sorted_logits: torch.Tensor,  # [R, V] float32; each row's raw logits, descending
    inv_temperature: torch.Tensor,  # [R] float32; 1/T (1 for greedy rows)
    top_k: torch.Tensor,  # [R] int32; 0 = off
    top_p: torch.Tensor,  # [R] float32; 1 = off
) -> torch.Tensor:
    """Per-row threshold [R] float32 from already sorted logits; no host syncs, fixed shapes.

    Example: sorted logits [3, 2, 2, 1], T = 1, top_k = 2 gives threshold 2: the tie at the
    boundary keeps three tokens.
    """
    vocab = sorted_logits.shape[1]
    k = top_k.long()
    k = torch.where((k <= 0) | (k > vocab), vocab, k)
    positions = torch.arange(vocab, device=sorted_logits.device)
    in_top_k = positions[None, :] < k[:, None]
    scaled = torch.where(in_top_k, sorted_logits * inv_temperature[:, None], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    # Smallest prefix whose mass reaches top_p: count the entries strictly before it.
    mass_before = probs.cumsum(dim=-1) - probs
    keep = in_top_k & (mass_before < top_p[:, None])
    last_kept = keep.sum(dim=-1).clamp(min=1) - 1
    found = sorted_logits.gather(1, last_kept[:, None]).squeeze(1)
    return torch.where((top_k > 0) | (top_p < 1.0), found, float("-inf"))


def logit_thresholds(
    logits: torch.Tensor,  # [R, V] float32 | bf16
    inv_temperature: torch.Tensor,  # [R] float32; 1/T (1 for greedy rows)
    top_k: torch.Tensor,  # [R] int32; 0 = off
    top_p: torch.Tensor,  # [R] float32; 1 = off
    *,
    rows: torch.Tensor | None = None,  # [r] int32 | int64: the rows with top-k or top-p
) -> torch.Tensor:
    """Per-row threshold [R] float32: -inf where a row keeps every token.

    Sorting happens only for `rows`. Passing them (from the caller's host-side knowledge)
    saves finding them on the device, which reads a count back (a sync); rows it names that
    need no threshold still get -inf.
    """
    thresholds = torch.full((logits.shape[0],), float("-inf"), device=logits.device)
    if rows is None:
        rows = ((top_k > 0) | (top_p < 1.0)).nonzero().flatten()
    if rows.numel() == 0:
        return thresholds
    rows = rows.long()
    sorted_logits = logits.index_select(0, rows).float().sort(dim=-1, descending=True).values
    found = sorted_thresholds(
        sorted_logits,
        inv_temperature.index_select(0, rows),
        top_k.index_select(0, rows),
        top_p.index_select(0, rows),
    )
    return thresholds.scatter_(0, rows, found)
