"""Where the rejection sampler's time goes (GPU): per-kernel times from torch.profiler for the
headline case, and the streaming-read ceiling of a pass like the stats kernel's: a plain
reduction over the same [rows, V] float32 logits, with plain loads (software-pipelined by
`tl.range` at 1-4 stages) and with Hopper TMA descriptor loads.

Usage: python bench/experiments/rejection_profile.py --out DIR
"""

from __future__ import annotations

import functools
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rejection_bench import copy_bandwidth, graph_time, make_inputs, out_dir
from specdec.gdc import pdl_enabled
from target_service import kernels


@triton.jit
def _stream_kernel(x_ptr, out_ptr, V, split_size, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Sums each vocabulary split of x [rows, V], split the way _row_stats_kernel does."""
    row = tl.program_id(0)
    start = tl.program_id(1) * split_size
    end = tl.minimum(start + split_size, V)
    acc = tl.zeros((BLOCK,), tl.float32)
    for off in tl.range(start, end, BLOCK, num_stages=STAGES):
        offs = off + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row.to(tl.int64) * V + offs, mask=offs < end, other=0.0)
    tl.store(out_ptr + row * tl.num_programs(1) + tl.program_id(1), tl.sum(acc, 0))


@triton.jit
def _stream_tma_kernel(desc, out_ptr, V, split_size, R: tl.constexpr, BLOCK: tl.constexpr,
                       STAGES: tl.constexpr):  # fmt: skip
    """The same sums through a TMA descriptor, R rows per program."""
    r0 = tl.program_id(0) * R
    start = tl.program_id(1) * split_size
    end = tl.minimum(start + split_size, V)
    acc = tl.zeros((R, BLOCK), tl.float32)
    for off in tl.range(start, end, BLOCK, num_stages=STAGES):
        acc += desc.load([r0, off])
    rows = r0 + tl.arange(0, R)
    tl.store(out_ptr + rows * tl.num_programs(1) + tl.program_id(1), tl.sum(acc, 1))


def stream_ceiling(rows: int, vocab: int, bandwidth: float) -> list[str]:
    """Best streaming-read time of a [rows, vocab] float32 tensor over a small grid of shapes."""
    x = torch.randn(rows, vocab, device="cuda")
    nbytes = x.numel() * 4
    expected = x.sum(1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results: list[tuple[float, str]] = []

    def timed(label: str, fn: object, splits: int) -> None:
        assert callable(fn)
        fn()
        torch.cuda.synchronize()
        got = out[: rows * splits].view(rows, splits).sum(1)
        assert torch.allclose(got, expected, rtol=1e-3, atol=1e-2), label
        results.append((do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3, label))

    def splits_for(programs: int, per_sm: int, block: int) -> tuple[int, int]:
        n = max(1, min(triton.cdiv(per_sm * sms, programs), 256))
        size = triton.cdiv(triton.cdiv(vocab, n), block) * block
        return triton.cdiv(vocab, size), size

    out = torch.empty(rows * 256, device="cuda")
    for block, warps, per_sm, stages in itertools.product((512, 1024, 2048), (4, 8), (4, 8),
                                                          (1, 2, 4)):  # fmt: skip
        n, size = splits_for(rows, per_sm, block)
        fn = functools.partial(_stream_kernel[(rows, n)], x, out, vocab, size, BLOCK=block,
                               STAGES=stages, num_warps=warps)  # fmt: skip
        timed(f"plain loads block={block} warps={warps} per_sm={per_sm} stages={stages}", fn, n)
    if pdl_enabled(x.device):  # Hopper: TMA as well
        from triton.tools.tensor_descriptor import TensorDescriptor

        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                     device="cuda"))  # fmt: skip
        for r, per_sm, stages in itertools.product((2, 4, 8), (8, 16), (2, 3, 4)):
            if rows % r:
                continue
            desc = TensorDescriptor.from_tensor(x, [r, 256])
            n, size = splits_for(rows // r, per_sm, 256)
            fn = functools.partial(_stream_tma_kernel[(rows // r, n)], desc, out, vocab, size,
                                   R=r, BLOCK=256, STAGES=stages, num_warps=4)  # fmt: skip
            timed(f"TMA rows={r} box=256 per_sm={per_sm} stages={stages}", fn, n)
    results.sort()
    torch_us = do_bench(lambda: x.sum(1), warmup=25, rep=200, return_mode="median") * 1e3
    copy_us = nbytes / bandwidth * 1e6
    lines = [f"  streaming read of [{rows}, {vocab}] float32 ({nbytes / 1e6:.0f} MB; at copy "
             f"bandwidth {copy_us:.1f} us), best of {len(results)} shapes:"]  # fmt: skip
    for us, label in results[:5]:
        lines.append(f"    {us:.1f} us = {nbytes / us / 1e6:.2f} TB/s  {label}")
    best_tma = next((r for r in results if r[1].startswith("TMA")), None)
    if best_tma:
        lines.append(f"    best TMA: {best_tma[0]:.1f} us  {best_tma[1]}")
    lines.append(f"    torch x.sum(1): {torch_us:.1f} us")
    return lines


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
        report.extend(stream_ceiling(x.row_req.shape[0], 128256, bandwidth))
    text = "\n".join(report)
    print(text)
    (folder / "rejection_profile.txt").write_text(text)


if __name__ == "__main__":
    main()
