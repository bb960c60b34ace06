"""Statistical exactness: committed tokens are distributed as the target's own sampling.

Each test runs N independent trials of one request (seed = trial index), with draft tokens
drawn from q, and compares the committed token counts with p by a chi-square test. A token
with p = 0 must never appear. Thresholds: p-value > 1e-3 passes; the mutant (shared noise
between acceptance and recovery, vLLM #47386) must give p-value < 1e-6 on the same inputs.
"""

from __future__ import annotations

import types
from enum import IntEnum

import pytest
import torch
from scipy import stats

from specdec import rng
from specdec.sampling_params import SamplingParams
from target_service import kernels
from target_service.logits_processing import target_distribution
from target_service.rejection_sampler import (
    DenseQ,
    RequestSampling,
    SamplerOutput,
    SparseQ,
    rejection_sample,
)

# An adversarial pair on a narrow vocabulary: q puts its mass where p has little.
P = torch.tensor([0.30, 0.05, 0.05, 0.05, 0.05, 0.20, 0.20, 0.10])
Q = torch.tensor([0.02, 0.40, 0.30, 0.20, 0.02, 0.02, 0.02, 0.02])
P_NEXT = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.05, 0.05, 0.20, 0.10])
# Against top-k / top-p, a draft whose mass partly overlaps the kept support {0, 5, 6, 7}.
Q_TRUNCATED = torch.tensor([0.10, 0.05, 0.05, 0.05, 0.35, 0.05, 0.25, 0.10])


