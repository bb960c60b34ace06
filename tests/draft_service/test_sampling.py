"""The draft sampling head: q is exactly the distribution sampled from (chi-square), and it is
the processed, truncated, renormalised draft distribution (float64 reference)."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from draft_service.drafting import make_head, with_guesses
from draft_service.sampling import PAD_ID, sample_draft

VOCAB = 40
N = 20000


def _rows(n: int, temperature: float, top_k: int, top_p: float, seed: int = 7):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(VOCAB, generator=gen) * 2).expand(n, VOCAB).contiguous()
    return (
        logits,
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.int32),
        torch.full((n,), top_p),
        torch.full((n,), seed, dtype=torch.int64),
        torch.arange(n, dtype=torch.int64) + 100,
    )


def _reference(logits: torch.Tensor, t: float, top_k: int, top_p: float, k_support: int | None):
    """float64 q by the definition: softmax(l/T), top-k, top-p over top-k renormalised, top-K."""
    p = torch.softmax(logits.double() / t, -1)
    order = p.argsort(descending=True, stable=True)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    kk = top_k if 0 < top_k <= VOCAB else VOCAB
    topk_mass = p[order[:kk]].sum()
    cum = 0.0
    for x in order.tolist()[:kk]:
        if cum >= top_p:
            break
        keep[x] = True
        cum += float(p[x] / topk_mass)
    if k_support is not None:
        keep &= torch.isin(torch.arange(VOCAB), order[:k_support])
    q = torch.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("support", [None, 8, 64])
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 12, 0.9)])
def test_q_is_processed_truncated_distribution(support, temperature, top_k, top_p) -> None:  # type: ignore[no-untyped-def]
    logits, t, k, p, seed, pos = _rows(3, temperature, top_k, top_p)
    out = sample_draft(logits, t, k, p, seed, pos, support)
    ref = _reference(logits[0], temperature, top_k, top_p, support)
    if support is None:
        assert out.support_ids is None and out.probs.shape == (3, VOCAB)
        dense = out.probs[0].double()
    else:
        assert out.support_ids is not None
        assert out.probs.shape == (3, min(support, VOCAB))
        ids, probs = out.support_ids[0], out.probs[0]
        assert torch.all((ids == PAD_ID) == (probs == 0))
        dense = torch.zeros(VOCAB, dtype=torch.float64)
        dense[ids[ids >= 0].long()] = probs[ids >= 0].double()
    assert torch.allclose(dense, ref, atol=1e-6, rtol=1e-5)
    assert (dense > 0).equal(ref > 0)
    assert abs(float(out.probs[0].double().sum()) - 1.0) < 1e-5


@pytest.mark.parametrize("support", [None, 6])
def test_sampled_ids_follow_returned_q(support: int | None) -> None:
    logits, t, k, p, seed, pos = _rows(N, 0.9, 0, 0.95)
    out = sample_draft(logits, t, k, p, seed, pos, support)
    dense = torch.zeros(VOCAB, dtype=torch.float64)
    if out.support_ids is None:
        assert torch.equal(out.probs, out.probs[:1].expand_as(out.probs))
        dense = out.probs[0].double()
    else:
        ids = out.support_ids[0]
        dense[ids[ids >= 0].long()] = out.probs[0][ids >= 0].double()
    counts = torch.bincount(out.token_ids.long(), minlength=VOCAB).double()
    assert torch.all(counts[dense == 0] == 0), "a token outside q's support was sampled"
    support_mask = dense > 0
    observed = counts[support_mask].numpy()
    expected = (dense[support_mask] / dense[support_mask].sum() * N).numpy()
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    # The test has power: q at temperature 1.1 instead of 0.9 is clearly rejected.
    other = torch.softmax(logits[0].double() / 1.1, -1)[support_mask]
    assert stats.chisquare(observed, (other / other.sum() * N).numpy()).pvalue < 1e-6


def test_greedy_rows_take_argmax_and_rows_do_not_depend_on_batch() -> None:
    logits, t, k, p, seed, pos = _rows(4, 1.0, 0, 1.0)
    logits = logits + torch.randn(4, VOCAB)
    t[1] = 0.0
    batch = sample_draft(logits, t, k, p, seed, pos, 8)
    assert batch.greedy.tolist() == [False, True, False, False]
    assert int(batch.token_ids[1]) == int(logits[1].argmax())
    for row in (0, 2, 3):
        sl = slice(row, row + 1)
        alone = sample_draft(logits[sl], t[sl], k[sl], p[sl], seed[sl], pos[sl], 8)
        assert torch.equal(alone.token_ids, batch.token_ids[sl])
        assert torch.equal(alone.probs, batch.probs[sl])


def test_dense_and_sparse_pick_the_same_token_when_support_fits() -> None:
    logits, t, k, p, seed, pos = _rows(500, 1.0, 5, 1.0)
    dense = sample_draft(logits, t, k, p, seed, pos, None)
    sparse = sample_draft(logits, t, k, p, seed, pos, 16)
    assert torch.equal(dense.token_ids, sparse.token_ids)


def test_seed_and_position_change_the_draw() -> None:
    logits, t, k, p, seed, pos = _rows(200, 1.0, 0, 1.0)
    a = sample_draft(logits, t, k, p, seed, pos, 8).token_ids
    b = sample_draft(logits, t, k, p, seed + 1, pos, 8).token_ids
    c = sample_draft(logits, t, k, p, seed, pos + 1, 8).token_ids
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[1:], c[:-1])  # keyed by absolute position, not by row


def test_rejects_bad_support_size() -> None:
    logits, t, k, p, seed, pos = _rows(1, 1.0, 0, 1.0)
    with pytest.raises(ValueError, match="support_size must be >= 1"):
        sample_draft(logits, t, k, p, seed, pos, 0)


# Saguaro sampling: q' = q with its `count` most likely tokens scaled by C, renormalised


def _saguaro_reference(q: torch.Tensor, scale: float, count: int) -> torch.Tensor:
    """float64 q' by the definition, from a float64 q [V]."""
    top = q.argsort(descending=True, stable=True)[:count]
    scaled = q.clone()
    scaled[top] *= scale
    return scaled / scaled.sum()


