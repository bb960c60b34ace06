"""Bad values in one request are that request's error; the others keep their exact results.
Structural mistakes by the caller raise ValueError naming the argument."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specdec.sampling_params import SamplingParams
from target_service.rejection_sampler import (
    PLACEHOLDER,
    DenseQ,
    RequestSampling,
    SamplerOutput,
    SampleStatus,
    SparseQ,
    rejection_sample,
    status_message,
)
from tests.target_service.helpers import Batch, random_batch

K = [2, 3, 1, 2]  # request 1 (draft tokens 2..4, logits rows 3..6) is the one corrupted


def corrupt_logits(value: float) -> Callable[[Batch], None]:
    def apply(b: Batch) -> None:
        b.logits[4, 17] = value

    return apply


def set_draft(token: int) -> Callable[[Batch], None]:
    def apply(b: Batch) -> None:
        b.draft_ids[3] = token

    return apply


def dense_q(edit: Callable[[torch.Tensor], None]) -> Callable[[Batch], None]:
    def apply(b: Batch) -> None:
        assert isinstance(b.q, DenseQ)
        edit(b.q.probs[3])

    return apply


def out_of_support(b: Batch) -> None:
    assert isinstance(b.q, DenseQ)
    x = int(b.draft_ids[3])
    b.q.probs[3, (x + 1) % 64] += b.q.probs[3, x]
    b.q.probs[3, x] = 0.0


def q_nan(row: torch.Tensor) -> None:
    row[5] = float("nan")


def q_negative(row: torch.Tensor) -> None:
    row[5] -= 0.5
    row[6] += 0.5


def q_unnormalized(row: torch.Tensor) -> None:
    row *= 1.01


def q_inf(row: torch.Tensor) -> None:
    row[0] = float("inf")


CASES = [
    ("nan logits", "dense", corrupt_logits(float("nan")), SampleStatus.NONFINITE_LOGITS),
    ("inf logits", "none", corrupt_logits(float("inf")), SampleStatus.NONFINITE_LOGITS),
    ("-inf logits", "sparse", corrupt_logits(float("-inf")), SampleStatus.NONFINITE_LOGITS),
    ("nan q", "dense", dense_q(q_nan), SampleStatus.INVALID_DRAFT_PROBS),
    ("inf q", "dense", dense_q(q_inf), SampleStatus.INVALID_DRAFT_PROBS),
    ("negative q", "dense", dense_q(q_negative), SampleStatus.INVALID_DRAFT_PROBS),
    ("q sums to 1.01", "dense", dense_q(q_unnormalized), SampleStatus.DRAFT_PROBS_NOT_NORMALIZED),
    ("q(x) = 0", "dense", out_of_support, SampleStatus.DRAFT_TOKEN_OUT_OF_SUPPORT),
    ("token >= V", "dense", set_draft(64), SampleStatus.TOKEN_OUT_OF_VOCAB),
    ("token < 0", "none", set_draft(-3), SampleStatus.TOKEN_OUT_OF_VOCAB),
]


def sparse_edit(name: str) -> Callable[[Batch], None]:
    def apply(b: Batch) -> None:
        assert isinstance(b.q, SparseQ)
        ids, probs = b.q.token_ids[3], b.q.probs[3]
        if name == "duplicate id":
            ids[1] = ids[0]
        elif name == "id >= V":
            ids[0] = 64
        elif name in ("id -2", "id -2**31"):  # -1 is padding; lower ids are invalid q
            # in every q row of request 1, so the row its race reads has one too
            b.q.token_ids[2:5, 0] = -2 if name == "id -2" else -(2**31)
        elif name == "nan":
            probs[0] = float("nan")
        elif name == "unnormalized":
            probs *= 0.9
        elif name == "not in support":
            b.draft_ids[3] = next(t for t in range(64) if t not in ids.tolist())

    return apply


SPARSE_CASES = [
    ("duplicate id", SampleStatus.INVALID_DRAFT_PROBS),
    ("id >= V", SampleStatus.INVALID_DRAFT_PROBS),
    ("id -2", SampleStatus.INVALID_DRAFT_PROBS),
    ("id -2**31", SampleStatus.INVALID_DRAFT_PROBS),
    ("nan", SampleStatus.INVALID_DRAFT_PROBS),
    ("unnormalized", SampleStatus.DRAFT_PROBS_NOT_NORMALIZED),
    ("not in support", SampleStatus.DRAFT_TOKEN_OUT_OF_SUPPORT),
]


def run(b: Batch, impl: str, device: str) -> SamplerOutput:
    b = b.to(device)
    out = rejection_sample(b.k, b.draft_ids, b.logits, b.q, b.sampling, impl=impl)  # type: ignore[arg-type]
    return SamplerOutput(
        *(t.cpu() for t in (out.token_ids, out.num_committed, out.accepted, out.status))
    )


def check_isolated(q_form: str, corrupt: Callable[[Batch], None], status: SampleStatus) -> None:
    for impl in ("torch", "triton"):
        device = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
        clean = random_batch(K, 64, q_form, seed=21, greedy_fraction=0.25, support=8)
        expected = run(clean, impl, device)
        bad = random_batch(K, 64, q_form, seed=21, greedy_fraction=0.25, support=8)
        corrupt(bad)
        out = run(bad, impl, device)
        assert out.status.tolist() == [0, int(status), 0, 0], impl
        assert out.token_ids[1].tolist() == [PLACEHOLDER] * 4
        assert int(out.num_committed[1]) == 0
        others = [0, 2, 3]
        assert torch.equal(out.token_ids[others], expected.token_ids[others]), impl
        assert status_message(int(status)).endswith(".")


@pytest.mark.parametrize(("name", "q_form", "corrupt", "status"), CASES, ids=[c[0] for c in CASES])
def test_bad_values_fail_only_their_request(
    name: str, q_form: str, corrupt: Callable[[Batch], None], status: SampleStatus
) -> None:
    check_isolated(q_form, corrupt, status)


@pytest.mark.parametrize(("name", "status"), SPARSE_CASES, ids=[c[0] for c in SPARSE_CASES])
def test_bad_sparse_q_fails_only_its_request(name: str, status: SampleStatus) -> None:
    check_isolated("sparse", sparse_edit(name), status)


def call(**overrides: object) -> None:
    b = random_batch([2, 0, 1], 32, "dense", seed=1)
    args: dict[str, object] = {
        "num_draft_tokens": b.k,
        "draft_token_ids": b.draft_ids,
        "target_logits": b.logits,
        "draft_probs": b.q,
        "sampling": b.sampling,
    }
    args.update(overrides)
    rejection_sample(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_draft_tokens": torch.tensor([2, -1, 2], dtype=torch.int32)}, "num_draft_tokens"),
        ({"num_draft_tokens": torch.tensor([2.0, 0.0, 1.0])}, "num_draft_tokens"),
        ({"draft_token_ids": torch.zeros(4, dtype=torch.int32)}, r"draft_token_ids .*\[3\]"),
        ({"target_logits": torch.zeros(5, 32)}, r"target_logits .*\[6, vocab\]"),
        ({"target_logits": torch.zeros(6, 32, dtype=torch.float64)}, "float32, bf16 or fp16"),
        ({"draft_probs": DenseQ(torch.zeros(2, 32))}, r"draft_probs.probs .*\[3, vocab\]"),
        ({"draft_probs": DenseQ(torch.zeros(3, 32, dtype=torch.float64))}, "float32"),
        ({"draft_probs": DenseQ(torch.zeros(3, 0))}, r"vocab >= 1"),
        (
            {"draft_probs": SparseQ(torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3, 5))},
            "shape",
        ),
        ({"vocab_size": 33}, r"vocab_size must be in \[1, 32\]"),
    ],
)
def test_structural_errors_name_the_argument(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(**overrides)


def test_sampling_params_are_validated() -> None:
    for kwargs, field in [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positions"):
        RequestSampling.from_params([SamplingParams()], [-1], "cpu")
