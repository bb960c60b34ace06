"""Attention over the slot KV cache for a ragged batch: SDPA in plain torch, or on CUDA for
short per-request chunks (decode, verify, draft steps) the split-KV kernel of
`decode_attention`, which reads the cache in place and needs no mask.

A forward holds B requests with n_b new tokens each, flattened to T = Σ n_b tokens for every
matmul. Only attention needs them per request: the queries are scattered into a padded
[B, n_max] grid, each request's keys are gathered from its slot, and one SDPA call runs with a
boolean mask built from absolute positions (key j is visible to the query at position p iff
j <= p, and p - j < window for sliding layers). Grouped-query heads are folded into the query
length ([B, kv_heads, group * n_max, D]) so no K/V is repeated.

Example: requests a (3 cached, 2 new) and b (5 cached, 1 new): T = 3, n_max = 2,
positions = [3, 4, 5], q_pad_index = [0, 1, 2] (b's padded slot 3 is unused and sees key 0
only, so no row of the mask is empty and SDPA never returns NaN). The kernel path needs none
of the grid: it reads q flat through cu_q = [0, 2, 3].
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdec.runner.decode_attention import decode_attention, num_splits

# The SDPA backends the mask path may use: all but cuDNN's. On Hopper torch picks cuDNN first,
# and cuDNN builds an execution plan for every (query length, key length) it has not seen:
# measured on an H200 (8B shapes), a prefill of 8,000 new tokens took 3,087 ms the first time and
# 573 ms the second, and a 8,150-token prompt in chunks of 256 took 4,799 ms against 1,048 ms.
# Served prompts have every length and a chunk's keys grow by each chunk, so nearly every
# prefill paid that plan. The memory-efficient kernel needs no plan: 569 ms cold, 593 warm.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(slots=True)
class AttnMeta:
    token_slot: torch.Tensor  # [T] int64: cache slot (paged: block) of each new token
    positions: torch.Tensor  # [T] int64: absolute position of each new token
    write_pos: torch.Tensor  # [T] int64: where in its slot or block it is stored
    slots: torch.Tensor  # [B] int64; paged: block tables [B, W]
    page: int | None  # positions per block of a paged cache; None: slots
    starts: torch.Tensor  # [B] int64: cached tokens before this pass
    cu_q: torch.Tensor | None  # [B + 1] int64 offsets into the T tokens; set iff kernel path
    splits: int  # key ranges per (request, kv head) of the kernel path
    q_pad_index: torch.Tensor | None  # [T] int64 into the flat [B * n_max] grid; None if T == B*n
    query_pos: torch.Tensor  # [B, n_max] int64 (padding: 0)
    n_max: int
    kv_len: int  # keys gathered per request (>= every position + 1)
    cos: torch.Tensor  # [T, 1, head_dim] in the model dtype
    sin: torch.Tensor  # [T, 1, head_dim]
    masks: dict[int | None, torch.Tensor]  # window -> [B, 1, group * n_max, kv_len] bool
    # (SDPA path only)


def build_meta(
    slots: torch.Tensor,
    starts: torch.Tensor,
    counts: list[int],
    kv_len: int,
    group: int,
    windows: set[int | None],
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    equal: bool,
    kernel: bool = False,
    kv_heads: int = 1,
    page: int | None = None,
) -> AttnMeta:
    """Metadata for B requests in `slots` [B] with cached lengths `starts` [B] and `counts` new
    tokens each. With `equal` every count is the same and no host sync or scatter is needed
    (the CUDA-graph path); with `kernel` neither is needed in any case, nor masks. With `page`
    the cache is paged and `slots` are block tables [B, W]: position p of request b is stored
    in block slots[b, p // page] at offset p % page."""
    device = slots.device
    paged = page is not None
    # the expressions below spread `owner` over the tokens: the slots, or (paged) row numbers
    owner = torch.arange(slots.shape[0], device=device) if paged else slots
    n_max = max(counts) if counts else 0
    local = torch.arange(n_max, device=device)
    query_pos = starts[:, None] + local[None, :]  # [B, n_max]
    cu_q = None
    if equal:
        q_pad_index = None
        positions = query_pos.reshape(-1)
        token_slot = owner[:, None].expand(-1, n_max).reshape(-1)
        if kernel:
            cu_q = torch.arange(0, n_max * (len(counts) + 1), max(n_max, 1), device=device)
    elif kernel:  # flat, from host counts: no nonzero(), so no host sync
        total = sum(counts)
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        cu_q = torch.tensor(offsets, device=device)
        count_t = cu_q.diff()
        first = cu_q[:-1].repeat_interleave(count_t, output_size=total)
        positions = starts.repeat_interleave(count_t, output_size=total)
        positions = positions + torch.arange(total, device=device) - first
        token_slot = owner.repeat_interleave(count_t, output_size=total)
        q_pad_index = None
    else:
        count_t = torch.tensor(counts, device=device)
        valid = local[None, :] < count_t[:, None]  # [B, n_max]
        query_pos = torch.where(valid, query_pos, torch.zeros_like(query_pos))
        q_pad_index = valid.reshape(-1).nonzero().squeeze(1)
        positions = query_pos.reshape(-1)[q_pad_index]
        token_slot = owner.repeat_interleave(count_t)
    keys = torch.arange(kv_len, device=device)
    masks = {}
    for window in () if kernel else windows:
        visible = keys[None, None, :] <= query_pos[:, :, None]  # [B, n_max, kv_len]
        if window is not None:
            visible &= query_pos[:, :, None] - keys[None, None, :] < window
        b = visible.shape[0]
        masks[window] = (
            visible[:, None].expand(b, group, n_max, kv_len).reshape(b, 1, group * n_max, kv_len)
        )
    write_pos = positions
    if page is not None:  # token_slot holds each token's row: its block from the row's table
        token_slot = slots[token_slot, positions // page]
        write_pos = positions % page
    return AttnMeta(
        token_slot=token_slot,
        positions=positions,
        write_pos=write_pos,
        slots=slots,
        page=page,
        starts=starts,
        cu_q=cu_q,
        splits=num_splits(len(counts), kv_heads, kv_len, device) if kernel else 0,
        q_pad_index=q_pad_index,
        query_pos=query_pos,
        n_max=n_max,
        kv_len=kv_len,
        cos=cos_table[positions][:, None],
        sin=sin_table[positions][:, None],
        masks=masks,
    )


def attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttnMeta,
    window: int | None,
) -> torch.Tensor:
    """Attends over `cache`, which already holds the new tokens' K/V; [T, heads * head_dim].

    q [T, heads, D]; cache [slots, 2, kv_heads, max_seq_len, D] (paged: [blocks, 2, kv_heads,
    page, D]).
    """
    _, heads, d = q.shape
    kv_heads = cache.shape[2]
    group = heads // kv_heads
    if meta.cu_q is not None:
        out = decode_attention(
            q, cache, meta.slots, meta.starts, meta.cu_q, meta.n_max, window, meta.splits,
            meta.page,
        )  # fmt: skip
        return out.view(-1, heads * d)
    if meta.page is None:
        kv = cache[:, :, :, : meta.kv_len].index_select(0, meta.slots)  # [B, 2, kv_heads, L, D]
    else:  # each request's blocks in order, as one sequence
        b, width, page = meta.slots.shape[0], -(-meta.kv_len // meta.page), meta.page
        blocks = cache.index_select(0, meta.slots[:, :width].reshape(-1))
        kv = blocks.view(b, width, 2, kv_heads, page, d).permute(0, 2, 3, 1, 4, 5)
        kv = kv.reshape(b, 2, kv_heads, width * page, d)[:, :, :, : meta.kv_len]
    b, n = kv.shape[0], meta.n_max
    if meta.q_pad_index is not None:
        grid = q.new_zeros(b * n, heads, d)
        grid[meta.q_pad_index] = q
        q = grid
    q = q.view(b, n, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * n, d)
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(q, kv[:, 0], kv[:, 1], attn_mask=meta.masks[window])
    out = out.view(b, kv_heads, group, n, d).permute(0, 3, 1, 2, 4).reshape(b * n, heads * d)
    if meta.q_pad_index is not None:
        out = out[meta.q_pad_index]
    return out
