"""Skinny matrix products for decode and verify steps (a few tokens times a weight matrix), next
to the torch reference of the same function.

At one to sixteen tokens a linear layer is a read of its weight matrix: y [T, N] = x [T, K] @
W[N, K]^T costs N * K * 2 bytes and almost no arithmetic. cuBLAS picks split-K kernels for the
narrower matrices of a decode step (the 8B's o_proj and down_proj, every matrix of a 1B), and
each split-K product is two launches (the product, then a reduction) that reach 63-87% of the
copy bandwidth on an H200 (bench/results/runner_profile_*.txt). Here one program owns BLOCK_N
output columns for all T tokens and walks K with software-pipelined loads (num_stages), so a
product is one launch and each weight byte is read once. Where K is long and N narrow (the 1B's
down projection) K is split over a few programs per column block, and the last of them to finish
adds the partial sums in split order: still one launch, and the sums stay deterministic (the
same inputs give the same bits on every call, whatever the other rows of the batch).

Example: T = 1, N = 4096, K = 4096, BLOCK_N = 16: 256 programs, each reading a 16 x 4096 slab
of W (128 KiB) in BLOCK_K-wide tiles; x's 1 x BLOCK_K tile is padded to 16 rows for tl.dot.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    part_ptr,  # [SPLIT_K, BLOCK_T, N] float32 scratch (SPLIT_K > 1)
    count_ptr,  # [>= N / BLOCK_N] int32, zero between launches (SPLIT_K > 1)
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
    SPLIT_K: tl.constexpr,  # programs per column block, each over K / SPLIT_K
    IEEE: tl.constexpr,  # float32 inputs: exact float32 products, not TF32
    PDL: tl.constexpr,  # programmatic dependent launch (specdec/gdc.py)
):
    block = tl.program_id(0)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    tok_ok = tokens < T
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + tl.where(col_ok, cols, 0).to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    K_SPLIT: tl.constexpr = K // SPLIT_K
    k_start = tl.program_id(1) * K_SPLIT
    wait_then_release(PDL)  # nothing before this reads or writes what other kernels touch
    for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):  # K % (SPLIT_K * BLOCK_K) == 0
        x = tl.load(x_rows + k0 + ks[None, :], mask=tok_ok[:, None], other=0.0)
        w = tl.load(w_rows + k0 + ks[None, :])
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    ok = tok_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        # Each split stores its partial sums; the block's last split to finish (a counter with
        # acquire-release order, the split-K semaphore pattern) adds them in split order, so
        # the sum does not depend on which finished first, then zeroes the counter.
        parts = part_ptr + tokens[:, None] * N + cols[None, :]
        tl.store(parts + tl.program_id(1) * BLOCK_T * N, acc, mask=ok)
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + block, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
            for split in tl.static_range(SPLIT_K):
                acc += tl.load(
                    parts + split * BLOCK_T * N, mask=ok, other=0.0, cache_modifier=".cg"
                )
            _store_out(acc, bias_ptr, out_ptr, cols, tokens, col_ok, ok, stride_o, HAS_BIAS)
            tl.atomic_xchg(count_ptr + block, 0)
    else:
        _store_out(acc, bias_ptr, out_ptr, cols, tokens, col_ok, ok, stride_o, HAS_BIAS)


@triton.jit
def _store_out(acc, bias_ptr, out_ptr, cols, tokens, col_ok, ok, stride_o, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + tokens.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True, slots=True)
class SkinnyShape:
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1  # > 1: K split over as many programs per column block, summed in order


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    shape: SkinnyShape | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) by the skinny kernel: x [T, K] with 1 <= T <= MAX_TOKENS,
    K a multiple of shape.block_k * shape.split_k, unit inner strides. A split shape needs
    int32 `counters` (one per BLOCK_N columns, zero, left zero; see `split_counters`); without
    them a zeroed set is made for this call."""
    shape = shape or SkinnyShape()
    t, k = x.shape
    n = weight.shape[0]
    assert 0 < t <= MAX_TOKENS and k % (shape.block_k * shape.split_k) == 0
    assert weight.shape[1] == k and x.dtype == weight.dtype
    assert x.stride(1) == 1 and weight.stride(1) == 1
    out = x.new_empty((t, n))
    blocks = triton.cdiv(n, shape.block_n)
    split = shape.split_k
    if split > 1 and counters is None:
        counters = torch.zeros(blocks, dtype=torch.int32, device=x.device)
    assert counters is None or (counters.numel() >= blocks and counters.dtype == torch.int32)
    parts = torch.empty((split, 16, n), dtype=torch.float32, device=x.device) if split > 1 else out
    pdl = pdl_enabled(x.device, t)
    _skinny_kernel[(blocks, split)](
        x, weight, bias if bias is not None else weight, out, parts,
        counters if counters is not None else out, t, n, x.stride(0), weight.stride(0),
        out.stride(0), K=k, HAS_BIAS=bias is not None, BLOCK_T=16, BLOCK_N=shape.block_n,
        BLOCK_K=shape.block_k, SPLIT_K=split, IEEE=x.dtype == torch.float32,
        num_warps=shape.num_warps, num_stages=shape.num_stages, PDL=pdl, **launch_options(pdl),
    )  # fmt: skip
    return out


