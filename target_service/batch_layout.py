"""A ragged batch's index tensors, built on the host from what the caller knows there, and
small host arrays moved to the device in one copy that does not synchronise.

Every device→host read in a verify step stalls the host until the queued forward has run, so
the sampler's preparation reads nothing back: the row layout below comes from the per-request
draft counts the caller already holds, and reaches the device with one pinned,
non-blocking copy.

Example, k = [2, 0, 1]: rows [a0 a1 a2 | b0 | c0 c1], so row_start [0, 3, 4], draft_start
[0, 2, 2], row_req [0, 0, 0, 1, 2, 2], row_draft [0, 1, -1, -1, 2, -1], token_req [0, 0, 2].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 8  # every segment starts on an 8-byte boundary, so int64 views of it are aligned
_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
           np.dtype(np.float32): torch.float32}  # fmt: skip


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The 1-D arrays (int32, int64 or float32) on `device`, as views into one buffer that
    crosses to a GPU in one non-blocking copy from pinned memory (a copy from pageable memory
    would wait for the device)."""
    sizes = [-(-a.nbytes // _ALIGN) * _ALIGN for a in arrays]
    raw = np.empty(sum(sizes) or _ALIGN, dtype=np.uint8)
    start = 0
    for a, size in zip(arrays, sizes, strict=True):
        raw[start : start + a.nbytes] = a.view(np.uint8)
        start += size
    host = torch.from_numpy(raw)
    if device.type == "cuda":
        moved = host.pin_memory().to(device, non_blocking=True)
    else:
        moved = host.to(device)
    typed = {dtype: moved.view(_DTYPES[dtype]) for dtype in {a.dtype for a in arrays}}
    out, start = [], 0
    for a, size in zip(arrays, sizes, strict=True):
        first = start // a.itemsize  # segments start on 8-byte boundaries: exact
        out.append(typed[a.dtype][first : first + a.shape[0]])
        start += size
    return out


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Where each request's rows and draft tokens sit (device tensors, int32)."""

    num_draft: torch.Tensor  # [B] k_b
    row_start: torch.Tensor  # [B] first logits row of request b
    draft_start: torch.Tensor  # [B] first draft token of request b
    row_req: torch.Tensor  # [R] owning request of each row, R = T + B
    row_draft: torch.Tensor  # [R] draft token scored by the row, -1 for a last row
    token_req: torch.Tensor  # [T] owning request of each draft token
    sorted_rows: torch.Tensor  # [r] rows whose request has top-k or top-p (thresholds)
    rates: torch.Tensor | None  # [B * W] float32 synthetic acceptance rates, row-major [B, W]


def batch_layout(
    num_draft_tokens: Sequence[int],
    truncated: Sequence[bool],
    rates: np.ndarray | None,
    device: torch.device,
) -> BatchLayout:
    """The layout of a batch with these per-request k_b, top-k/top-p flags and synthetic
    rates, built on the host and moved to `device` in one copy."""
    k = np.asarray(num_draft_tokens, dtype=np.int64)
    rows = k + 1
    requests = np.arange(k.shape[0])
    row_start = np.cumsum(rows) - rows
    draft_start = np.cumsum(k) - k
    row_req = np.repeat(requests, rows)
    row_j = np.arange(row_req.shape[0]) - row_start[row_req]
    row_draft = np.where(row_j < k[row_req], draft_start[row_req] + row_j, -1)
    sorted_rows = np.flatnonzero(np.repeat(np.asarray(truncated, dtype=bool), rows))
    columns = {"num_draft": k, "row_start": row_start, "draft_start": draft_start,
               "row_req": row_req, "row_draft": row_draft, "token_req": np.repeat(requests, k),
               "sorted_rows": sorted_rows}  # fmt: skip
    arrays: list[np.ndarray] = [a.astype(np.int32) for a in columns.values()]
    if rates is not None:
        arrays.append(np.ascontiguousarray(rates, dtype=np.float32).reshape(-1))
    moved = upload(arrays, device)
    return BatchLayout(
        **dict(zip(columns, moved, strict=False)), rates=moved[-1] if rates is not None else None
    )
