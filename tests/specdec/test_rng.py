"""Philox in torch (specdec.rng) against the Random123 known answer and the Triton version."""

import torch
import triton
import triton.language as tl
from scipy import stats

from specdec import rng
from target_service.kernels import _philox, _vocab_bits


@triton.jit
def _philox_probe(seed_ptr, c0_ptr, c1_ptr, c2_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    bits = _philox(
        tl.load(seed_ptr + i),
        tl.load(c0_ptr + i).to(tl.uint32),
        tl.load(c1_ptr + i).to(tl.uint32),
        tl.load(c2_ptr + i).to(tl.uint32),
    )
    tl.store(out_ptr + i, bits.to(tl.int64))


def test_known_answer_zero_key_zero_counter() -> None:
    # Random123 kat_vectors: philox4x32 10 rounds, ctr 0, key 0.
    zero = torch.zeros((), dtype=torch.int64)
    words = [int(w) for w in rng.philox4(zero, zero, zero, zero)]
    assert words == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert int(rng.philox(zero, zero, zero, zero)) == 0x6627E8D5


def test_triton_matches_torch_bit_for_bit(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    n = 256
    seed = torch.randint(0, 2**63 - 1, (n,), generator=gen)
    c0, c1, c2 = (torch.randint(0, 2**32, (n,), generator=gen) for _ in range(3))
    c0[:4] = torch.tensor([0, 1, 2**32 - 1, 2**31])
    out = torch.empty(n, dtype=torch.int64, device=device)
    args = [t.to(device) for t in (seed, c0, c1, c2)]
    _philox_probe[(1,)](*args, out, N=n)
    assert torch.equal(out.cpu(), rng.philox(seed, c0, c1, c2))


@triton.jit
def _vocab_probe(seed_ptr, pos, stream, out_ptr, BLOCK: tl.constexpr):
    off = tl.program_id(0) * BLOCK
    seed = tl.load(seed_ptr)
    position = tl.full((), pos, tl.int32).to(tl.uint32)  # ints may arrive as constexprs
    bits = _vocab_bits(seed, off, position, tl.full((), stream, tl.int32).to(tl.uint32), BLOCK)
    tl.store(out_ptr + off + tl.arange(0, BLOCK), bits.to(tl.int64))


def test_vocabulary_noise_layout_matches_torch(device: torch.device) -> None:
    out = torch.empty(256, dtype=torch.int64, device=device)
    seed = torch.tensor([2**40 + 12345], device=device)
    _vocab_probe[(8,)](seed, 77, 3, out, BLOCK=32)
    expected = rng.vocab_bits(seed[0].cpu(), torch.tensor(77), torch.tensor(3), 256)
    assert torch.equal(out.cpu(), expected)
    assert len(set(expected.tolist())) == 256


def test_ids_bits_matches_vocab_layout() -> None:
    seed, pos, stream = torch.tensor([5, 2**50]), torch.tensor([3, 900]), torch.tensor([1, 3])
    full = rng.vocab_bits(seed, pos, stream, 1000)
    ids = torch.tensor([[0, 3, 4, 999, 517], [1, 2, 998, 6, 7]])
    assert torch.equal(rng.ids_bits(seed, pos, stream, ids), full.gather(1, ids))


def test_streams_and_positions_give_different_draws() -> None:
    seed = torch.tensor(7)
    pos = torch.arange(1000)
    a = rng.position_uniform(seed, pos, rng.Stream.ACCEPT)
    b = rng.position_uniform(seed, pos, rng.Stream.RECOVER)
    assert not torch.equal(a, b)
    assert len(set(a.tolist())) > 990


def test_exponential_is_finite_and_positive_at_the_extremes() -> None:
    bits = torch.tensor([0, 255, 2**32 - 512, 2**32 - 1])
    e = rng.exponential(bits)
    assert bool(torch.isfinite(e).all()) and bool((e > 0).all()), e
    u = rng.uniform(bits)
    assert float(u.max()) < 1.0 and float(u.min()) == 0.0


def test_uniform_and_exponential_are_well_distributed() -> None:
    seed = torch.tensor(123)
    u = rng.position_uniform(seed, torch.arange(100_000), rng.Stream.ACCEPT)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    e = rng.vocab_exponential(seed[None], torch.tensor([5]), rng.Stream.RECOVER, 100_000)[0]
    assert bool(torch.isfinite(e).all()) and float(e.min()) > 0.0
    assert stats.kstest(e.numpy(), "expon").pvalue > 1e-3
