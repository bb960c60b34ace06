"""The draft engine's block building: q rows from step-major head outputs, request-major."""

from __future__ import annotations

import torch

from draft_service.engine import _gather_q
from specdec.serving.blocks import DenseQ, SparseQ


def _outputs(
    ks: list[int], sparse: bool
) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """Head outputs per step; the q row of (request b, step j) is filled with 10 b + j."""
    out = []
    for j in range(max(ks)):
        rows = [b for b, k in enumerate(ks) if k > j]
        probs = torch.tensor([[10.0 * b + j] * 3 for b in rows])
        out.append((rows, probs, (probs + 100).int() if sparse else None))
    return out


def test_q_rows_are_request_major_and_skip_greedy_requests() -> None:
    ks, sampled = [2, 1, 3], [True, False, True]
    dense = _gather_q(_outputs(ks, sparse=False), ks, sampled)
    assert isinstance(dense, DenseQ)
    assert dense.probs[:, 0].tolist() == [0, 1, 20, 21, 22]
    sparse = _gather_q(_outputs(ks, sparse=True), ks, sampled)
    assert isinstance(sparse, SparseQ) and sparse.token_ids.dtype == torch.int32
    assert sparse.token_ids[:, 0].tolist() == [100, 101, 120, 121, 122]
    assert torch.equal(sparse.probs, dense.probs)
    assert _gather_q(_outputs(ks, sparse=True), ks, [False] * 3) is None
