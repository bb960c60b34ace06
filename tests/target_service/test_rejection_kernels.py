"""The Triton kernels against the pure-torch reference on identical random streams, and hand
cases with exact expected outputs."""

from __future__ import annotations

import pytest
import torch

from specdec.sampling_params import SamplingParams
from target_service import kernels
from target_service.rejection_sampler import (
    PLACEHOLDER,
    DenseQ,
    RequestSampling,
    SampleStatus,
    prepare,
    rejection_sample,
)
from tests.target_service.helpers import Batch, random_batch


def run_both(
    b: Batch,
    device: torch.device,
    vocab_size: int | None = None,
    shape: kernels.LaunchShape | None = None,
) -> tuple:
    b = b.to(device)
    x = prepare(b.k, b.draft_ids, b.logits, b.q, b.sampling, vocab_size=vocab_size)
    return kernels.rejection_sample_torch(x), kernels.rejection_sample_triton(x, shape)


def assert_same(ref: kernels.KernelOutputs, tri: kernels.KernelOutputs) -> None:
    assert torch.equal(ref.status.cpu(), tri.status.cpu())
    assert torch.equal(ref.token_ids.cpu(), tri.token_ids.cpu())
    assert torch.equal(ref.num_committed.cpu(), tri.num_committed.cpu())
    assert torch.equal(ref.accepted.cpu(), tri.accepted.cpu())


def ks(batch: int, k: int, seed: int, mixed: bool = True) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    if not mixed:
        return [k] * batch
    return [int(v) for v in torch.randint(0, k + 1, (batch,), generator=gen)]


# Covers batch {1, 4, 64} x k {1, 4, 8} x V {100, 1000, 32000, 151936}, every q form, mixed
# greedy/sampled and mixed k with zeros, within the interpreter's budget on 2 cores.
SWEEP = [
    (1, 8, 151936, "dense", False),
    (1, 4, 151936, "sparse", False),
    (4, 4, 32000, "dense", True),
    (4, 8, 32000, "none", True),
    (4, 1, 32000, "sparse", False),
    (64, 1, 100, "dense", False),
    (64, 4, 100, "sparse", True),
    (64, 8, 100, "none", True),
    (64, 4, 1000, "dense", True),
    (4, 8, 1000, "sparse", True),
    (1, 1, 1000, "none", False),
]


@pytest.mark.parametrize(("batch", "k", "vocab", "q_form", "mixed"), SWEEP)
def test_kernel_equals_reference(
    batch: int, k: int, vocab: int, q_form: str, mixed: bool, device: torch.device
) -> None:
    seed = batch * 1000 + k * 100 + vocab % 97
    b = random_batch(ks(batch, k, seed, mixed), vocab, q_form, seed=seed, greedy_fraction=0.3)
    ref, tri = run_both(b, device)
    assert_same(ref, tri)
    assert bool((ref.status == 0).all())
    assert bool((ref.num_committed >= 1).all())


def test_mixed_k_with_zero_scores_each_request_against_its_own_rows(device: torch.device) -> None:
    b = random_batch([2, 0, 1], 1000, "dense", seed=5, greedy_fraction=0.0)
    ref, tri = run_both(b, device)
    assert_same(ref, tri)
    assert tri.token_ids.shape == (3, 3)
    assert int(tri.num_committed[1]) == 1  # b decodes one token
    assert tri.token_ids[1, 1:].tolist() == [PLACEHOLDER, PLACEHOLDER]


@pytest.mark.parametrize("q_form", ["dense", "sparse", "none"])
def test_vocabulary_splits_combine_exactly(q_form: str, device: torch.device) -> None:
    """Many splits per row (block 32; stats split 64, race split 96) give the one-split answer
    bit for bit."""
    b = random_batch(ks(16, 4, 3), 300, q_form, seed=11, greedy_fraction=0.3)
    ref, tri = run_both(b, device, shape=kernels.LaunchShape(32, 64, 96))
    assert_same(ref, tri)
    _, single = run_both(b, device)
    assert_same(single, tri)


@pytest.mark.parametrize("q_form", ["dense", "sparse", "none"])
def test_kernels_compiled_wider_than_the_block_needs_give_the_same_answer(
    q_form: str, device: torch.device
) -> None:
    """The split widths a GPU compiles for (LaunchShape.min_stats_splits / min_race_splits,
    one compile for every batch) and a sparse support narrower than MIN_SUPPORT_P2 leave the
    answer bit for bit: the extra lanes are masked."""
    b = random_batch(ks(6, 4, 21), 300, q_form, seed=21, greedy_fraction=0.3)
    narrow = kernels.LaunchShape(32, 64, 96)
    wide = kernels.LaunchShape(32, 64, 96, min_stats_splits=16, min_race_splits=32)
    ref, tri = run_both(b, device, shape=narrow)
    assert_same(ref, tri)
    _, widened = run_both(b, device, shape=wide)
    assert_same(tri, widened)


