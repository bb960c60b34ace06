"""Skinny products with K split over programs (GPU): one product at 1 token per Llama-3.2-1B
and -3.1-8B matrix, each tile/split-K combination timed in a CUDA graph of 10 back-to-back PDL
launches, against `gemv.linear` with the rule of its day ('current'). The probe that chose
`skinny_shape`'s split for the 1B's down projection (its committed results came from a
standalone prototype of the split kernel; the probe now drives the production kernel).

Usage: PYTHONPATH=. python bench/experiments/gemv_split_k_probe.py DIR
"""

import functools
import itertools
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from specdec.runner.gemv import SkinnyShape, linear, skinny_linear, split_counters

dev = torch.device("cuda")
COUNTERS = split_counters(dev)


def splitk(
    x: torch.Tensor, w: torch.Tensor, bn: int, bk: int, warps: int, stages: int, split: int
) -> torch.Tensor:
    """The production skinny kernel with this tile and split (`gemv.skinny_linear`)."""
    return skinny_linear(x, w, None, SkinnyShape(bn, bk, warps, stages, split), COUNTERS)


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
        ref = linear(x, w, None, COUNTERS)  # the runner's rule, split where it splits
        base = chain_time(functools.partial(linear, x, w, None, COUNTERS))
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
