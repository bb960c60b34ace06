"""Skinny matrix products for decode and verify steps (a few tokens times a weight matrix), next
to the torch reference of the same function.

At one to sixteen tokens a linear layer is a read of its weight matrix: y [T, N] = x [T, K] @
W[N, K]^T costs N * K * 2 bytes and almost no arithmetic. cuBLAS picks split-K kernels for the
narrower matrices of a decode step (the 8B's o_proj and down_proj, every matrix of a 1B), and
each split-K product is two launches (the product, then a reduction) that reach 63-87% of the
copy bandwidth on an H200 (bench/results/runner_profile_*.txt). Here one program owns BLOCK_N
output columns for all T tokens and walks K with software-pipelined loads (num_stages), so a
product is one launch and each weight byte is read once. Nothing is split over K, so the sums
are deterministic: the same inputs give the same bits on every call.

Example: T = 1, N = 4096, K = 4096, BLOCK_N = 16: 256 programs, each reading a 16 x 4096 slab
of W (128 KiB) in BLOCK_K-wide tiles; x's 1 x BLOCK_K tile is padded to 16 rows for tl.dot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specdec.gdc import launch_options, pdl_enabled, wait_then_release
from specdec.runner import fused

MAX_TOKENS = 16  # wider products go to cuBLAS, which is at the bandwidth there


PLAIN, GATED, NORMED = 0, 1, 2  # what the skinny kernel reads as its input rows


@triton.jit
def _residual(x_rows, d_rows, k, tok_ok, HAS_DELTA: tl.constexpr):
    """The residual stream's tile at columns k: x + delta rounded to x's dtype (as
    `fused.add_rms_norm`), or x."""
    x = tl.load(x_rows + k[None, :], mask=tok_ok[:, None], other=0.0)
    if HAS_DELTA:
        d = tl.load(d_rows + k[None, :], mask=tok_ok[:, None], other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _skinny_kernel(
    x_ptr,  # [T, K]; GATED: [T, 2K], gate then up; NORMED: the residual stream
    w_ptr,  # [N, K]
    bias_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [T, N]
    delta_ptr,  # NORMED with HAS_DELTA: [T, K], added to x first
    norm_w_ptr,  # NORMED: [K], the RMSNorm weight
    res_ptr,  # NORMED with HAS_DELTA: [T, K] out, x + delta (written by program 0)
    eps,
    T,
    N,
    stride_x,
    stride_w,
    stride_o,
    stride_d,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact float32 products, not TF32
    PROLOGUE: tl.constexpr,  # PLAIN: x; GATED: silu(gate) * up; NORMED: RMSNorm(x + delta)
    HAS_DELTA: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (specdec/gdc.py)
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    tok_ok = tokens < T
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_x
    d_rows = delta_ptr + tokens.to(tl.int64)[:, None] * stride_d
    w_rows = w_ptr + tl.where(col_ok, cols, 0).to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    wait_then_release(PDL)  # nothing before this reads or writes what other kernels touch
    if PROLOGUE == 2:
        # Each program sums the squares of the whole residual rows (T x K, a few KiB from L2)
        # before its own slab of W; program 0 also writes x + delta for the next layer.
        squares = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            r = _residual(x_rows, d_rows, k0 + ks, tok_ok, HAS_DELTA)
            if HAS_DELTA:
                dst = res_ptr + tokens.to(tl.int64)[:, None] * K + k0 + ks[None, :]
                tl.store(dst, r, mask=(tok_ok & (tokens * 0 + tl.program_id(0) == 0))[:, None])
            squares += r.to(tl.float32) * r.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(squares, 1) / K + eps)
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (skinny_linear checks)
        if PROLOGUE == 1:  # as fused.silu_mul: silu(gate) rounded, then times up
            g = tl.load(x_rows + k0 + ks[None, :], mask=tok_ok[:, None], other=0.0)
            u = tl.load(x_rows + K + k0 + ks[None, :], mask=tok_ok[:, None], other=0.0)
            gf = g.to(tl.float32)
            s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
            x = (s * u.to(tl.float32)).to(g.dtype)
        elif PROLOGUE == 2:  # as fused.add_rms_norm: normed value rounded, then the weight
            r = _residual(x_rows, d_rows, k0 + ks, tok_ok, HAS_DELTA)
            nw = tl.load(norm_w_ptr + k0 + ks).to(tl.float32)
            normed = (r.to(tl.float32) * rstd[:, None]).to(r.dtype).to(tl.float32)
            x = (normed * nw[None, :]).to(r.dtype)
        else:
            x = tl.load(x_rows + k0 + ks[None, :], mask=tok_ok[:, None], other=0.0)
        w = tl.load(w_rows + k0 + ks[None, :])
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + tokens.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True, slots=True)
class SkinnyShape:
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    shape: SkinnyShape | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) by the skinny kernel: x [T, K] with 1 <= T <= MAX_TOKENS,
    K a multiple of shape.block_k, unit inner strides."""
    shape = shape or SkinnyShape()
    assert _fits(x, x.shape[1], weight, shape)
    return _launch(x, weight, bias, shape, PLAIN)