SPLIT_COUNTERS = 4096  # column blocks a model's split products may use


def split_counters(device: torch.device) -> torch.Tensor:
    """Zeroed counters for the split products of one model (`linear(..., counters=)`). Each
    launch leaves them zero (the last split of a column block zeroes its own), so one set
    serves every product of the model's steps, eager or graphed, as long as two of its
    products never run at the same time on different streams."""
    return torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)


def skinny_shape(n: int, k: int, itemsize: int = 2, split: bool = True) -> SkinnyShape:
    """Tiles by the weight's size: the best of 18 per shape of the Llama-3.1-8B and -3.2-1B
    matrices at 1 and 8 tokens on an H200 (bench/results/gemv_NVIDIA_H200.json). Narrow
    matrices want more, smaller programs; wide ones, fewer pipeline stages. A narrow matrix with
    a long K (the 1B's down projection, 2048 x 8192) splits K over 4 programs per 64 columns:
    11.8 -> 9.1 us in a graph of PDL launches (bench/results/gemv_split_k_NVIDIA_H200.json).
    float32 weights take half as wide a K tile, so the staged tiles fit in shared memory.
    split=False: the best tile without splitting K (for a caller without split counters)."""
    if split and n <= 2048 and k >= 8192 and k % 1024 == 0:
        shape = SkinnyShape(64, 256, 4, 3, split_k=4)
    elif n <= 2048 and k % 512 == 0:
        shape = SkinnyShape(16, 512, 4, 5)
    elif n <= 4096:
        shape = SkinnyShape(32, 256, 4, 5)
    elif n < 16384:
        shape = SkinnyShape(64, 256, 4, 3)
    else:
        shape = SkinnyShape(64, 128, 4, 3)
    if itemsize == 4:
        shape = replace(shape, block_k=shape.block_k // 2)
    return shape


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """The runner's linear layer on CUDA: the skinny kernel for decode and verify steps (up to
    MAX_TOKENS rows), cuBLAS for wider batches and for shapes the kernel does not take. Split
    shapes are used only with the model's `counters` (`split_counters`), unsplit otherwise."""
    t, k = x.shape
    n = weight.shape[0]
    shape = skinny_shape(n, k, weight.element_size())
    if shape.split_k > 1 and (counters is None or counters.numel() < triton.cdiv(n, shape.block_n)):
        shape = skinny_shape(n, k, weight.element_size(), split=False)
    fits = 0 < t <= MAX_TOKENS and k % shape.block_k == 0 and x.dtype == weight.dtype
    if fits and x.stride(1) == 1 and weight.stride(1) == 1:
        return skinny_linear(x, weight, bias, shape, counters)
    return F.linear(x, weight, bias)


def skinny_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)
