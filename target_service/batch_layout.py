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


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays (int32, int64 or float32, any shape) on `device`, as views into one buffer
    that crosses to a GPU in one non-blocking copy from pinned memory (a copy from pageable
    memory would wait for the device)."""
    offsets, size = [], 0
    for a in arrays:
        offsets.append(size)
        size += -(-a.nbytes // _ALIGN) * _ALIGN
    on_gpu = device.type == "cuda"
    buffer = torch.empty(max(size, _ALIGN), dtype=torch.uint8, pin_memory=on_gpu)
    raw = buffer.numpy()
    for a, off in zip(arrays, offsets, strict=True):
        raw[off : off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    moved = buffer.to(device, non_blocking=True) if on_gpu else buffer.to(device)
    dtypes = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
              np.dtype(np.float32): torch.float32}  # fmt: skip
    return [
        moved[off : off + a.nbytes].view(dtypes[a.dtype]).view(a.shape)
        for a, off in zip(arrays, offsets, strict=True)
    ]


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
    rates: torch.Tensor | None  # [max_k] float32 synthetic acceptance rates


def batch_layout(
    num_draft_tokens: Sequence[int],
    truncated: Sequence[bool],
    rates: Sequence[float] | None,
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
    arrays = [a.astype(np.int32) for a in columns.values()]
    if rates is not None:
        arrays.append(np.asarray(rates, dtype=np.float32))
    moved = upload(arrays, device)
    return BatchLayout(
        **dict(zip(columns, moved, strict=False)), rates=moved[-1] if rates is not None else None
    )
