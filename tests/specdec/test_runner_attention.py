"""The split-KV decode kernel against its float64 torch reference (Triton's interpreter on the
CPU), and the runner's kernel path against transformers."""

import pytest
import torch

from specdec.runner.decode_attention import (
    decode_attention,
    decode_attention_reference,
    num_splits,
)
from tests.specdec._runner_models import FAMILIES, hf_model
from tests.specdec.test_runner_parity import assert_ragged_then_graph_step, make_runner

# ‖out - ref‖ / ‖ref‖ against the float64 reference, per input dtype (fp32: IEEE dots)
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _case(group: int, head_dim: int, n: int, ragged: bool, dtype: torch.dtype, seed: int, dev):
    g = torch.Generator().manual_seed(seed)
    kv_heads, max_len = 2, 200
    cache = torch.randn(6, 2, kv_heads, max_len, head_dim, generator=g).to(dtype)
    starts = torch.tensor([37, 0, 130, 63])  # none a multiple of the 64-key block but 0
    slots = torch.tensor([3, 0, 5, 1])
    counts = [n, 1, n, max(1, n - 2)] if ragged else [n] * 4
    cu_q = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    q = torch.randn(int(cu_q[-1]), kv_heads * group, head_dim, generator=g).to(dtype)
    return *(x.to(dev) for x in (q, cache, slots, starts, cu_q)), max(counts)


@pytest.mark.parametrize(
    ("group", "head_dim", "n", "ragged", "window"),
    [
        (1, 64, 1, False, None),
        (4, 128, 1, True, None),
        (8, 64, 5, True, None),
        (4, 64, 5, False, 7),
        (1, 128, 5, True, 40),
        (8, 80, 3, True, None),  # head_dim not a power of two
    ],
)
def test_kernel_matches_reference(
    group: int, head_dim: int, n: int, ragged: bool, window: int | None, device: torch.device
) -> None:
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    for dtype in dtypes:
        q, cache, slots, starts, cu_q, n_max = _case(group, head_dim, n, ragged, dtype, 3, device)
        ref = decode_attention_reference(q, cache, slots, starts, cu_q, window)
        for splits in (1, num_splits(4, 2, 200, device)):  # one range and several
            out = decode_attention(q, cache, slots, starts, cu_q, n_max, window, splits)
            assert out.dtype == dtype and out.shape == ref.shape
            assert torch.isfinite(out).all()  # every element written (empty holds garbage)
            err = (out.double() - ref).norm() / ref.norm()
            assert err < REL_TOL[dtype], f"{dtype}, splits={splits}: relative error {err:.2e}"


def _paged(cache: torch.Tensor, slots: torch.Tensor, page: int, seed: int):
    """The same keys and values in a paged cache: each request's slot cut into blocks of
    `page` positions, the blocks scattered over the pool in a random order; (cache, tables)."""
    b, max_len = slots.shape[0], cache.shape[3]
    width = -(-max_len // page)
    padded = torch.nn.functional.pad(cache, (0, 0, 0, width * page - max_len))
    # [B, 2, kvh, width, page, D] -> blocks [B * width, 2, kvh, page, D]
    blocks = padded[slots].unflatten(3, (width, page)).permute(0, 3, 1, 2, 4, 5).flatten(0, 1)
    order = torch.randperm(b * width + 3, generator=torch.Generator().manual_seed(seed))
    pool = torch.randn(b * width + 3, *blocks.shape[1:]).to(cache.dtype)  # 3 blocks unused
    pool[order[: b * width]] = blocks
    return pool.to(cache.device), order[: b * width].view(b, width).to(cache.device)


@pytest.mark.parametrize(("page", "n", "window"), [(16, 1, None), (64, 5, None), (7, 5, 40)])
def test_paged_kernel_reads_the_blocks_a_table_names(
    page: int, n: int, window: int | None, device: torch.device
) -> None:
    q, cache, slots, starts, cu_q, n_max = _case(4, 64, n, True, torch.float32, 5, device)
    ref = decode_attention_reference(q, cache, slots, starts, cu_q, window)
    pool, tables = _paged(cache, slots, page, 9)
    paged_ref = decode_attention_reference(q, pool, tables, starts, cu_q, window, page)
    assert torch.equal(paged_ref, ref)
    for splits in (1, num_splits(4, 2, 200, device)):
        out = decode_attention(q, pool, tables, starts, cu_q, n_max, window, splits, page)
        err = (out.double() - ref).norm() / ref.norm()
        assert err < REL_TOL[torch.float32], f"splits={splits}: relative error {err:.2e}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel path is the default on CUDA")
def test_kernel_path_matches_transformers() -> None:
    model = hf_model("mistral")  # GQA 4:1 and a sliding window of 6
    runner = make_runner(model)
    runner._backend._kernel = True  # type: ignore[union-attr]  # CUDA-only path, interpreted
    assert_ragged_then_graph_step(model, runner)


def test_mask_path_never_runs_cudnn_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every SDPA call of a forward (prefill, ragged and equal steps) runs with cuDNN's backend
    off: cuDNN builds an execution plan per new shape, seconds for a long prompt the first time
    (attention.SDPA_BACKENDS), and served prompts have every length. The global flag is as it
    was afterwards."""
    from specdec.runner import ForwardItem, attention

    seen: list[bool] = []
    sdpa = attention.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    runner = make_runner(hf_model(next(iter(FAMILIES))))
    runner.add_request("a")
    runner.forward([ForwardItem("a", list(range(1, 30)), 1)])
    runner.graph_step(["a"], torch.tensor([[5, 6]]))
    assert seen and not any(seen), seen
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
