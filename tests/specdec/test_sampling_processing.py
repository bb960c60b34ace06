"""One top-k / top-p rule: the draft keeps exactly the tokens the target keeps for the same
logits and sampling parameters (top-k, top-p, both, ties at the boundary); the target's
distribution equals a reference written apart from the rule's code, which tells a top-k or a
top-p off by a little from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draft_service.sampling import sample_draft
from target_service.logits_processing import logit_thresholds, target_distribution
from tests.specdec.reference_sampling import reference_gap

VOCAB = 64
ROWS = 32


def _target_kept(logits, temperature, top_k, top_p) -> torch.Tensor:  # type: ignore[no-untyped-def]
    inv_t = torch.where(temperature == 0, 1.0, 1.0 / temperature.clamp(min=1e-30)).float()
    return logits >= logit_thresholds(logits, inv_t, top_k, top_p)[:, None]


def _draft_kept(logits, temperature, top_k, top_p) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The draft's kept set, read from its dense q and from a sparse q as wide as the vocab."""
    seed = torch.zeros(logits.shape[0], dtype=torch.int64)
    position = torch.arange(logits.shape[0], dtype=torch.int64)
    dense = sample_draft(logits, temperature, top_k, top_p, seed, position, None)
    sparse = sample_draft(logits, temperature, top_k, top_p, seed, position, VOCAB)
    assert sparse.support_ids is not None
    from_sparse = torch.zeros_like(logits, dtype=torch.bool)
    rows = torch.arange(logits.shape[0])[:, None].expand_as(sparse.support_ids)
    valid = sparse.support_ids >= 0
    from_sparse[rows[valid], sparse.support_ids[valid].long()] = True
    return dense.probs > 0, from_sparse


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(
    ("top_k", "top_p"), [(0, 1.0), (5, 1.0), (1, 1.0), (VOCAB, 1.0), (0, 0.7), (0, 0.05), (9, 0.8)]
)
def test_draft_keeps_what_the_target_keeps(top_k: int, top_p: float, ties: bool) -> None:
    gen = torch.Generator().manual_seed(top_k * 100 + int(top_p * 100) + ties)
    logits = torch.randn(ROWS, VOCAB, generator=gen) * 2
    if ties:  # integer logits: many ties, at the top-k and top-p boundaries too
        logits = logits.round()
    temperature = 0.5 + torch.rand(ROWS, generator=gen)
    k = torch.full((ROWS,), top_k, dtype=torch.int32)
    p = torch.full((ROWS,), top_p)
    target = _target_kept(logits, temperature, k, p)
    dense, sparse = _draft_kept(logits, temperature, k, p)
    assert torch.equal(dense, target)
    assert torch.equal(sparse, target)
    if ties and top_k == 5:  # the case is really exercised: some row keeps more than k
        assert bool((target.sum(-1) > top_k).any())


def test_ties_at_the_boundary_are_kept_on_both_sides() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0], [3.0, 2.0, 2.0, 1.0, 0.0]])
    temperature = torch.ones(2)
    # Row 0: top-p 0.6 stops after the first 1.0; its tie is kept. Row 1: top-k 2, tie kept.
    top_k = torch.tensor([0, 2], dtype=torch.int32)
    top_p = torch.tensor([0.6, 1.0])
    expected = torch.tensor([[True, True, True, False, False], [True, True, True, False, False]])
    assert torch.equal(_target_kept(logits, temperature, top_k, top_p), expected)
    padded = torch.cat([logits, torch.full((2, VOCAB - 5), -30.0)], dim=1)
    dense, sparse = _draft_kept(padded, temperature, top_k, top_p)
    assert torch.equal(dense[:, :5], expected) and torch.equal(sparse[:, :5], expected)
    assert not dense[:, 5:].any() and not sparse[:, 5:].any()


def test_mixed_rows_in_one_batch_match_row_by_row() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, VOCAB, generator=gen) * 2).round()
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.9, 1.0, 0.6])
    top_k = torch.tensor([0, 4, 0, 12, 1, 3], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.9, 0.3, 0.99])
    target = _target_kept(logits, temperature, top_k, top_p)
    dense, sparse = _draft_kept(logits, temperature, top_k, top_p)
    assert torch.equal(dense, target) and torch.equal(sparse, target)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 20, 0.9), (0.8, 10, 1.0), (0.3, 0, 0.9), (0.5, 1, 1.0), (0.0, 0, 1.0)],
)
def test_the_target_distribution_is_the_reference(
    temperature: float, top_k: int, top_p: float
) -> None:
    """The oracle the served exactness tests use (`target_distribution`) equals the reference
    on random logits (up to float32), and a rule off by one token of top-k or by 0.02 of top-p
    differs from it by far more."""
    gen = torch.Generator().manual_seed(int(temperature * 10) + top_k)
    logits = torch.randn(ROWS, 512, generator=gen) * 3
    full = torch.full((ROWS,), 1.0)

    def target(k: int, p: float) -> np.ndarray:
        return target_distribution(
            logits, full * temperature, torch.full((ROWS,), k, dtype=torch.int32), full * p
        ).numpy()

    def gap(k: int, p: float) -> tuple[float, int]:
        """target_distribution at (k, p) against the reference at the case's (top_k, top_p)."""
        return reference_gap(target(k, p), logits.double().numpy(), temperature, top_k, top_p)

    exact, ambiguous = gap(top_k, top_p)
    assert ambiguous <= 1
    assert exact < 1e-6
    if top_k > 1:
        assert gap(top_k - 1, top_p)[0] > 1e-3
    if top_p < 1.0:
        assert gap(top_k, top_p - 0.02)[0] > 1e-3
