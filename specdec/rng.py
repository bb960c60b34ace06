"""Counter-based random numbers keyed by (seed, absolute position, stream).

Every random draw in specdec is a pure function of the request's seed, the absolute position of
the token it decides, the stream it belongs to and (for per-vocabulary noise) the vocabulary
index. Nothing depends on the batch, the slot or a global generator, so a seeded request gives
the same tokens alone, in any batch, after a retry, or through a pipelined schedule
(docs/design.md, "Exactness").

The generator is Philox-4x32-10 (Salmon et al., SC'11). The same function is written here in
torch (int64 arithmetic on values in [0, 2**32)) and in Triton (`philox_uint32` in
`target_service.kernels`); tests check that the two agree bit for bit.

Counter layout: c0 = vocabulary index // 4 (0 for per-position draws), c1 = position,
c2 = stream, c3 = 0; key = (seed & 0xffffffff, seed >> 32). One Philox call yields four
32-bit words; vocabulary index v takes word v % 4 of counter v // 4, so per-vocabulary noise
costs a quarter of the rounds (the race over 150k ids is otherwise integer-bound on a GPU).
"""

from __future__ import annotations

from enum import IntEnum

import torch

# re-exported: callers of rng name the limits of its keys and counters from here
from specdec.limits import MAX_POSITION as MAX_POSITION
from specdec.limits import MAX_SEED as MAX_SEED

MASK32 = 0xFFFFFFFF
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUNDS = 10
UNIFORM_SCALE = 1.0 / 16777216.0  # 2**-24: the top 24 bits of a draw fill a float32 mantissa
EXPONENTIAL_SCALE = 1.0 / 8388608.0  # 2**-23


class Stream(IntEnum):
    """Independent random streams; one draw per (seed, position, stream[, vocabulary index])."""

    ACCEPT = 0  # acceptance test u < p(x) / q(x)
    RECOVER = 1  # exponential race over the residual max(0, p - q) after a rejection
    BONUS = 2  # exponential race over p after all drafts were accepted
    DRAFT = 3  # the draft model's own sampling


def _mulhilo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b for a in [0, 2**32), without int64 overflow."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    lo_prod = a_lo * b  # < 2**48
    hi_prod = a_hi * b  # < 2**48
    hi = (hi_prod + (lo_prod >> 16)) >> 16
    lo = (lo_prod + ((hi_prod & 0xFFFF) << 16)) & MASK32
    return hi & MASK32, lo


def philox(
    seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor
) -> torch.Tensor:
    """First 32-bit word of Philox-4x32-10 as int64 in [0, 2**32); arguments broadcast."""
    return philox4(seed, c0, c1, c2)[0]


def philox4(
    seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four 32-bit words of Philox-4x32-10 (int64 in [0, 2**32)); arguments broadcast.

    seed: int64 in [0, 2**63); c0, c1, c2: int64 in [0, 2**32); c3 = 0.
    """
    k0 = seed & MASK32
    k1 = (seed >> 32) & MASK32
    c0, c1, c2 = torch.broadcast_tensors(c0 & MASK32, c1 & MASK32, c2 & MASK32)
    c3 = torch.zeros_like(c0)
    k0, k1 = torch.broadcast_tensors(k0, k1)
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mulhilo(c2, PHILOX_ROUND_B)
        hi_a, lo_a = _mulhilo(c0, PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & MASK32
        k1 = (k1 + PHILOX_KEY_B) & MASK32
    return c0, c1, c2, c3


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 1) from the top 24 of 32 random bits: exact in float32 on every device."""
    return (bits >> 8).to(torch.float32) * UNIFORM_SCALE


def exponential(bits: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws, -log(u) with u = (top 23 bits + 0.5) / 2**23, exact in float32 and
    strictly inside (0, 1), so never inf or 0. (With 24 bits, 2**24 - 0.5 rounds to 2**24 and
    u = 1 gave E = -0 once in 2**24 draws.)"""
    return -torch.log(((bits >> 9).to(torch.float32) + 0.5) * EXPONENTIAL_SCALE)


def position_uniform(seed: torch.Tensor, position: torch.Tensor, stream: Stream) -> torch.Tensor:
    """One uniform per (seed, position) for the given stream; seed and position broadcast."""
    zero = torch.zeros((), dtype=torch.int64, device=position.device)
    return uniform(philox(seed, zero, position, torch.full_like(zero, int(stream))))


def vocab_bits(
    seed: torch.Tensor, position: torch.Tensor, stream: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Random words [..., vocab_size] for each (seed, position, stream) (broadcast over ...):
    id v is word v % 4 of counter v // 4."""
    quads = torch.arange((vocab_size + 3) // 4, dtype=torch.int64, device=position.device)
    words = philox4(seed[..., None], quads, position[..., None], stream[..., None])
    return torch.stack(words, dim=-1).flatten(-2)[..., :vocab_size]


def ids_bits(
    seed: torch.Tensor, position: torch.Tensor, stream: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The `vocab_bits` words of the given ids [..., n] only (same layout, fewer rounds)."""
    words = philox4(seed[..., None], ids // 4, position[..., None], stream[..., None])
    return torch.stack(words, dim=-1).gather(-1, (ids % 4)[..., None]).squeeze(-1)


def vocab_exponential(
    seed: torch.Tensor, position: torch.Tensor, stream: Stream, vocab_size: int
) -> torch.Tensor:
    """Exp(1) noise [..., vocab_size] for each (seed, position); used for exponential races."""
    stream_t = torch.full_like(position, int(stream))
    return exponential(vocab_bits(seed, position, stream_t, vocab_size))