def chi2_pvalue(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    counts = torch.bincount(tokens.long(), minlength=expected.numel()).double()
    assert counts.numel() == expected.numel(), "a token outside the vocabulary was emitted"
    support = expected > 0
    assert float(counts[~support].sum()) == 0.0, "a token with p = 0 was emitted"
    expected = expected[support] / expected[support].sum()
    return float(stats.chisquare(counts[support], expected * counts.sum()).pvalue)


def run_trials(
    rows: list[torch.Tensor],  # k + 1 target logit rows [V]
    q_rows: list[torch.Tensor],  # k draft distributions [V] the drafts are sampled from
    q_form: str,
    params: SamplingParams,
    trials: int,
    impl: str = "torch",
    device: str = "cpu",
) -> tuple[SamplerOutput, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    k = len(q_rows)
    drafts = torch.stack([torch.multinomial(q, trials, True, generator=gen) for q in q_rows], 1)
    logits = torch.stack(rows).repeat(trials, 1).to(device)
    q_dense = torch.stack(q_rows).repeat(trials, 1).float()
    draft_probs: DenseQ | SparseQ | None = None
    if q_form == "dense":
        draft_probs = DenseQ(q_dense.to(device))
    elif q_form == "sparse":
        support = (q_dense > 0).sum(1).max()
        probs, ids = q_dense.topk(int(support), dim=1)
        ids = torch.where(probs > 0, ids, -1).int()
        draft_probs = SparseQ(ids.to(device), probs.to(device))
    seeded = [
        SamplingParams(params.temperature, params.top_k, params.top_p, seed=i)
        for i in range(trials)
    ]
    sampling = RequestSampling.from_params(seeded, [100] * trials, device)
    num = torch.full((trials,), k, dtype=torch.int32, device=device)
    out = rejection_sample(
        num, drafts.flatten().int().to(device), logits, draft_probs, sampling, impl=impl
    )  # type: ignore[arg-type]
    return out, drafts


def expected_p(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    def one(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([value], dtype=dtype)

    return target_distribution(
        row[None],
        one(params.temperature, torch.float32),
        one(params.top_k, torch.int32),
        one(params.top_p, torch.float32),
    )[0]


PLAIN = SamplingParams(1.0)
TRUNCATED = SamplingParams(temperature=0.7, top_k=6, top_p=0.85)


@pytest.mark.parametrize(
    ("q_form", "params", "trials"),
    [
        ("dense", PLAIN, 200_000),
        ("sparse", PLAIN, 200_000),
        ("none", PLAIN, 200_000),
        ("dense", TRUNCATED, 200_000),
        ("sparse", TRUNCATED, 100_000),
        ("none", TRUNCATED, 100_000),
    ],
)
def test_first_committed_token_is_distributed_as_p(
    q_form: str, params: SamplingParams, trials: int
) -> None:
    q = (Q if params is PLAIN else Q_TRUNCATED).clone()
    if q_form == "sparse":  # the draft sampled from a truncated support of 3 or 4 tokens
        q = torch.where(q >= 0.1, q, 0.0)
        q = q / q.sum()
    rows = [P.log(), P_NEXT.log()]
    out, _ = run_trials(rows, [q], q_form, params, trials)
    assert bool((out.status == 0).all())
    assert chi2_pvalue(out.token_ids[:, 0], expected_p(rows[0], params)) > 1e-3
    accepted = out.accepted[:, 0].float().mean()
    assert 0.05 < float(accepted) < 0.95  # the test exercises both branches


@pytest.mark.parametrize("q_form", ["dense", "sparse", "none"])
def test_later_position_is_distributed_as_p(q_form: str) -> None:
    """Given position 0 accepted, the token at position 1 (accepted, recovered or bonus) ~ p_1."""
    q1 = torch.softmax(torch.tensor([2.0, 0.0, -1.0, 1.0, 0.5, -2.0, 0.0, 1.5]), 0)
    q0 = torch.full((8,), 0.125)
    rows = [P.log(), P_NEXT.log(), P.flip(0).log()]
    out, _ = run_trials(rows, [q0, q1], q_form, PLAIN, 200_000)
    second = out.token_ids[out.accepted[:, 0], 1]
    assert second.numel() > 20_000
    assert chi2_pvalue(second, P_NEXT.double()) > 1e-3


def test_bonus_token_is_distributed_as_p() -> None:
    # q = p exactly: every draft is accepted, so every step ends with a bonus token.
    out, _ = run_trials([P.log(), P_NEXT.log()], [P.clone()], "dense", PLAIN, 100_000)
    assert bool(out.accepted[:, 0].all())
    assert chi2_pvalue(out.token_ids[:, 1], P_NEXT.double()) > 1e-3


def shared_noise_rng() -> types.SimpleNamespace:
    class SharedStream(IntEnum):  # RECOVER aliases ACCEPT: the recovery race reuses u
        ACCEPT = 0
        RECOVER = 0
        BONUS = 2
        DRAFT = 3

    return types.SimpleNamespace(
        philox=rng.philox,
        vocab_bits=rng.vocab_bits,
        exponential=rng.exponential,
        position_uniform=rng.position_uniform,
        Stream=SharedStream,
    )


def test_mutant_with_shared_noise_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [P.log(), P_NEXT.log()]
    out, _ = run_trials(rows, [Q], "dense", PLAIN, 200_000)
    assert chi2_pvalue(out.token_ids[:, 0], P.double()) > 1e-3
    monkeypatch.setattr(kernels, "rng", shared_noise_rng())
    mutant, _ = run_trials(rows, [Q], "dense", PLAIN, 200_000)
    assert chi2_pvalue(mutant.token_ids[:, 0], P.double()) < 1e-6


@pytest.mark.parametrize("q_form", ["dense", "sparse", "none"])
def test_triton_kernels_are_exact(q_form: str, device: torch.device) -> None:
    """The kernels themselves (compiled on GPU: 200k trials; interpreted on the CPU, about
    0.1 s a trial: 200, a sanity check beside test_rejection_kernels, which holds the kernels
    bit-equal to the torch implementation tested above at 100k to 200k trials)."""
    trials = 200_000 if device.type == "cuda" else 200
    q = Q_TRUNCATED if q_form != "sparse" else torch.where(Q_TRUNCATED >= 0.1, Q_TRUNCATED, 0.0)
    q = q / q.sum()
    rows = [P.log(), P_NEXT.log()]
    out, _ = run_trials(rows, [q], q_form, TRUNCATED, trials, "triton", str(device))
    assert chi2_pvalue(out.token_ids[:, 0].cpu(), expected_p(rows[0], TRUNCATED)) > 1e-3
