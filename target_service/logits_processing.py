"""The target's logits processing: top-k / top-p thresholds (the rule shared with the draft,
`specdec.sampling`), and the exact target distribution for tests.

The sampler keeps token j of a row iff logit_j >= threshold, so the kernels read the raw logits
once and mask on the fly.
"""

from __future__ import annotations

import torch

from specdec.sampling import logit_thresholds

__all__ = ["logit_thresholds", "target_distribution"]


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