def test_bf16_logits_and_padded_vocabulary(device: torch.device) -> None:
    b = random_batch(ks(8, 4, 9), 260, "dense", seed=9, dtype=torch.bfloat16)
    b.logits[:, 256:] = 80.0  # padding columns must never win, even as the raw argmax
    probs = b.q.probs[:, :256]  # type: ignore[union-attr]
    q = DenseQ(torch.nn.functional.pad(probs / probs.sum(-1, keepdim=True), (0, 4)))
    drafts = b.draft_ids.clamp(max=255)
    ref, tri = run_both(Batch(b.k, drafts, b.logits, q, b.sampling, [], []), device, 256)
    outs = [ref, tri]
    for out in outs:
        assert bool((out.status == SampleStatus.OK).all())
        assert int(out.token_ids.max()) < 256
    assert_same(ref, tri)


def on(impl: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Triton runs compiled on a GPU when there is one, interpreted on the CPU otherwise."""
    device = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
    return [t.to(device) for t in tensors]


def sampling_on(impl: str, params: list[SamplingParams], positions: list[int]) -> RequestSampling:
    device = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
    return RequestSampling.from_params(params, positions, device)


def hand_batch(rows: list[list[tuple[int, float]]], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(rows), vocab)
    for r, entries in enumerate(rows):
        for token, value in entries:
            logits[r, token] = value
    return logits


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_all_accepted_emits_bonus(impl: str) -> None:
    logits = hand_batch([[(4, 60.0)], [(2, 60.0)], [(7, 60.0)]])
    sampling = sampling_on(impl, [SamplingParams(1.0, seed=3)], [0])
    k, drafts = torch.tensor([2], dtype=torch.int32), torch.tensor([4, 2], dtype=torch.int32)
    k, drafts, logits = on(impl, k, drafts, logits)
    out = rejection_sample(k, drafts, logits, None, sampling, impl=impl)
    assert out.token_ids.tolist() == [[4, 2, 7]]
    assert out.num_committed.tolist() == [3]
    assert out.accepted.tolist() == [[True, True]]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_first_rejected_emits_recovered(impl: str) -> None:
    # Draft 5 has p = 0 under top_k = 1 (target mass on 3): rejected, recovered from p - q = 3.
    logits = hand_batch([[(3, 60.0), (5, 1.0)], [(1, 60.0)], [(7, 60.0)]])
    sampling = sampling_on(impl, [SamplingParams(1.0, top_k=1, seed=4)], [9])
    q_rows = torch.tensor([[0.0] * 5 + [1.0] + [0.0] * 4, [0.1] * 10])
    k, drafts = torch.tensor([2], dtype=torch.int32), torch.tensor([5, 1], dtype=torch.int32)
    k, drafts, logits, q_rows = on(impl, k, drafts, logits, q_rows)
    out = rejection_sample(k, drafts, logits, DenseQ(q_rows), sampling, impl=impl)
    assert out.token_ids.tolist() == [[3, PLACEHOLDER, PLACEHOLDER]]
    assert out.num_committed.tolist() == [1]
    assert out.accepted.tolist() == [[False, False]]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("mismatch", [0, 1, 2, 3])
def test_greedy_mismatch_at_each_position(impl: str, mismatch: int) -> None:
    argmaxes = [6, 2, 9, 4]
    logits = hand_batch([[(a, 1.5), ((a + 1) % 10, 1.4)] for a in argmaxes])
    drafts = [a if j != mismatch else (a + 1) % 10 for j, a in enumerate(argmaxes[:3])]
    sampling = sampling_on(impl, [SamplingParams(0.0, seed=1)], [100])
    k, draft_ids, logits = on(
        impl, torch.tensor([3], dtype=torch.int32), torch.tensor(drafts, dtype=torch.int32), logits
    )
    out = rejection_sample(k, draft_ids, logits, None, sampling, impl=impl)
    expected = argmaxes[: mismatch + 1] if mismatch < 3 else argmaxes
    assert out.committed(0) == expected
    assert out.accepted[0].tolist() == [j < mismatch for j in range(3)]


def test_greedy_ties_go_to_lowest_id_like_torch_argmax() -> None:
    logits = hand_batch([[(3, 2.0), (8, 2.0)]])
    for impl in ("torch", "triton"):
        sampling = sampling_on(impl, [SamplingParams(0.0)], [0])
        k, empty, rows = on(
            impl, torch.tensor([0], dtype=torch.int32), torch.zeros(0).int(), logits
        )
        out = rejection_sample(k, empty, rows, None, sampling, impl=impl)
        assert out.committed(0) == [3]


def select(b: Batch, order: list[int]) -> Batch:
    """The requests `order` of b, as a new batch in that order."""
    row_start = torch.cumsum(b.k + 1, 0) - (b.k + 1)
    draft_start = torch.cumsum(b.k, 0) - b.k
    rows = torch.cat(
        [torch.arange(int(row_start[i]), int(row_start[i] + b.k[i] + 1)) for i in order]
    )
    drafts = torch.cat(
        [torch.arange(int(draft_start[i]), int(draft_start[i] + b.k[i])) for i in order]
    )
    q = b.q
    if q is not None:
        q = type(q)(*(getattr(q, f)[drafts] for f in q.__slots__))  # type: ignore[attr-defined]
    s = b.sampling
    tensors = (s.temperature, s.top_k, s.top_p, s.seed, s.position)
    truncated = None if s.truncated is None else tuple(s.truncated[i] for i in order)
    sampling = RequestSampling(*(t[order] for t in tensors), truncated=truncated)
    return Batch(
        b.k[order], b.draft_ids[drafts], b.logits[rows], q, sampling,
        [b.params[i] for i in order], [b.positions[i] for i in order],
    )  # fmt: skip


@pytest.mark.parametrize("q_form", ["dense", "sparse"])
def test_seeded_output_is_independent_of_batch_makeup(q_form: str, device: torch.device) -> None:
    b = random_batch(ks(64, 4, 2), 500, q_form, seed=2, greedy_fraction=0.2)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(3)).tolist()
    _, shuffled = run_both(select(b, order), device)
    for probe in (0, 17, 63):
        _, alone = run_both(select(b, [probe]), device)
        at = order.index(probe)
        width = alone.token_ids.shape[1]
        assert torch.equal(alone.token_ids[0].cpu(), shuffled.token_ids[at, :width].cpu())
        assert bool((shuffled.token_ids[at, width:] == PLACEHOLDER).all())


@pytest.mark.parametrize("greedy_fraction", [0.0, 1.0])
def test_dense_q_errors_in_any_split_and_their_order(
    greedy_fraction: float, device: torch.device
) -> None:
    """Dense q rows are checked by the race programs, split by split, and the status is settled
    by a request's last program: an error in any split is found, for greedy requests too, and
    a request with several errors gets the first code in the order of the status codes."""
    k = [2, 3, 1, 2, 0, 2, 2]
    b = random_batch(k, 300, "dense", seed=13, greedy_fraction=greedy_fraction)
    assert isinstance(b.q, DenseQ)
    q, starts = b.q.probs, [0, 2, 5, 6, 8, 8, 10]  # draft rows of each request
    q[starts[0] + 1, 250] = float("nan")  # race split 2 of 4 (96 columns each)
    q[starts[1] + 2, 299] += 0.01  # the last split: sums to 1.01
    b.logits[2 + 5, 3] = float("nan")  # request 2's first row: non-finite logits ...
    q[starts[2], 100] = -0.25  # ... win over its negative q
    x3 = int(b.draft_ids[starts[3]])
    q[starts[3], x3] = 0.0  # out of support, and no longer normalised: 3 wins over 4
    x5 = int(b.draft_ids[starts[5] + 1])
    q[starts[5] + 1, (x5 + 1) % 300] += q[starts[5] + 1, x5]
    q[starts[5] + 1, x5] = 0.0  # out of support only
    expected = [
        SampleStatus.INVALID_DRAFT_PROBS,
        SampleStatus.DRAFT_PROBS_NOT_NORMALIZED,
        SampleStatus.NONFINITE_LOGITS,
        SampleStatus.DRAFT_PROBS_NOT_NORMALIZED,
        SampleStatus.OK,
        SampleStatus.DRAFT_TOKEN_OUT_OF_SUPPORT,
        SampleStatus.OK,
    ]
    for shape in (kernels.LaunchShape(32, 64, 96), None):
        ref, tri = run_both(b, device, shape=shape)
        assert_same(ref, tri)
        assert tri.status.tolist() == [int(s) for s in expected]
        assert tri.num_committed.tolist()[4] == 1 and tri.num_committed.tolist()[6] >= 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block": 32, "stats_split": 64, "race_split": 6}, "race_split"),
        ({"block": 32, "stats_split": 66, "race_split": 96}, "stats_split"),
        ({"block": 48, "stats_split": 96, "race_split": 96}, "block"),
        ({"block": 32, "stats_split": 64, "race_split": 96, "race_block": 24}, "race_block"),
        ({"block": 32, "stats_split": 0, "race_split": 96}, "stats_split"),
    ],
)
def test_launch_shapes_that_would_change_the_random_numbers_are_refused(
    kwargs: dict, field: str
) -> None:
    """Philox serves four vocabulary ids per call: a split or block that does not start at a
    multiple of 4 would draw other numbers than the reference, so it is an error."""
    with pytest.raises(ValueError, match=f"LaunchShape.{field}"):
        kernels.LaunchShape(**kwargs)
