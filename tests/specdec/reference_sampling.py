"""The exactness tests' second implementation of the next-token distribution under
temperature, top-k and top-p, written apart from `specdec.sampling` (the code the draft, the
target and their oracle `target_distribution` share): where the two agree, a coding error in the
shared code would have to be made twice. It follows the same rule, so a misreading of the rule
is not caught here (test_sampling_processing's hand-written cases check the rule)."""

from __future__ import annotations

import numpy as np


def reference_distribution(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float
) -> tuple[np.ndarray, np.ndarray]:
    """([R, V] float64, [R] bool): each row's next-token distribution by the documented rule,
    written apart from `specdec.sampling` (numpy, a row at a time): temperature, then the k
    largest logits (ties with the k-th kept), then of those the smallest prefix, by descending
    logit, whose renormalised mass reaches top_p (ties with its last kept); greedy (T = 0) is
    one-hot at the first argmax. The bool marks rows where the top-p boundary lies within
    1e-6 of top_p, which float32 and float64 may settle differently."""
    rows, vocab = logits.shape
    out = np.zeros((rows, vocab))
    ambiguous = np.zeros(rows, dtype=bool)
    for r, z in enumerate(logits):
        if temperature == 0:
            out[r, int(np.argmax(z))] = 1.0
            continue
        order = np.argsort(-z, kind="stable")
        k = top_k if 0 < top_k <= vocab else vocab
        head = z[order[:k]] / temperature
        mass = np.exp(head - head[0])
        mass /= mass.sum()
        before = np.cumsum(mass) - mass
        kept = max(1, int((before < top_p).sum()))
        ambiguous[r] = top_p < 1.0 and bool(np.any(np.abs(before - top_p) < 1e-6))
        limited = top_k > 0 or top_p < 1.0
        threshold = z[order[kept - 1]] if limited else -np.inf
        w = np.where(z >= threshold, np.exp((z - z.max()) / temperature), 0.0)
        out[r] = w / w.sum()
    return out, ambiguous


def reference_gap(
    probs: np.ndarray, logits: np.ndarray, temperature: float, top_k: int, top_p: float
) -> tuple[float, int]:
    """The largest difference between `probs` [R, V] and the reference distribution of the
    same `logits` (float64), over the rows not on a top-p boundary; and how many rows are."""
    reference, ambiguous = reference_distribution(logits, temperature, top_k, top_p)
    sure = ~ambiguous
    return float(np.abs(probs[sure] - reference[sure]).max(initial=0.0)), int(ambiguous.sum())
