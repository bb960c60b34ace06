"""Split-KV ("flash-decoding") attention for decode and verify steps, reading the slot cache in
place, next to a pure-torch reference of the same function.

A step holds B requests; request b has `starts[b]` cached tokens and n_b = cu_q[b+1] - cu_q[b]
new ones (1 for decode, k + 1 for verify), already written into its slot at positions
starts[b] .. starts[b] + n_b - 1. New token t of request b sits at position p = starts[b] + t
and sees key j iff j <= p (and p - j < window on sliding layers).

The keys of one request are cut into NUM_SPLITS ranges, each range cut at its own request's
length (not the step's longest, nor max_seq_len), so a CUDA graph captured once for a batch
size spends its time in proportion to the real lengths. One program handles one (request, kv
head, range): its query tile holds the group * n_b query heads that share that kv head (rows
m = t * group + g), so grouped-query heads read each K/V block once. A second kernel merges
the ranges through their log-sum-exps.

Example: group 4, n_b = 2, starts[b] = 5, NUM_SPLITS 2, BLOCK_N 4: kv length 7, ranges [0, 4)
and [4, 7); rows 0..3 are token 0 (position 5: keys 0..5), rows 4..7 token 1 (keys 0..6).
"""

import functools

import torch
import triton
import triton.language as tl

from specdec.gdc import launch_options, pdl_enabled, wait_then_release

BLOCK_N = 64  # keys per inner iteration
MAX_ROWS = 128  # group * tokens per request the kernel takes; longer chunks go to SDPA


