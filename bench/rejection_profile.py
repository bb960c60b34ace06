"""Where the rejection sampler's time goes (GPU): per-kernel times from torch.profiler for the
headline case, and a plain streaming read of the same bytes as the stats kernel's ceiling.

Usage: python bench/rejection_profile.py --out DIR
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rejection_bench import copy_bandwidth, graph_time, make_inputs, out_dir
from target_service import kernels


@triton.jit
def _stream_kernel(a_ptr, b_ptr, out_ptr, V, split_size, BLOCK: tl.constexpr):
    """Reads a [rows, V] and b [rows, V] split the way _row_stats_kernel does; sums them."""
    row = tl.program_id(0)
    start = tl.program_id(1) * split_size
    end = tl.minimum(start + split_size, V)
    acc = tl.zeros((BLOCK,), tl.float32)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < end
        acc += tl.load(a_ptr + row.to(tl.int64) * V + offs, mask=mask, other=0.0)
        acc += tl.load(b_ptr + row.to(tl.int64) * V + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * tl.num_programs(1) + tl.program_id(1), tl.sum(acc, 0))


def profile(x: kernels.KernelInputs, shape: kernels.LaunchShape | None, label: str) -> str:
    run = lambda: kernels.rejection_sample_triton(x, shape)
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            run()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    return f"== {label}\n{table}\n"


def main() -> None:
    folder = out_dir()
    bandwidth = copy_bandwidth()
    report = [f"{torch.cuda.get_device_name()} copy bandwidth {bandwidth / 1e12:.2f} TB/s"]
    for batch, k in ((64, 4), (256, 8), (1, 4)):
        x, nbytes = make_inputs(batch, k, 128256, "dense")
        floor = nbytes / bandwidth * 1e6
        ms = graph_time(functools.partial(kernels.rejection_sample_triton, x))
        report.append(f"B={batch} k={k} dense: graph {ms * 1e3:.1f} us, floor {floor:.1f} us")
        report.append(profile(x, None, f"B={batch} k={k} V=128256 dense"))
        rows = x.row_req.shape[0]
        a = torch.randn(rows, 128256, device="cuda")
        b = torch.randn(rows, 128256, device="cuda")
        for block, warps in ((512, 4), (1024, 4), (1024, 8), (2048, 8)):
            shape = kernels.launch_shape(rows, batch, 128256, a.device, block, 8, warps)
            splits = triton.cdiv(128256, shape.stats_split)
            out = torch.empty(rows * splits, device="cuda")

            grid = (rows, splits)
            args_ = (a, b, out, 128256, shape.stats_split)
            stream = functools.partial(_stream_kernel[grid], *args_, BLOCK=block, num_warps=warps)
            t = do_bench(stream, warmup=25, rep=100, return_mode="median")
            gbps = 2 * a.numel() * 4 / (t * 1e-3) / 1e9
            report.append(f"  stream read block={block} warps={warps} splits={splits}: "
                          f"{t * 1e3:.1f} us, {gbps:.0f} GB/s")  # fmt: skip
    text = "\n".join(report)
    print(text)
    (folder / "rejection_profile.txt").write_text(text)


if __name__ == "__main__":
    main()
