"""Skinny products with K split over programs (GPU): one product at 1 token per Llama-3.2-1B
and -3.1-8B matrix, each tile/split-K combination timed in a CUDA graph of 10 back-to-back PDL
launches, against `skinny_linear` with the rule of its day. The probe that chose
`skinny_shape`'s split for the 1B's down projection.

Usage: PYTHONPATH=. python bench/gemv_split_k_probe.py DIR
"""

import functools
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.gdc import launch_options, pdl_enabled, wait_then_release
from specdec.runner.gemv import skinny_linear, skinny_shape

dev = torch.device("cuda")


@triton.jit
def _splitk(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    T,
    N,
    stride_x,
    stride_w,
    stride_o,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    tok_ok = tokens < T
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + tl.where(col_ok, cols, 0).to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    KL: tl.constexpr = K // SPLIT_K
    wait_then_release(PDL)
    for k0 in range(pid_k * KL, pid_k * KL + KL, BLOCK_K):
        x = tl.load(x_rows + k0 + ks[None, :], mask=tok_ok[:, None], other=0.0)
        w = tl.load(w_rows + k0 + ks[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
    if SPLIT_K == 1:
        dst = out_ptr + tokens.to(tl.int64)[:, None] * stride_o + cols[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & col_ok[None, :])
    else:
        part = part_ptr + (pid_k * BLOCK_T + tokens)[:, None] * N + cols[None, :]
        tl.store(part, acc, mask=tok_ok[:, None] & col_ok[None, :])
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(
                    part_ptr + (s * BLOCK_T + tokens)[:, None] * N + cols[None, :],
                    mask=tok_ok[:, None] & col_ok[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )
            dst = out_ptr + tokens.to(tl.int64)[:, None] * stride_o + cols[None, :]
            tl.store(
                dst, total.to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & col_ok[None, :]
            )
            tl.atomic_xchg(count_ptr + pid_n, 0)


COUNT = torch.zeros(1 << 16, dtype=torch.int32, device=dev)


def splitk(x, w, bn, bk, warps, stages, split):
    n, k = w.shape
    out = x.new_empty((x.shape[0], n))
    part = torch.empty((split, 16, n), dtype=torch.float32, device=dev)
    pdl = pdl_enabled(dev)
    _splitk[(triton.cdiv(n, bn), split)](
        x,
        w,
        out,
        part,
        COUNT,
        x.shape[0],
        n,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        K=k,
        BLOCK_T=16,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SPLIT_K=split,
        PDL=pdl,
        num_warps=warps,
        num_stages=stages,
        **launch_options(pdl),
    )
    return out


def chain_time(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return do_bench(g.replay, warmup=20, rep=200, return_mode="median") * 1e3 / reps


res = {}
for name, n, k in (
    ("1B.qkv", 3072, 2048),
    ("1B.o", 2048, 2048),
    ("1B.down", 2048, 8192),
    ("1B.gate_up", 16384, 2048),
    ("8B.o", 4096, 4096),
    ("8B.down", 4096, 14336),
    ("8B.qkv", 6144, 4096),
):
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    floor = n * k * 2 / 4.25e12 * 1e6
    for t in (1,):
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
        ref = skinny_linear(x, w, None, skinny_shape(n, k))
        base = chain_time(functools.partial(skinny_linear, x, w, None, skinny_shape(n, k)))
        rows = []
        for bn, bk, warps, stages, split in itertools.product(
            (16, 32, 64), (128, 256, 512), (4,), (3, 5), (1, 2, 4, 8)
        ):
            if k % (bk * split) or (bk >= 512 and stages == 5 and bn == 64):
                continue
            try:
                out = splitk(x, w, bn, bk, warps, stages, split)
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                us = chain_time(functools.partial(splitk, x, w, bn, bk, warps, stages, split))
            except Exception as e:  # tiles that do not fit (shared memory): named, skipped
                print(f"{name} {(bn, bk, warps, stages, split)}: {type(e).__name__}", flush=True)
                continue
            rows.append((us, bn, bk, warps, stages, split, err))
        rows.sort()
        print(
            f"{name}: floor {floor:.1f} us, current {base:.2f} us; best:",
            [(round(r[0], 2), *r[1:6], f"{r[6]:.0e}") for r in rows[:4]],
            flush=True,
        )
        res[name] = {"floor": floor, "current": base, "best": rows[:8]}
Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
(Path(sys.argv[1]) / "exp_splitk.json").write_text(json.dumps(res, indent=1))
