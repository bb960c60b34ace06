"""Skinny matmul benchmark (GPU): the runner's Triton kernel (`specdec.runner.gemv`) against
cuBLAS (F.linear) on the Llama-3.1-8B and Llama-3.2-1B weight shapes at 1 and 8 tokens, over 18
tile shapes, against the memory floor (weight bytes / measured copy bandwidth).

Each timing is a CUDA graph of one product per weight copy, with enough copies (>= 300 MB) that
no weight is served from the 50 MB L2, as in a real step where every layer has its own weights.
Usage: python bench/gemv_bench.py --out DIR
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rejection_bench import copy_bandwidth, out_dir
from specdec.runner.gemv import SkinnyShape, skinny_linear, skinny_shape

SHAPES = {  # name: (N, K) of W [N, K]
    "8B.qkv": (6144, 4096), "8B.o": (4096, 4096), "8B.gate_up": (28672, 4096),
    "8B.down": (4096, 14336), "8B.lm_head": (128256, 4096),
    "1B.qkv": (3072, 2048), "1B.o": (2048, 2048), "1B.gate_up": (16384, 2048),
    "1B.down": (2048, 8192), "1B.lm_head": (128256, 2048),
}  # fmt: skip
TILES = [
    SkinnyShape(n, k, 4, stages)
    for n, k, stages in itertools.product((16, 32, 64), (128, 256, 512), (3, 5))
    if n * k * stages <= 64 * 512 * 3  # larger ones exceed shared memory
]


def graph_us(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
    """Microseconds per product: one CUDA graph of one call per weight copy, replayed."""
    for w in weights[:2]:
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    return do_bench(graph.replay, warmup=10, rep=50, return_mode="median") * 1e3 / len(weights)


def main() -> None:
    out = out_dir()
    bandwidth = copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-300_000_000 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for t in (1, 8):
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            floor = n * k * 2 / bandwidth * 1e6
            cublas = graph_us(functools.partial(F.linear, x), weights)
            tiles = {}
            for tile in TILES:
                if k % tile.block_k == 0:
                    run = functools.partial(skinny_linear, x, bias=None, shape=tile)
                    tiles[str(tile)] = graph_us(run, weights)
            chosen = skinny_shape(n, k)
            rule = tiles[str(chosen)]
            rows.append({"shape": name, "n": n, "k": k, "tokens": t, "floor_us": floor,
                         "cublas_us": cublas, "rule_tile": str(chosen), "rule_us": rule,
                         "tiles_us": tiles})  # fmt: skip
            print(f"{name} T={t}: floor {floor:.1f} us, cuBLAS {cublas:.1f} "
                  f"({cublas / floor:.2f}x), skinny {rule:.1f} ({rule / floor:.2f}x) with "
                  f"{chosen}, best tile {min(tiles.values()):.1f}", flush=True)  # fmt: skip
        del weights
        torch.cuda.empty_cache()
    report = {"gpu": gpu, "copy_bandwidth_Bps": bandwidth, "torch": torch.__version__, "rows": rows}
    (out / f"gemv_{gpu.replace(' ', '_')}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