def _dense(out, row: int = 0) -> torch.Tensor:  # type: ignore[no-untyped-def]
    if out.support_ids is None:
        return out.probs[row].double()
    ids, probs = out.support_ids[row], out.probs[row]
    dense = torch.zeros(VOCAB, dtype=torch.float64)
    dense[ids[ids >= 0].long()] = probs[ids >= 0].double()
    return dense


@pytest.mark.parametrize("support", [None, 8])
@pytest.mark.parametrize(("scale", "count"), [(0.5, 1), (0.25, 3), (0.1, 5)])
def test_saguaro_q_is_q_with_its_top_tokens_scaled(support, scale, count) -> None:  # type: ignore[no-untyped-def]
    logits, t, k, p, seed, pos = _rows(2, 0.7, 12, 0.95)
    out = sample_draft(logits, t, k, p, seed, pos, support, scale, count)
    q = _reference(logits[0], 0.7, 12, 0.95, support)
    ref = _saguaro_reference(q, scale, count)
    assert torch.allclose(_dense(out), ref, atol=1e-6, rtol=1e-5)
    assert (_dense(out) > 0).equal(ref > 0)
    # the scaled tokens are the ones draft-ahead guesses: the logits' top `count`
    top = logits[0].topk(count).indices
    plain = sample_draft(logits, t, k, p, seed, pos, support)
    ratio = _dense(out)[top] / _dense(plain)[top]
    others = (_dense(plain) > 0) & ~torch.isin(torch.arange(VOCAB), top)
    other_ratio = (_dense(out)[others] / _dense(plain)[others]).mean()
    assert torch.allclose(ratio / other_ratio, torch.full_like(ratio, scale), rtol=1e-4)


