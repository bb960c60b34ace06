"""Compiled kernels on a GPU at sizes the interpreter cannot reach."""

from __future__ import annotations

import pytest
import torch

from specdec.runner.runner import on_device
from tests.target_service.helpers import random_batch
from tests.target_service.test_rejection_exactness import (
    P_NEXT,
    PLAIN,
    P,
    Q,
    chi2_pvalue,
    run_trials,
)
from tests.target_service.test_rejection_kernels import assert_same, ks, run_both

pytestmark = pytest.mark.gpu
# the kernels on the first GPU and, where there is one, on another (a target placed on cuda:1)
DEVICES = [
    "cuda:0",
    pytest.param("cuda:1", marks=pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs two GPUs")),
]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_form", ["dense", "sparse", "none"])
def test_large_batches_equal_reference(q_form: str, device: str) -> None:
    b = random_batch(ks(256, 8, 1), 151936, q_form, seed=4, greedy_fraction=0.2, support=64)
    with on_device(torch.device(device)):  # as the target's engine runs its sampler
        ref, tri = run_both(b, torch.device(device))
    assert tri.token_ids.device == torch.device(device)
    differ = (ref.token_ids != tri.token_ids).any(dim=1).nonzero().flatten().tolist()
    detail = [
        (i, int(b.k[i]), b.params[i], ref.token_ids[i].tolist(), tri.token_ids[i].tolist())
        for i in differ[:3]
    ]
    assert not differ, f"{len(differ)} of 256 requests differ: {detail}"
    assert_same(ref, tri)


@pytest.mark.parametrize("q_form", ["dense", "none"])
def test_compiled_kernels_adversarial_chi_square_200k(q_form: str) -> None:
    out, _ = run_trials([P.log(), P_NEXT.log()], [Q], q_form, PLAIN, 200_000, "triton", "cuda")
    assert chi2_pvalue(out.token_ids[:, 0].cpu(), P.double()) > 1e-3
    second = out.token_ids[out.accepted[:, 0], 1].cpu()
    assert chi2_pvalue(second, P_NEXT.double()) > 1e-3
