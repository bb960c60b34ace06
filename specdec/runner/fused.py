"""The decode path's small pointwise pieces as three Triton kernels, each next to a pure-torch
reference of the same function (the CPU path and `compile_pointwise` run the references).

At batch 1 a decode step is launch-bound: torch ran ~13 small kernels per layer between the
GEMMs (two RMSNorms, rope as cat/neg/mul/mul/add, stack + index_put + copies for the K/V store,
silu, mul). These three take it to four, two of them the add + norm:

- `add_rms_norm`: x + delta (the residual add) and RMSNorm of the sum, one read of each.
- `rope_store`: per-head RMSNorm of q and k (Qwen3), rope on q and k, and the store of k and v
  into the slot cache at (slot, position); returns q.
- `silu_mul`: silu(gate) * up from the fused gate/up GEMM's output.

Rounding follows transformers' order in half precision (residual sum rounded before the norm,
normed value rounded before the weight, each rope product rounded before the sum), so bf16
results match its modules' rather than a once-rounded float32 version.

Cache offsets are int64: slots x 2 x kv_heads x max_seq_len x head_dim passes 2**31 elements at
real sizes (e.g. 65 slots x 2 x 8 x 32768 x 128).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specdec.gdc import launch_options, pdl_enabled, wait_then_release


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, N] residual stream
    delta_ptr,  # [T, N] added to x first (read only with HAS_DELTA)
    w_ptr,  # [N]
    h_ptr,  # [T, N] out: the normed sum
    res_ptr,  # [T, N] out: x + delta (written only with HAS_DELTA)
    eps,
    stride_x,
    stride_d,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)  # nothing before this reads or writes what other kernels touch
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + row * N + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    h = (xf * rstd).to(h_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(h_ptr + row * N + cols, h.to(h_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor,  # [T, N]
    delta: torch.Tensor | None,  # [T, N] or None (no add)
    weight: torch.Tensor,  # [N]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + delta) * weight, x + delta), both [T, N] in x's dtype."""
    t, n = x.shape
    assert x.stride(1) == 1 and weight.shape == (n,)
    assert delta is None or (delta.shape == x.shape and delta.stride(1) == 1)
    h = torch.empty((t, n), dtype=x.dtype, device=x.device)
    res = x if delta is None else torch.empty_like(h)
    pdl = pdl_enabled(x.device, t)
    if t:
        _add_rms_norm_kernel[(t,)](
            x,
            x if delta is None else delta,
            weight,
            h,
            res,
            eps,
            x.stride(0),
            x.stride(0) if delta is None else delta.stride(0),
            N=n,
            BLOCK=triton.next_power_of_2(n),
            HAS_DELTA=delta is not None,
            PDL=pdl,
            **launch_options(pdl),
        )
    return h, res


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm over the last dimension."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    res = x if delta is None else x + delta
    return rms_norm_reference(res, weight, eps), res


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2 * INTER]: gate then up
    out_ptr,  # [T, INTER]
    stride_g,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)  # nothing before this reads or writes what other kernels touch
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    g = tl.load(gate_up_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride_g + INTER + cols, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * INTER + cols, (s * u).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] -> [T, I]
    t, two_i = gate_up.shape
    assert gate_up.stride(1) == 1 and two_i % 2 == 0
    out = gate_up.new_empty((t, two_i // 2))
    block = min(1024, triton.next_power_of_2(two_i // 2))
    pdl = pdl_enabled(gate_up.device, t)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(two_i // 2, block))](
            gate_up,
            out,
            gate_up.stride(0),
            INTER=two_i // 2,
            BLOCK=block,
            PDL=pdl,
            **launch_options(pdl),
        )
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _rope_store_kernel(
    qkv_ptr,  # [T, (heads + 2 * kv_heads) * D]: q heads, k heads, v heads
    cos_ptr,  # [T, D]
    sin_ptr,  # [T, D]
    q_norm_ptr,  # [D] (read only with QK_NORM)
    k_norm_ptr,  # [D] (read only with QK_NORM)
    q_out_ptr,  # [T, heads, D] contiguous
    cache_ptr,  # [slots, 2, kv_heads, max_seq_len, D]
    token_slot_ptr,  # [T] int64
    positions_ptr,  # [T] int64
    eps,
    stride_slot,  # 0 where one request's slot is broadcast over its tokens
    stride_pos,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_cs,
    stride_ckv,
    stride_ch,
    stride_cl,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,  # next power of two of D // 2
    QK_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)  # nothing before this reads or writes what other kernels touch
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # [0, HEADS) q, [HEADS, HEADS + KV_HEADS) k, then v
    i = tl.arange(0, HALF)
    ok = i < D // 2
    dt = q_out_ptr.dtype.element_ty
    src = qkv_ptr + t * stride_qkv + h * D
    x1 = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + D // 2 + i, mask=ok, other=0.0).to(tl.float32)
    if h < HEADS + KV_HEADS:
        if QK_NORM:
            if h < HEADS:
                w1 = tl.load(q_norm_ptr + i, mask=ok, other=0.0).to(tl.float32)
                w2 = tl.load(q_norm_ptr + D // 2 + i, mask=ok, other=0.0).to(tl.float32)
            else:
                w1 = tl.load(k_norm_ptr + i, mask=ok, other=0.0).to(tl.float32)
                w2 = tl.load(k_norm_ptr + D // 2 + i, mask=ok, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
            x1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
            x2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
        c1 = tl.load(cos_ptr + t * stride_cos + i, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_cos + D // 2 + i, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_sin + i, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_sin + D // 2 + i, mask=ok, other=0.0).to(tl.float32)
        # x * cos + cat(-x2, x1) * sin, each product rounded as torch rounds it
        y1 = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
        y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    else:
        y1 = x1
        y2 = x2
    if h < HEADS:
        dst = q_out_ptr + (t * HEADS + h) * D
    else:
        kv = (h - HEADS) // KV_HEADS  # 0: k, 1: v
        slot = tl.load(token_slot_ptr + t * stride_slot).to(tl.int64)
        pos = tl.load(positions_ptr + t * stride_pos).to(tl.int64)
        dst = (
            cache_ptr
            + slot * stride_cs
            + kv * stride_ckv
            + ((h - HEADS) % KV_HEADS) * stride_ch
            + pos * stride_cl
        )
    tl.store(dst + i, y1.to(dt), mask=ok)
    tl.store(dst + D // 2 + i, y2.to(dt), mask=ok)


def rope_store(
    qkv: torch.Tensor,  # [T, (heads + 2 * kv_heads) * D]
    cos: torch.Tensor,  # [T, D] (any row stride)
    sin: torch.Tensor,  # [T, D]
    q_norm: torch.Tensor | None,  # [D] or None (no q/k norm)
    k_norm: torch.Tensor | None,  # [D]
    eps: float,
    cache: torch.Tensor,  # [slots, 2, kv_heads, max_seq_len, D]
    token_slot: torch.Tensor,  # [T] int64, any stride (0 at batch 1: one slot broadcast)
    positions: torch.Tensor,  # [T] int64, each < max_seq_len
) -> torch.Tensor:
    """Writes roped k and v of each token into cache[slot, :, :, position]; returns roped q
    [T, heads, D]. With q_norm/k_norm each q and k head is RMSNormed (over D) before rope."""
    t = qkv.shape[0]
    _, _, kv_heads, _, d = cache.shape
    heads = qkv.shape[1] // d - 2 * kv_heads
    assert heads > 0 and qkv.shape[1] == (heads + 2 * kv_heads) * d and d % 2 == 0
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert cache.stride(4) == 1 and token_slot.shape == positions.shape == (t,)
    assert (q_norm is None) == (k_norm is None)
    q = qkv.new_empty((t, heads, d))
    pdl = pdl_enabled(qkv.device, t)
    if t:
        _rope_store_kernel[(t, heads + 2 * kv_heads)](
            qkv,
            cos,
            sin,
            q if q_norm is None else q_norm,
            q if k_norm is None else k_norm,
            q,
            cache,
            token_slot,
            positions,
            eps,
            token_slot.stride(0),
            positions.stride(0),
            qkv.stride(0),
            cos.stride(0),
            sin.stride(0),
            *cache.stride()[:4],
            HEADS=heads,
            KV_HEADS=kv_heads,
            D=d,
            HALF=triton.next_power_of_2(d // 2),
            QK_NORM=q_norm is not None,
            PDL=pdl,
            **launch_options(pdl),
        )
    return q


def qk_rope_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pure part of `rope_store`: q, k roped (and normed), v; [T, *, D] each."""
    d = cos.shape[-1]
    x = qkv.view(qkv.shape[0], heads + 2 * kv_heads, d)
    q, k, v = x[:, :heads], x[:, heads : heads + kv_heads], x[:, heads + kv_heads :]
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm_reference(q, q_norm, eps), rms_norm_reference(k, k_norm, eps)
    cos, sin = cos[:, None], sin[:, None]
    half = d // 2

    def rope(y: torch.Tensor) -> torch.Tensor:
        return y * cos + torch.cat((-y[..., half:], y[..., :half]), dim=-1) * sin

    return rope(q), rope(k), v


def rope_store_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cache: torch.Tensor,
    token_slot: torch.Tensor,
    positions: torch.Tensor,
    qk_rope: Callable[..., tuple[torch.Tensor, ...]] = qk_rope_reference,  # or its compiled self
) -> torch.Tensor:
    kv_heads, d = cache.shape[2], cache.shape[4]
    heads = qkv.shape[1] // d - 2 * kv_heads
    q, k, v = qk_rope(qkv, cos, sin, q_norm, k_norm, eps, heads, kv_heads)
    cache[token_slot, :, :, positions] = torch.stack((k, v), dim=1)
    return q
