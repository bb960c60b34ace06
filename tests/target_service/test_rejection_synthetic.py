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
        (SyntheticAcceptance(3, rates=(0.7, 0.5, 0.2)), 300, "triton"),
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


# Mixed traffic: each request's own L_i, uniform in [L - S, L + S] by a hash of its id.


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mean_acceptance_length": 3.0, "spread": -0.5}, r"spread must be a finite number >= 0"),
        ({"mean_acceptance_length": 3.0, "spread": math.nan}, "spread must be"),
        ({"rates": (0.5, 0.5, 0.5, 0.5), "spread": 0.5}, "spread needs mean_acceptance_length"),
    ],
)
def test_invalid_spreads_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SyntheticAcceptance(4, **kwargs)


def test_request_lengths_are_fixed_by_the_id_and_within_bounds() -> None:
    cfg = SyntheticAcceptance(4, mean_acceptance_length=3.0, spread=1.5)
    ids = [f"req-{i}" for i in range(4000)]
    lengths = [cfg.request_length(rid) for rid in ids]
    assert lengths == [cfg.request_length(rid) for rid in ids]  # reruns agree
    assert SyntheticAcceptance(4, mean_acceptance_length=3.0, spread=1.5).request_length(
        "req-7"
    ) == lengths[7]  # fmt: skip
    assert all(1.5 <= length <= 4.5 for length in lengths)
    assert min(lengths) < 1.6 and max(lengths) > 4.4  # the whole range is drawn
    assert len(set(lengths)) > 3900
    # uniform on [1.5, 4.5]: mean 3, standard deviation 3 / sqrt(12); 5 sigma of the mean
    sigma = 3.0 / math.sqrt(12) / math.sqrt(len(ids))
    assert abs(sum(lengths) / len(ids) - 3.0) < 5 * sigma
    # Kolmogorov-Smirnov against that uniform: D < 1.95 / sqrt(n) at p = 0.001
    cdf = sorted((length - 1.5) / 3.0 for length in lengths)
    d = max(max((i + 1) / len(cdf) - c, c - i / len(cdf)) for i, c in enumerate(cdf))
    assert d < 1.95 / math.sqrt(len(cdf)), d
    # each request's rates are the minimum-variance schedule of its own L_i
    for rid, length in zip(ids[:50], lengths[:50], strict=True):
        own = SyntheticAcceptance(4, mean_acceptance_length=length)
        assert cfg.unconditional_rates(rid) == own.unconditional_rates()
        assert cfg.conditional_rates(rid) == own.conditional_rates()
        assert cfg.mean_length(rid) == pytest.approx(length)


def test_request_lengths_are_clipped_to_1_and_k_plus_1() -> None:
    cfg = SyntheticAcceptance(2, mean_acceptance_length=2.5, spread=2.0)
    lengths = [cfg.request_length(f"r{i}") for i in range(2000)]
    assert min(lengths) == 1.0 and max(lengths) == 3.0  # k + 1 = 3
    # drawn in [0.5, 4.5]: P(L_i <= 1) = 0.5 / 4, P(L_i >= 3) = 1.5 / 4; 5 binomial sigma
    for value, share in ((1.0, 0.125), (3.0, 0.375)):
        sigma = math.sqrt(share * (1 - share) / len(lengths))
        assert abs(lengths.count(value) / len(lengths) - share) < 5 * sigma, value
    assert "uniform in [1, 3]" in cfg.describe()


def test_spread_zero_keeps_the_one_schedule_for_every_request() -> None:
    cfg = SyntheticAcceptance(5, mean_acceptance_length=3.25)
    assert cfg == SyntheticAcceptance(5, mean_acceptance_length=3.25, spread=0.0)
    for rid in ("a", "b", "req-123", None):
        assert cfg.request_length(rid) == 3.25
        assert cfg.unconditional_rates(rid) == (1.0, 1.0, 0.25, 0.0, 0.0)
        assert cfg.conditional_rates(rid) == (1.0, 1.0, 0.25, 0.0, 0.0)
    assert cfg.describe() == "rates (1.0, 1.0, 0.25, 0.0, 0.0)"


def _batch(trials: int, k: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(trials * (k + 1), 16, generator=gen)
    drafts = torch.randint(0, 16, (trials * k,), generator=gen, dtype=torch.int32)
    num = torch.full((trials,), k, dtype=torch.int32)
    return num.to(device), drafts.to(device), logits.to(device)


def _sample(cfg: SyntheticAcceptance, ids: list[str] | None, impl: str, device: str = "cpu"):
    trials, k = len(ids) if ids else 64, cfg.num_draft_tokens
    params = [SamplingParams(1.0 if i % 3 else 0.0, seed=i) for i in range(trials)]
    sampling = RequestSampling.from_params(params, [7] * trials, device)
    num, drafts, logits = _batch(trials, k, device)
    return rejection_sample(
        num, drafts, logits, None, sampling, synthetic=cfg, request_ids=ids, impl=impl
    )


def test_spread_zero_samples_as_before_with_or_without_ids() -> None:
    cfg = SyntheticAcceptance(4, mean_acceptance_length=2.6)
    ids = [f"r{i}" for i in range(64)]
    before, after = _sample(cfg, None, "torch"), _sample(cfg, ids, "torch")
    for name in ("token_ids", "num_committed", "accepted", "status"):
        assert torch.equal(getattr(before, name), getattr(after, name)), name


def test_measured_rates_follow_each_request_s_length() -> None:
    """Over many requests, position j is accepted at the mean of the requests' own r_j."""
    cfg = SyntheticAcceptance(4, mean_acceptance_length=2.6, spread=1.2)
    ids = [f"mixed-{i}" for i in range(60_000)]
    measured = _sample(cfg, ids, "torch").accepted.float().mean(dim=0)
    expected = torch.tensor([cfg.unconditional_rates(rid) for rid in ids]).mean(dim=0)
    bound = 5 * torch.sqrt(expected * (1 - expected) / len(ids)) + 1e-9  # 5 sigma
    assert bool(((measured - expected).abs() <= bound).all()), (measured, expected)
    # not the one schedule of L: its third position is never accepted, the mix's often is
    assert SyntheticAcceptance(4, mean_acceptance_length=2.6).unconditional_rates()[2] == 0.0
    assert expected[2] > 0.05 and measured[2] > 0.05


def test_kernel_and_reference_agree_on_per_request_rates() -> None:
    cfg = SyntheticAcceptance(3, mean_acceptance_length=2.5, spread=1.5)
    ids = [f"k{i}" for i in range(6)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref, got = _sample(cfg, ids, "torch", device), _sample(cfg, ids, "triton", device)
    for name in ("token_ids", "num_committed", "accepted", "status"):
        assert torch.equal(getattr(ref, name).cpu(), getattr(got, name).cpu()), name


def test_a_spread_needs_one_request_id_per_request() -> None:
    cfg = SyntheticAcceptance(2, mean_acceptance_length=2.0, spread=0.5)
    with pytest.raises(ValueError, match=r"request_ids with one id per request \(64\), got None"):
        _sample(cfg, None, "torch")


def test_layout_gives_each_draft_token_its_request_s_rate() -> None:
    from target_service.batch_layout import batch_layout

    rates = [(0.9, 0.8, 0.7), (0.6, 0.5, 0.4), (0.3, 0.2, 0.1)]
    layout = batch_layout([2, 0, 1], [False] * 3, rates, torch.device("cpu"))
    assert layout.rates is not None
    assert layout.rates.tolist() == pytest.approx([0.9, 0.8, 0.3])