@pytest.mark.parametrize("support", [None, 6])
def test_saguaro_draws_follow_the_returned_q_not_the_plain_one(support: int | None) -> None:
    logits, t, k, p, seed, pos = _rows(N, 0.9, 0, 0.95)
    out = sample_draft(logits, t, k, p, seed, pos, support, 0.25, 2)
    assert torch.equal(out.probs, out.probs[:1].expand_as(out.probs))
    dense = _dense(out)
    counts = torch.bincount(out.token_ids.long(), minlength=VOCAB).double()
    assert torch.all(counts[dense == 0] == 0), "a token outside q's support was sampled"
    mask = dense > 0
    observed = counts[mask].numpy()
    expected = (dense[mask] / dense[mask].sum() * N).numpy()
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    # Power: the unscaled q (what a head that scales q only on the wire, or only in the
    # draw, would pair with the draws) is clearly rejected.
    plain = _dense(sample_draft(logits, t, k, p, seed, pos, support))[mask]
    assert stats.chisquare(observed, (plain / plain.sum() * N).numpy()).pvalue < 1e-6


def test_saguaro_leaves_greedy_rows_and_scale_one_alone() -> None:
    logits, t, k, p, seed, pos = _rows(4, 1.0, 0, 1.0)
    logits = logits + torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    t[1] = 0.0
    for support in (None, 8):
        plain = sample_draft(logits, t, k, p, seed, pos, support)
        scaled = sample_draft(logits, t, k, p, seed, pos, support, 0.3, 2)
        assert int(scaled.token_ids[1]) == int(logits[1].argmax())
        assert torch.equal(scaled.probs[1], plain.probs[1])  # greedy row untouched
        assert not torch.equal(scaled.probs[0], plain.probs[0])
        off = sample_draft(logits, t, k, p, seed, pos, support, 1.0, 2)
        assert torch.equal(off.probs, plain.probs) and torch.equal(off.token_ids, plain.token_ids)


@pytest.mark.parametrize(("scale", "count"), [(0.0, 2), (1.5, 2), (-0.5, 1), (0.5, -1)])
def test_rejects_bad_saguaro_inputs(scale: float, count: int) -> None:
    logits, t, k, p, seed, pos = _rows(1, 1.0, 0, 1.0)
    with pytest.raises(ValueError, match=r"top_scale must be in \(0, 1\] and top_count >= 0"):
        sample_draft(logits, t, k, p, seed, pos, 8, scale, count)


@pytest.mark.parametrize("support", [None, 8])
def test_guessing_head_guesses_exactly_the_scaled_tokens(support: int | None) -> None:
    """The head draft-ahead captures: its guesses are the tokens whose q Saguaro scaled."""
    logits, t, k, p, seed, pos = _rows(3, 0.8, 0, 1.0)
    guesses = 3
    head = with_guesses(make_head(VOCAB, support, 0.5, guesses), VOCAB, guesses)
    plain = make_head(VOCAB, support)
    last = torch.zeros(3, dtype=torch.long)
    out = head(logits[:, None, :], last, t, k, p, seed, pos)
    ref = plain(logits[:, None, :], last, t, k, p, seed, pos)
    top = out[-1][0].long()
    q_scaled = torch.zeros(VOCAB, dtype=torch.float64)
    q_plain = torch.zeros(VOCAB, dtype=torch.float64)
    if support is None:
        q_scaled, q_plain = out[1][0].double(), ref[1][0].double()
    else:
        q_scaled[out[2][0].long()] = out[1][0].double()
        q_plain[ref[2][0].long()] = ref[1][0].double()
    ratio = q_scaled / q_plain
    is_top = torch.isin(torch.arange(VOCAB), top)
    assert torch.allclose(ratio[is_top] / ratio[~is_top & (q_plain > 0)].mean(),
                          torch.full((guesses,), 0.5, dtype=torch.float64), rtol=1e-4)  # fmt: skip
