"""`host=`: what the caller knows on the host replaces every device read in the sampler's
preparation. The outputs are those of the call that reads the tensors, and on a GPU the
preparation and the kernels run without one device→host synchronisation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.sampling_params import SamplingParams
from target_service.logits_processing import logit_thresholds
from target_service.rejection_sampler import (
    HostShape,
    RequestSampling,
    SamplerOutput,
    SyntheticAcceptance,
    rejection_sample,
)
from tests.target_service.helpers import Batch, random_batch

K = [3, 0, 2, 1, 4, 2]


def batch(q_form: str, seed: int = 3) -> Batch:
    """Mixed greedy, top-k, top-p and plain rows, with a k = 0 request."""
    b = random_batch(K, 97, q_form, seed=seed, greedy_fraction=0.3, support=8)
    b.params[1] = SamplingParams(temperature=0.9, top_k=5, top_p=0.8, seed=11)
    b.params[3] = SamplingParams(temperature=0.0, top_k=3, seed=12)  # greedy ignores top-k
    b.sampling = RequestSampling.from_params(b.params, b.positions, b.logits.device)
    return b


def host_of(b: Batch) -> HostShape:
    return HostShape(tuple(int(k) for k in b.k), max(b.positions))


def sample(b: Batch, impl: str, host: HostShape | None, **kwargs: object) -> SamplerOutput:
    return rejection_sample(
        b.k, b.draft_ids, b.logits, b.q, b.sampling, impl=impl, host=host,  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def assert_equal(a: SamplerOutput, b: SamplerOutput) -> None:
    for name in ("status", "num_committed", "token_ids", "accepted"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name


def from_tensors(sampling: RequestSampling) -> RequestSampling:
    """The same sampling without its host-side flags: the sampler must read them."""
    s = sampling
    return RequestSampling(s.temperature, s.top_k, s.top_p, s.seed, s.position)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("q_form", ["dense", "sparse", "none"])
def test_host_shape_gives_the_outputs_of_the_reading_path(
    q_form: str, impl: str, device: torch.device
) -> None:
    b = batch(q_form)
    if impl == "triton":  # compiled on a GPU, interpreted on the CPU (tests/conftest.py)
        b = b.to(device)
    with_host = sample(b, impl, host_of(b))
    b.sampling = from_tensors(b.sampling)
    read = sample(b, impl, None)
    assert_equal(with_host, read)
    assert HostShape.read(b.k, b.sampling) == host_of(b)
    assert read.status.tolist() == [0] * len(K)
    # the batch exercises what the host knowledge replaces: truncated, greedy and k = 0 rows
    assert b.sampling.read_truncated()[1] and not b.sampling.read_truncated()[3]


def test_host_shape_with_synthetic_rates() -> None:
    b = batch("sparse")
    synthetic = SyntheticAcceptance(4, mean_acceptance_length=2.5)
    with_host = sample(b, "torch", host_of(b), synthetic=synthetic)
    assert_equal(with_host, sample(b, "torch", None, synthetic=synthetic))
    drafted = b.k > 0
    assert with_host.accepted[drafted, 0].all() and not with_host.accepted[:, 2:].any()


@pytest.mark.parametrize(
    ("host", "match"),
    [
        (HostShape((3, 0, 2, 1, 4), 4095), r"host describes 5 requests but num_draft_tokens has 6"),
        (HostShape((3, 0, 2, 1, 4, 3), 4095), r"draft_token_ids .*shape \[13\]"),
    ],
)
def test_host_that_disagrees_with_the_shapes_is_refused(host: HostShape, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sample(batch("dense"), "torch", host)


def test_host_shape_is_validated() -> None:
    with pytest.raises(ValueError, match="at least one request"):
        HostShape((), 0)
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 0"):
        HostShape((2, -1), 0)
    with pytest.raises(ValueError, match=r"max_position must be in \[0, 2147483647\]"):
        HostShape((2,), -1)
    with pytest.raises(ValueError, match="position \\+ num_draft_tokens must stay below"):
        HostShape((2,), 2**31 - 3)
    b = batch("none")
    b.sampling = dataclasses.replace(b.sampling, truncated=(True,))
    with pytest.raises(ValueError, match=r"sampling\.truncated must have 6 flags"):
        sample(b, "torch", host_of(b))


def test_named_rows_that_need_no_threshold_keep_every_token() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    inv_t = torch.ones(4)
    top_k = torch.tensor([0, 5, 0, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.7, 1.0])
    found = logit_thresholds(logits, inv_t, top_k, top_p)
    assert found.isfinite().tolist() == [False, True, True, False]
    every = logit_thresholds(logits, inv_t, top_k, top_p, rows=torch.arange(4))
    assert torch.equal(found, every)


def test_to_host_matches_the_tensors() -> None:
    out = sample(batch("dense"), "torch", None)
    host = out.to_host()
    assert host.status == out.status.tolist()
    assert host.num_committed == out.num_committed.tolist()
    assert host.token_ids == out.token_ids.tolist()
    assert host.accepted == out.accepted.tolist()
    assert [row[:n] for row, n in zip(host.token_ids, host.num_committed, strict=True)] == [
        out.committed(b) for b in range(len(K))
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("q_form", ["dense", "sparse", "none"])
def test_served_path_does_not_synchronise(q_form: str) -> None:
    cuda = torch.device("cuda")
    b = batch(q_form).to(cuda)
    expected = sample(b, "triton", None)  # also compiles the kernels outside the check
    host = host_of(b)
    sample(b, "triton", host)  # the first pinned buffers are allocated here
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        b.sampling = RequestSampling.from_params(b.params, b.positions, cuda)
        out = sample(b, "triton", host)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_equal(out, expected)
    host_out = out.to_host()
    assert host_out.token_ids == expected.token_ids.tolist()
    assert host_out.status == [0] * len(K)
