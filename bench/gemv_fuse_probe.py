import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.gdc import launch_options, pdl_enabled
from specdec.runner import fused
from specdec.runner.gemv import GATED, NORMED, PLAIN, _skinny_kernel, skinny_shape

dev = torch.device("cuda")
res = {}


def launch(x, w, shape, prologue, delta=None, nw=None, out_res=None):
    n, k = w.shape
    out = x.new_empty((x.shape[0], n))
    pdl = pdl_enabled(dev)
    return _skinny_kernel[(triton.cdiv(n, shape.block_n),)](
        x,
        w,
        w,
        out,
        delta if delta is not None else x,
        nw if nw is not None else w,
        out_res if out_res is not None else out,
        1e-5,
        x.shape[0],
        n,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        delta.stride(0) if delta is not None else 0,
        K=k,
        HAS_BIAS=False,
        BLOCK_T=16,
        BLOCK_N=shape.block_n,
        BLOCK_K=shape.block_k,
        IEEE=False,
        PROLOGUE=prologue,
        HAS_DELTA=delta is not None,
        num_warps=shape.num_warps,
        num_stages=shape.num_stages,
        PDL=pdl,
        **launch_options(pdl),
    )


for name, n, k in (
    ("1B.qkv", 3072, 2048),
    ("1B.gate_up", 16384, 2048),
    ("1B.down", 2048, 8192),
    ("8B.qkv", 6144, 4096),
):
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    shape = skinny_shape(n, k)
    for t in (1, 5):
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
        d = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
        nw = torch.rand(k, device=dev, dtype=torch.bfloat16)
        r = torch.empty_like(x)
        gu = torch.randn(t, 2 * k, device=dev, dtype=torch.bfloat16)
        row = {}
        for label, fn in (
            ("plain", lambda: launch(x, w, shape, PLAIN)),
            ("normed", lambda: launch(x, w, shape, NORMED, d, nw, r)),
            ("normed_nodelta", lambda: launch(x, w, shape, NORMED, None, nw, None)),
            ("gated", lambda: launch(gu, w, shape, GATED)),
            (
                "sep_norm+plain",
                lambda: (fused.add_rms_norm(x, d, nw, 1e-5), launch(x, w, shape, PLAIN)),
            ),
            ("sep_silu+plain", lambda: (fused.silu_mul(gu), launch(x, w, shape, PLAIN))),
        ):
            kern = fn()
            ms = do_bench(fn, warmup=20, rep=200, return_mode="median")
            regs = (
                (getattr(kern, "n_regs", None), getattr(kern, "n_spills", None))
                if not isinstance(kern, tuple)
                else None
            )
            row[label] = (round(ms * 1e3, 2), regs)
        print(name, shape, "T", t, row, flush=True)
        res[f"{name} T{t}"] = row
Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
(Path(sys.argv[1]) / "exp_fuse.json").write_text(json.dumps(res, indent=1))
