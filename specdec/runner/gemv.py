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

MAX_TOKENS = 16  # wider products go to cuBLAS, which is at the bandwidth there


@triton.jit
def _skinny_kernel(
    x_ptr,  # [T, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [T, N]
    T,
    N,
    stride_x,
    stride_w,
    stride_o,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: exact float32 products, not TF32
    PDL: tl.constexpr,  # programmatic dependent launch (specdec/gdc.py)
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    tok_ok = tokens < T
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + tl.where(col_ok, cols, 0).to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    wait_then_release(PDL)  # nothing before this reads or writes what other kernels touch
    for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (skinny_linear checks)
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
    t, k = x.shape
    n = weight.shape[0]
    assert 0 < t <= MAX_TOKENS and k % shape.block_k == 0 and weight.shape[1] == k
    assert x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
    out = x.new_empty((t, n))
    pdl = pdl_enabled(x.device)
    _skinny_kernel[(triton.cdiv(n, shape.block_n),)](
        x, weight, bias if bias is not None else weight, out, t, n, x.stride(0),
        weight.stride(0), out.stride(0), K=k, HAS_BIAS=bias is not None, BLOCK_T=16,
        BLOCK_N=shape.block_n, BLOCK_K=shape.block_k, IEEE=x.dtype == torch.float32,
        num_warps=shape.num_warps, num_stages=shape.num_stages, PDL=pdl, **launch_options(pdl),
    )  # fmt: skip
    return out


def skinny_shape(n: int, k: int, itemsize: int = 2) -> SkinnyShape:
    """Tiles by the weight's size: the best of 18 per shape of the Llama-3.1-8B and -3.2-1B
    matrices at 1 and 8 tokens on an H200 (bench/results/gemv_NVIDIA_H200.json). Narrow
    matrices want more, smaller programs; wide ones, fewer pipeline stages. float32 weights
    take half as wide a K tile, so the staged tiles fit in shared memory."""
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
    t, k = x.shape
    shape = skinny_shape(weight.shape[0], k, weight.element_size())
    fits = 0 < t <= MAX_TOKENS and k % shape.block_k == 0 and x.dtype == weight.dtype
    if fits and x.stride(1) == 1 and weight.stride(1) == 1:
        return skinny_linear(x, weight, bias, shape)
    return F.linear(x, weight, bias)


def skinny_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)
