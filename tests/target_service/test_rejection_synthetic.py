"""Synthetic acceptance: configuration checks and measured per-position rates."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.sampling_params import SamplingParams
from target_service.rejection_sampler import RequestSampling, rejection_sample
from target_service.synthetic import SyntheticAcceptance


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_draft_tokens": 0, "rates": ()}, "num_draft_tokens"),
        ({"num_draft_tokens": 3}, "exactly one"),
        (
            {"num_draft_tokens": 2, "rates": (0.5, 0.4), "mean_acceptance_length": 2.0},
            "exactly one",
        ),
        ({"num_draft_tokens": 3, "rates": (0.5, 0.4)}, "rates must have"),
        ({"num_draft_tokens": 2, "rates": (0.5, 0.6)}, "non-increasing"),
        ({"num_draft_tokens": 2, "rates": (1.5, 0.6)}, r"rates\[0\] must be in \[0, 1\]"),
        ({"num_draft_tokens": 2, "rates": (0.5, float("nan"))}, r"rates\[1\]"),
        ({"num_draft_tokens": 2, "rates": (0.5, -0.1)}, r"rates\[1\]"),
        (
            {"num_draft_tokens": 4, "mean_acceptance_length": 0.5},
            r"mean_acceptance_length .*\[1, 5\]",
        ),
        ({"num_draft_tokens": 4, "mean_acceptance_length": 5.5}, "mean_acceptance_length"),
        ({"num_draft_tokens": 4, "mean_acceptance_length": math.inf}, "mean_acceptance_length"),
    ],
)
def test_invalid_configurations_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SyntheticAcceptance(**kwargs)


def test_minimum_variance_schedule_and_conditional_rates() -> None:
    cfg = SyntheticAcceptance(num_draft_tokens=5, mean_acceptance_length=3.25)
    assert cfg.unconditional_rates() == (1.0, 1.0, 0.25, 0.0, 0.0)
    assert cfg.conditional_rates() == (1.0, 1.0, 0.25, 0.0, 0.0)
    assert cfg.mean_length() == pytest.approx(3.25)
    cfg = SyntheticAcceptance(num_draft_tokens=3, rates=(0.8, 0.4, 0.1))
    assert cfg.conditional_rates() == pytest.approx((0.8, 0.5, 0.25))
    assert SyntheticAcceptance(3, mean_acceptance_length=4.0).unconditional_rates() == (1, 1, 1)
    assert SyntheticAcceptance(3, mean_acceptance_length=1.0).unconditional_rates() == (0, 0, 0)


def measure(cfg: SyntheticAcceptance, trials: int, impl: str) -> torch.Tensor:
    k, vocab = cfg.num_draft_tokens, 16
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(trials * (k + 1), vocab, generator=gen)
    drafts = torch.randint(0, vocab, (trials * k,), generator=gen, dtype=torch.int32)
    params = [SamplingParams(1.0 if i % 3 else 0.0, seed=i) for i in range(trials)]
    device = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
    sampling = RequestSampling.from_params(params, [7] * trials, device)
    num = torch.full((trials,), k, dtype=torch.int32, device=device)
    drafts, logits = drafts.to(device), logits.to(device)
    out = rejection_sample(num, drafts, logits, None, sampling, synthetic=cfg, impl=impl)
    return out.accepted.float().mean(dim=0).cpu()  # unconditional rate per position


@pytest.mark.parametrize(
    ("cfg", "trials", "impl"),
    [
        (SyntheticAcceptance(4, rates=(0.9, 0.6, 0.3, 0.1)), 100_000, "torch"),
        (SyntheticAcceptance(4, mean_acceptance_length=2.6), 100_000, "torch"),
        # interpreted on the CPU: about 0.1 s a trial
        (SyntheticAcceptance(3, rates=(0.7, 0.5, 0.2)), 150, "triton"),
    ],
)
def test_measured_rates_match_configuration(
    cfg: SyntheticAcceptance, trials: int, impl: str
) -> None:
    measured = measure(cfg, trials, impl)
    expected = torch.tensor(cfg.unconditional_rates())
    bound = 5 * torch.sqrt(expected * (1 - expected) / trials) + 1e-9  # 5 sigma
    assert bool(((measured - expected).abs() <= bound).all()), (measured, expected)


def test_more_drafts_than_configured_is_an_error() -> None:
    cfg = SyntheticAcceptance(2, rates=(0.5, 0.5))
    sampling = RequestSampling.from_params([SamplingParams()], [0], "cpu")
    with pytest.raises(ValueError, match="configured for 2 draft tokens"):
        rejection_sample(
            torch.tensor([3], dtype=torch.int32),
            torch.zeros(3, dtype=torch.int32),
            torch.zeros(4, 8),
            None,
            sampling,
            synthetic=cfg,
        )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rates": (0.5, 0.5), "length_spread": 0.5}, "needs mean_acceptance_length"),
        ({"mean_acceptance_length": 2.0, "length_spread": 1.5}, "must stay in"),
        ({"mean_acceptance_length": 2.5, "length_spread": 1.0}, "must stay in"),
        ({"mean_acceptance_length": 2.0, "length_spread": -0.1}, "length_spread must be >= 0"),
    ],
)
def test_a_spread_that_leaves_the_range_is_refused(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SyntheticAcceptance(2, **kwargs)


def test_each_request_has_its_own_length_and_the_batch_keeps_the_mean() -> None:
    cfg = SyntheticAcceptance(4, mean_acceptance_length=3.0, length_spread=1.5)
    lengths = [cfg.length_for(f"req-{i}") for i in range(4000)]
    assert min(lengths) >= 1.5 and max(lengths) <= 4.5
    assert sum(lengths) / len(lengths) == pytest.approx(3.0, abs=0.05)
    assert cfg.length_for("req-7") == cfg.length_for("req-7")  # a hash: reruns agree
    assert len({round(x, 6) for x in lengths[:50]}) == 50
    rows = cfg.conditional_rates_for(["a", "b"], 4)
    for key, row in zip(["a", "b"], rows, strict=True):
        want = SyntheticAcceptance(4, mean_acceptance_length=cfg.length_for(key))
        assert row.tolist() == pytest.approx(want.conditional_rates())
    flat = SyntheticAcceptance(4, mean_acceptance_length=3.0)
    assert flat.conditional_rates_for(["a", "b"], 3).tolist() == [[1.0, 1.0, 0.0]] * 2


def _spread_run(cfg: SyntheticAcceptance, trials: int, impl: str) -> tuple[torch.Tensor, list[str]]:
    k, vocab = cfg.num_draft_tokens, 16
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(trials * (k + 1), vocab, generator=gen)
    drafts = torch.randint(0, vocab, (trials * k,), generator=gen, dtype=torch.int32)
    params = [SamplingParams(1.0, seed=i) for i in range(trials)]
    keys = [f"r{i}" for i in range(trials)]
    sampling = RequestSampling.from_params(params, [7] * trials, "cpu")
    num = torch.full((trials,), k, dtype=torch.int32)
    out = rejection_sample(num, drafts, logits, None, sampling, synthetic=cfg,
                           synthetic_keys=keys, impl=impl)  # fmt: skip
    return out.accepted, keys


def test_each_request_is_accepted_at_its_own_rates() -> None:
    """Per request its own length (mixed traffic): requests drawn short accept less than those
    drawn long, each group at its own rates, and the batch at the configured mean."""
    cfg = SyntheticAcceptance(4, mean_acceptance_length=2.5, length_spread=1.5)
    accepted, keys = _spread_run(cfg, 60_000, "torch")
    want = torch.tensor(cfg.conditional_rates_for(keys, 4)).cumprod(dim=1)  # unconditional
    for group in (want.sum(1) < 1.5, want.sum(1) >= 1.5):
        measured, expected = accepted[group].float().mean(0), want[group].mean(0)
        n = int(group.sum())
        bound = 5 * torch.sqrt(expected * (1 - expected) / n) + 1e-9
        assert bool(((measured - expected).abs() <= bound).all()), (measured, expected)
    assert 1 + accepted.float().sum(1).mean().item() == pytest.approx(2.5, abs=0.03)


def test_the_kernel_reads_each_requests_rates() -> None:
    """The Triton kernel (interpreted on the CPU) decides as the reference does, row by row."""
    cfg = SyntheticAcceptance(4, mean_acceptance_length=2.5, length_spread=1.5)
    triton_out, _ = _spread_run(cfg, 40, "triton")
    torch_out, _ = _spread_run(cfg, 40, "torch")
    assert torch.equal(triton_out, torch_out)
    assert len({tuple(r) for r in torch_out.tolist()}) > 3, "too few distinct outcomes"


@pytest.mark.parametrize("ks", [[4, 2, 0, 3, 1] * 8, [2, 1, 2, 0] * 10])  # max_k 4, then 2 < 4
def test_the_kernel_reads_each_requests_rates_whatever_their_k(ks: list[int]) -> None:
    """Rows of the block's width (its max k, below the configured k in the second case) and
    requests of several k, k = 0 among them: the Triton kernel decides as the reference."""
    cfg = SyntheticAcceptance(4, mean_acceptance_length=2.5, length_spread=1.5)
    vocab, n = 16, len(ks)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(sum(ks) + n, vocab, generator=gen)
    drafts = torch.randint(0, vocab, (sum(ks),), generator=gen, dtype=torch.int32)
    sampling = RequestSampling.from_params([SamplingParams(1.0, seed=i) for i in range(n)],
                                           [7] * n, "cpu")  # fmt: skip
    num = torch.tensor(ks, dtype=torch.int32)
    keys = [f"q{i}" for i in range(n)]
    outs = []
    for impl in ("triton", "torch"):
        out = rejection_sample(num, drafts, logits, None, sampling, synthetic=cfg,
                               synthetic_keys=keys, impl=impl)  # fmt: skip
        outs.append(out.num_committed)
    assert torch.equal(outs[0], outs[1]), outs
    assert len(set(outs[1].tolist())) > 2, "too few distinct outcomes"