@triton.jit
def _split_kernel(
    q_ptr,  # [T, heads, D]
    cache_ptr,  # [slots, 2, kv_heads, max_seq_len, D]; PAGED: [blocks, 2, kv_heads, PAGE, D]
    slots_ptr,  # [B] int64; PAGED: block tables [B, W] int64
    starts_ptr,  # [B] int64
    cu_q_ptr,  # [B + 1] int64
    part_out_ptr,  # [B, kv_heads, NUM_SPLITS, BLOCK_M, HEAD_DIM] float32
    part_lse_ptr,  # [B, kv_heads, NUM_SPLITS, BLOCK_M] float32
    scale,
    window,
    stride_qt,
    stride_qh,
    stride_cs,
    stride_ckv,
    stride_ch,
    stride_cl,
    stride_table,
    D: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
):
    wait_then_release(PDL)  # nothing before this reads or writes what other kernels touch
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // KV_HEADS
    kvh = pid % KV_HEADS
    slot = 0
    if not PAGED:
        slot = tl.load(slots_ptr + b).to(tl.int64)
    start = tl.load(starts_ptr + b).to(tl.int32)
    q0 = tl.load(cu_q_ptr + b).to(tl.int32)
    n_b = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q0
    kv_len = start + n_b

    rows = tl.arange(0, BLOCK_M)
    t = rows // GROUP
    g = rows % GROUP
    row_ok = t < n_b
    dims = tl.arange(0, HEAD_DIM)
    d_ok = dims < D
    q_off = (q0 + t).to(tl.int64)[:, None] * stride_qt + (kvh * GROUP + g)[:, None] * stride_qh
    q = tl.load(q_ptr + q_off + dims[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos = start + t  # [BLOCK_M]

    first = 0
    if HAS_WINDOW:
        first = tl.maximum(start + 1 - window, 0)
    per_split = tl.cdiv(tl.cdiv(kv_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, kv_len)

    k_base = cache_ptr + slot * stride_cs + kvh * stride_ch  # PAGED: slot 0, blocks per key
    v_base = k_base + stride_ckv
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        keys = j0 + tl.arange(0, BLOCK_N)
        k_ok = keys < hi
        if PAGED:  # key j at offset j % PAGE of block table[b, j // PAGE]
            blk = tl.load(slots_ptr + b * stride_table + keys // PAGE, mask=k_ok, other=0)
            key_off = blk.to(tl.int64) * stride_cs + (keys % PAGE).to(tl.int64) * stride_cl
        else:
            key_off = keys.to(tl.int64) * stride_cl
        kv_off = key_off[None, :] + dims[:, None]
        k = tl.load(k_base + kv_off, mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [HD, N]
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale
        visible = k_ok[None, :] & (keys[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[:, None] - keys[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = key_off[:, None] + dims[None, :]
        v = tl.load(v_base + v_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [N, HD]
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    part = (pid * NUM_SPLITS + split).to(tl.int64) * BLOCK_M
    tl.store(part_lse_ptr + part + rows, lse)
    tl.store(part_out_ptr + (part + rows)[:, None] * HEAD_DIM + dims[None, :], out)


@triton.jit
def _combine_kernel(
    part_out_ptr,  # [B, kv_heads, NUM_SPLITS, BLOCK_M, HEAD_DIM] float32
    part_lse_ptr,  # [B, kv_heads, NUM_SPLITS, BLOCK_M] float32
    cu_q_ptr,  # [B + 1] int64
    out_ptr,  # [T, heads, D]
    stride_ot,
    stride_oh,
    D: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)  # nothing before this reads or writes what other kernels touch
    pid = tl.program_id(0)
    row = tl.program_id(1)
    b = pid // KV_HEADS
    kvh = pid % KV_HEADS
    t = row // GROUP
    q0 = tl.load(cu_q_ptr + b).to(tl.int32)
    n_b = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q0
    if t < n_b:
        splits = tl.arange(0, BLOCK_S)
        s_ok = splits < NUM_SPLITS
        dims = tl.arange(0, HEAD_DIM)
        part = (pid * NUM_SPLITS + splits).to(tl.int64) * BLOCK_M + row  # [BLOCK_S]
        lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
        weight = tl.exp(lse - tl.max(lse, 0))
        weight = weight / tl.sum(weight, 0)
        o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=s_ok[:, None])
        o = tl.sum(o * weight[:, None], 0)
        head = kvh * GROUP + row % GROUP
        dst = out_ptr + (q0 + t).to(tl.int64) * stride_ot + head * stride_oh + dims
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=dims < D)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits(batch: int, kv_heads: int, kv_len: int, device: torch.device) -> int:
    """Ranges per (request, kv head): about two programs per SM, never an empty block."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 132
    want = triton.cdiv(2 * sms, batch * kv_heads)
    return max(1, min(want, triton.cdiv(kv_len, BLOCK_N), 64))


def decode_attention(
    q: torch.Tensor,  # [T, heads, D]
    cache: torch.Tensor,  # [slots, 2, kv_heads, max_seq_len, D]
    slots: torch.Tensor,  # [B] int64
    starts: torch.Tensor,  # [B] int64: cached tokens before this step's
    cu_q: torch.Tensor,  # [B + 1] int64: request b's tokens are q[cu_q[b] : cu_q[b + 1]]
    n_max: int,
    window: int | None,
    splits: int,
    page: int | None = None,
) -> torch.Tensor:
    """Attention output [T, heads, D] in q's dtype; no host sync (n_max and splits come from
    the host). The new tokens' K/V must already be in the cache. With `page`, the cache is
    paged ([blocks, 2, kv_heads, page, D]) and `slots` are block tables [B, W]."""
    t, heads, d = q.shape
    kv_heads = cache.shape[2]
    group = heads // kv_heads
    b = slots.shape[0]
    if page is not None and (slots.dim() != 2 or cache.shape[3] != page):
        raise ValueError(
            f"A paged decode_attention takes block tables [B, W] and a cache of {page}-position "
            f"blocks, got tables {tuple(slots.shape)} and a cache {tuple(cache.shape)}."
        )
    if heads % kv_heads or group * n_max > MAX_ROWS or cache.shape[4] != d:
        raise ValueError(
            f"decode_attention takes heads divisible by kv_heads and group * n_max <= "
            f"{MAX_ROWS}, got heads={heads}, kv_heads={kv_heads}, n_max={n_max}."
        )
    assert q.stride(2) == 1 and cache.stride(4) == 1
    if t == 0:
        return q.new_empty((0, heads, d))
    block_m = max(16, triton.next_power_of_2(group * n_max))
    head_dim = max(16, triton.next_power_of_2(d))
    part_out = q.new_empty((b, kv_heads, splits, block_m, head_dim), dtype=torch.float32)
    part_lse = q.new_empty((b, kv_heads, splits, block_m), dtype=torch.float32)
    out = q.new_empty((t, heads, d))
    ieee = q.dtype == torch.float32
    pdl = pdl_enabled(q.device, t)
    _split_kernel[(b * kv_heads, splits)](
        q,
        cache,
        slots,
        starts,
        cu_q,
        part_out,
        part_lse,
        d**-0.5,
        window or 0,
        q.stride(0),
        q.stride(1),
        *cache.stride()[:4],
        slots.stride(0) if page is not None else 0,
        D=d,
        KV_HEADS=kv_heads,
        GROUP=group,
        NUM_SPLITS=splits,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim,
        HAS_WINDOW=window is not None,
        IEEE=ieee,
        PDL=pdl,
        PAGED=page is not None,
        PAGE=page or 1,
        **launch_options(pdl),
    )
    _combine_kernel[(b * kv_heads, group * n_max)](
        part_out,
        part_lse,
        cu_q,
        out,
        out.stride(0),
        out.stride(1),
        D=d,
        KV_HEADS=kv_heads,
        GROUP=group,
        NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        PDL=pdl,
        **launch_options(pdl),
    )
    return out


def decode_attention_reference(
    q: torch.Tensor,  # [T, heads, D]
    cache: torch.Tensor,  # [slots, 2, kv_heads, max_seq_len, D]
    slots: torch.Tensor,  # [B] int64
    starts: torch.Tensor,  # [B] int64
    cu_q: torch.Tensor,  # [B + 1] int64
    window: int | None,
    page: int | None = None,
) -> torch.Tensor:
    """The same function in float64 torch, one request at a time; [T, heads, D] float64. With
    `page`: a paged cache and block tables [B, W], read back as slots first."""
    t, heads, d = q.shape
    group = heads // cache.shape[2]
    if page is not None:  # each request's blocks in order: a slot per request
        b, width = slots.shape
        cache = cache[slots.reshape(-1)].view(b, width, *cache.shape[1:]).permute(0, 2, 3, 1, 4, 5)
        cache = cache.reshape(b, 2, cache.shape[2], width * page, d)
        slots = torch.arange(b, device=slots.device)
    out = torch.full((t, heads, d), float("nan"), dtype=torch.float64, device=q.device)
    for slot, start, q0, q1 in zip(
        slots.tolist(), starts.tolist(), cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True
    ):
        kv = cache[slot, :, :, : start + q1 - q0].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,hjd->htj", q[q0:q1].double(), kv[0]) * d**-0.5
        pos = torch.arange(start, start + q1 - q0, device=q.device)[:, None]
        keys = torch.arange(kv.shape[2], device=q.device)[None, :]
        visible = keys <= pos
        if window is not None:
            visible &= pos - keys < window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("htj,hjd->thd", probs, kv[1])
    return out
