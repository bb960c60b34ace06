"""The fused pointwise kernels against their torch references in float64 (Triton's interpreter
on the CPU), on odd shapes, and the whole runner on the kernels against transformers."""

import functools

import pytest
import torch

from specdec.runner.fused import (
    add_rms_norm,
    add_rms_norm_reference,
    rope_store,
    rope_store_reference,
    silu_mul,
    silu_mul_reference,
)
from specdec.runner.gemv import (
    SkinnyShape,
    linear,
    skinny_linear,
    skinny_linear_reference,
    skinny_shape,
    split_counters,
)
from tests.specdec._runner_models import FAMILIES, hf_model
from tests.specdec.test_runner_parity import assert_ragged_then_graph_step, make_runner

# max |out - ref| / max |ref| against the float64 reference, per input dtype. bf16/fp16 follow
# transformers' rounding order, which a float64 reference does not round at all: a few ulps.
REL_TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}
# Products over K up to 8192 add float32 rounding in the sums: ~sqrt(K) ulps (cuBLAS alike).
MATMUL_TOL = {torch.float32: 3e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _dtypes(device: torch.device) -> list[torch.dtype]:
    return [torch.float32] + ([torch.bfloat16, torch.float16] if device.type == "cuda" else [])


def _close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, tol: dict = REL_TOL
) -> None:
    assert out.dtype == dtype and out.shape == ref.shape, what
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < tol[dtype], f"{what} {dtype}: relative error {err:.2e}"


@pytest.mark.parametrize(("t", "n", "with_delta"), [(1, 64, True), (7, 100, True), (3, 48, False)])
def test_add_rms_norm_matches_reference(
    t: int, n: int, with_delta: bool, device: torch.device
) -> None:
    g = torch.Generator().manual_seed(t * n)
    x, delta = torch.randn(2, t, n, generator=g) * 3
    w = torch.randn(n, generator=g)
    for dtype in _dtypes(device):
        args = [y.to(device, dtype) for y in (x, delta, w)]
        d = args[1] if with_delta else None
        h, res = add_rms_norm(args[0], d, args[2], 1e-5)
        ref_h, ref_res = add_rms_norm_reference(
            args[0].double(), None if d is None else d.double(), args[2].double(), 1e-5
        )
        _close(h, ref_h, dtype, "normed")
        _close(res, ref_res, dtype, "residual")


@pytest.mark.parametrize(("t", "inter"), [(1, 96), (5, 1500)])  # 1500: two blocks, a ragged one
def test_silu_mul_matches_reference(t: int, inter: int, device: torch.device) -> None:
    gate_up = torch.randn(t, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    for dtype in _dtypes(device):
        x = gate_up.to(device, dtype)
        _close(silu_mul(x), silu_mul_reference(x.double()), dtype, "silu_mul")


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "qk_norm"),
    [(4, 2, 32, False), (6, 1, 80, True), (3, 3, 12, False)],  # 80, 12: D / 2 not a power of 2
)
def test_rope_store_matches_reference(
    heads: int, kv_heads: int, d: int, qk_norm: bool, device: torch.device
) -> None:
    g = torch.Generator().manual_seed(heads * d)
    t, slots, max_len = 5, 4, 40
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    angle = torch.rand(t, d // 2, generator=g) * 6
    cos, sin = torch.cat((angle, angle), 1).cos(), torch.cat((angle, angle), 1).sin()
    norms = torch.randn(2, d, generator=g) if qk_norm else None
    token_slot = torch.tensor([3, 3, 0, 2, 3])  # 3: the scratch slot, written twice
    positions = torch.tensor([39, 38, 0, 17, 5])  # the last position of a slot too
    for dtype in _dtypes(device):
        cache = torch.randn(slots, 2, kv_heads, max_len, d, generator=g).to(device, dtype)
        ref_cache = cache.double()
        x, c, s = (y.to(device, dtype) for y in (qkv, cos, sin))
        qn, kn = (None, None) if norms is None else norms.to(device, dtype)
        idx = token_slot.to(device), positions.to(device)
        reference = functools.partial(  # the same inputs in float64, the same cache
            rope_store_reference,
            x.double(),
            c.double(),
            s.double(),
            None if qn is None else qn.double(),
            None if kn is None else kn.double(),
            1e-6,
            ref_cache,
        )
        q = rope_store(x, c, s, qn, kn, 1e-6, cache, *idx)
        _close(q, reference(*idx), dtype, "q")
        one_slot = torch.tensor([2], device=device).expand(t)  # stride 0, as at batch 1
        q1 = rope_store(x, c, s, qn, kn, 1e-6, cache, one_slot, idx[1])
        _close(q1, reference(one_slot, idx[1]), dtype, "q (one slot)")
        _close(cache, ref_cache, dtype, "cache")  # the new K/V, and nothing else moved
        untouched = torch.ones(slots, max_len, dtype=torch.bool)
        untouched[token_slot, positions] = False
        untouched[2, positions] = False
        assert torch.equal(
            cache.transpose(1, 3)[untouched.to(device)].double(),
            ref_cache.transpose(1, 3)[untouched.to(device)],
        )


@pytest.mark.parametrize(
    ("t", "n", "k", "bias", "shape"),
    [
        (1, 50, 512, True, SkinnyShape(16, 128)),  # n not a multiple of BLOCK_N
        (5, 64, 256, False, SkinnyShape(32, 256)),  # a verify step: k + 1 = 5 tokens
        (16, 33, 1024, True, SkinnyShape(64, 256, 4, 2)),  # MAX_TOKENS rows
        (1, 50, 512, True, SkinnyShape(16, 64, 4, 2, split_k=4)),  # K split, partials summed
        (5, 33, 1024, False, SkinnyShape(32, 128, 4, 3, split_k=2)),
    ],
)
def test_skinny_linear_matches_reference(
    t: int, n: int, k: int, bias: bool, shape: SkinnyShape, device: torch.device
) -> None:
    g = torch.Generator().manual_seed(t * n + k)
    x, w = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    for dtype in _dtypes(device):
        xd, wd = x.to(device, dtype), w.to(device, dtype)
        bd = None if b is None else b.to(device, dtype)
        out = skinny_linear(xd, wd, bd, shape)
        ref = skinny_linear_reference(xd.double(), wd.double(), None if bd is None else bd.double())
        _close(out, ref, dtype, "skinny_linear", MATMUL_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(2048, 8192), (4096, 4096), (6144, 4096), (16384, 2048)])