def _fits(x: torch.Tensor, k: int, weight: torch.Tensor, shape: SkinnyShape) -> bool:
    """Whether the skinny kernel takes x [T, >= k] times weight [N, k]^T with this shape."""
    return (
        0 < x.shape[0] <= MAX_TOKENS
        and k % shape.block_k == 0
        and weight.shape[1] == k
        and x.dtype == weight.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
    )


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    shape: SkinnyShape,
    prologue: int,
    delta: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    res: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    n, k = weight.shape
    out = x.new_empty((x.shape[0], n))
    pdl = pdl_enabled(x.device)
    _skinny_kernel[(triton.cdiv(n, shape.block_n),)](
        x, weight, bias if bias is not None else weight, out,
        delta if delta is not None else x, norm_weight if norm_weight is not None else weight,
        res if res is not None else out, eps, x.shape[0], n, x.stride(0), weight.stride(0),
        out.stride(0), delta.stride(0) if delta is not None else 0, K=k,
        HAS_BIAS=bias is not None, BLOCK_T=16, BLOCK_N=shape.block_n, BLOCK_K=shape.block_k,
        IEEE=x.dtype == torch.float32, PROLOGUE=prologue, HAS_DELTA=delta is not None,
        num_warps=shape.num_warps, num_stages=shape.num_stages, PDL=pdl, **launch_options(pdl),
    )  # fmt: skip
    return out


def norm_linear(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(RMSNorm(x + delta) * norm_weight, weight, bias), x + delta): `fused.add_rms_norm`
    then `linear` in one launch where the skinny kernel takes the shapes (decode and verify
    steps), the two apart otherwise. One launch fewer per norm: at batch 1 each launch of a
    step costs more than the few KiB the norm reads."""
    t, k = x.shape
    shape = skinny_shape(weight.shape[0], k, weight.element_size())
    fits = _fits(x, k, weight, shape) and norm_weight.shape == (k,)
    if not fits or (delta is not None and (delta.shape != x.shape or delta.stride(1) != 1)):
        h, res = fused.add_rms_norm(x, delta, norm_weight, eps)
        return linear(h, weight, bias), res
    res = x if delta is None else torch.empty((t, k), dtype=x.dtype, device=x.device)
    out = _launch(x, weight, bias, shape, NORMED, delta, norm_weight, res, eps)
    return out, res


def gated_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """linear(silu(gate) * up, weight, bias) for gate_up [T, 2I] (gate then up): `fused.silu_mul`
    then `linear` in one launch where the skinny kernel takes the shapes, the two apart
    otherwise."""
    k = gate_up.shape[1] // 2
    shape = skinny_shape(weight.shape[0], k, weight.element_size())
    if gate_up.shape[1] % 2 or not _fits(gate_up, k, weight, shape):
        return linear(fused.silu_mul(gate_up), weight, bias)
    return _launch(gate_up, weight, bias, shape, GATED)


def skinny_shape(n: int, k: int, itemsize: int = 2) -> SkinnyShape:
    """Tiles by the weight's size: the best of 18 per shape of the Llama-3.1-8B and -3.2-1B
    matrices at 1 and 8 tokens on an H200 (bench/results/gemv_NVIDIA_H200.json). Narrow
    matrices want more, smaller programs; wide ones, fewer pipeline stages. float32 weights
    take half as wide a K tile, so the staged tiles fit in shared memory. A K that 256 does not
    divide (small test models) takes the widest power-of-two tile that divides it."""
    if k % 256 and k & -k >= 16:
        return SkinnyShape(16, k & -k, 4, 2)
    if n <= 2048 and k % 512 == 0:
        shape = SkinnyShape(16, 512, 4, 5)
    elif n <= 4096:
        shape = SkinnyShape(32, 256, 4, 5)
    elif n < 16384:
        shape = SkinnyShape(64, 256, 4, 3)
    else:
        shape = SkinnyShape(64, 128, 4, 3)
    if itemsize == 4:
        shape = SkinnyShape(shape.block_n, shape.block_k // 2, shape.num_warps, shape.num_stages)
    return shape


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The runner's linear layer on CUDA: the skinny kernel for decode and verify steps (up to
    MAX_TOKENS rows), cuBLAS for wider batches and for shapes the kernel does not take."""
    shape = skinny_shape(weight.shape[0], x.shape[1], weight.element_size())
    if _fits(x, x.shape[1], weight, shape):
        return _launch(x, weight, bias, shape, PLAIN)
    return F.linear(x, weight, bias)


def skinny_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)
