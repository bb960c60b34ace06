"""Programmatic dependent launch (PDL) for the Triton kernels, on Hopper GPUs and later.

A kernel launched with PDL may start while the kernel before it on the stream is still running:
its programs get an SM as soon as one frees up, do the work that reads only inputs nobody else
writes (addresses, weights), and block in `gdc_wait()` until the previous grid has finished and
its writes are visible. The previous kernel calls `gdc_launch_dependents()` to let that happen
before it completes. This hides the gap and the ramp-up between two dependent launches, which
is most of the cost of the small kernels of a decode step.

The rule every PDL kernel here keeps: it calls `gdc_wait()` on every path, before it reads
anything an earlier kernel wrote and before it writes anything. Waiting is transitive (the
previous kernel waited on its own predecessor before it finished), so a kernel two launches
back is finished as well. `SPECDEC_PDL=0` in the environment turns PDL off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # absent from older Triton; the kernels reference these only under `if PDL:`
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

__all__ = [
    "PDL_MAX_TOKENS",
    "gdc_launch_dependents",
    "gdc_wait",
    "launch_options",
    "pdl_enabled",
    "wait_then_release",
]


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """A PDL kernel's entry: wait for the previous grid, then let the next one launch. In this
    order only: released before its own wait, each kernel would let its successor in while
    still waiting itself, and a chain of waiting programs would fill the SMs (the 8B decode
    step took 19% longer)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


PDL_MAX_TOKENS = 64  # the model's kernels use PDL in steps of at most this many tokens


def pdl_enabled(device: torch.device, tokens: int | None = None) -> bool:
    """True on a CUDA device of compute capability 9 or later with a Triton that has PDL,
    unless SPECDEC_PDL=0, and never under Triton's interpreter (TRITON_INTERPRET=1), which has
    no grid dependency control. A model kernel passes its step's token count: PDL pays where
    launches are short (decode and verify steps of a few requests) and cost time in wide steps
    (an H200, Llama-3.2-1B, same run: batch 8 x 5 tokens 1.277 -> 1.261 ms with PDL, batch
    64 x 1 1.532 -> 1.539, batch 32 x 5 1.662 -> 1.752, batch 64 x 5 2.423 -> 2.639; BENCHMARKS.md),
    so above PDL_MAX_TOKENS it is off."""
    off = os.environ.get("SPECDEC_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" or gdc_wait is None or off:
        return False
    if tokens is not None and tokens > PDL_MAX_TOKENS:
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(pdl: bool) -> dict[str, bool]:
    """Extra keyword arguments of a Triton launch: launch_pdl only where PDL is on (older
    Triton does not know the option)."""
    return {"launch_pdl": True} if pdl else {}