def test_skinny_shapes_fit_in_shared_memory(
    n: int, k: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Each tile rule of skinny_shape compiles and runs within a Hopper's 227 KiB of shared
    memory per program, float32 included (the interpreter has no shared memory: GPU only)."""
    shape = skinny_shape(n, k, torch.tensor([], dtype=dtype).element_size())
    g = torch.Generator(device).manual_seed(n)
    x = torch.randn(3, k, device=device, generator=g).to(dtype)
    w = (torch.randn(n, k, device=device, generator=g) / k**0.5).to(dtype)
    out = skinny_linear(x, w, None, shape)
    _close(out, skinny_linear_reference(x.double(), w.double()), dtype, f"{shape}", MATMUL_TOL)


def test_split_k_is_deterministic_and_leaves_its_counters_at_zero(device: torch.device) -> None:
    """The last split of a column block adds the partials in split order: the same bits on
    every call and for a row alone or among others, and the counters are ready for the next."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(6, 1024, generator=g).to(device), torch.randn(70, 1024, generator=g)
    w = (w / 32).to(device)
    shape = SkinnyShape(16, 128, 4, 2, split_k=4)
    counters = split_counters(device)
    first = skinny_linear(x, w, None, shape, counters)
    assert torch.equal(first, skinny_linear(x, w, None, shape, counters))
    assert torch.equal(first[2:3], skinny_linear(x[2:3], w, None, shape, counters))
    assert torch.equal(first, skinny_linear(x, w, None, shape))  # a zeroed set of its own
    assert not counters.any()
    # the rule splits the 1B's down projection (2048 x 8192), with the model's counters only:
    # here a narrow slice of that shape
    assert skinny_shape(2048, 8192).split_k == 4
    assert skinny_shape(2048, 8192, split=False) == SkinnyShape(16, 512, 4, 5)
    x_long = torch.randn(2, 8192, generator=g).to(device)
    w_long = torch.randn(20, 8192, generator=g).to(device) / 90
    ref = skinny_linear_reference(x_long.double(), w_long.double())
    for c in (counters, None):
        _close(linear(x_long, w_long, counters=c), ref, torch.float32, "linear", MATMUL_TOL)
    assert not counters.any()


def test_linear_takes_cublas_beyond_the_skinny_shapes(device: torch.device) -> None:
    """More than MAX_TOKENS rows, or a K the tiles do not divide: F.linear's own answer."""
    g = torch.Generator().manual_seed(3)
    for t, k in ((17, 512), (2, 100)):
        x, w = torch.randn(t, k, generator=g).to(device), torch.randn(40, k, generator=g).to(device)
        assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel path is the default on CUDA")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_runner_on_kernels_matches_transformers(family: str) -> None:
    model = hf_model(family)
    runner = make_runner(model)
    runner._backend._kernel = True  # type: ignore[union-attr]  # CUDA-only paths, interpreted
    runner._backend.model.use_kernels(True)  # type: ignore[union-attr]
    assert_ragged_then_graph_step(model, runner)
