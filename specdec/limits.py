"""Ranges of the integers that cross the wire and then live in int32 / int64 tensors.

`specdec.v1` carries them as uint32 / uint64, which hold values the services cannot use: a
client's -1 sent as uint32 is 4294967295, which overflows the int32 tensor it lands in. Every
parser checks its fields against these bounds, and the torch code (`specdec.rng`, the rejection
sampler) takes its own limits from here, so both sides agree. So do the limits on k and on
draft-ahead that the services' configs and `specdec serve`'s share: each is defined here once.
No torch import: the protocol layer and the orchestrator load this module without it.
"""

from __future__ import annotations

from specdec.synthetic_keys import spread_fits

INT32_MAX = 2**31 - 1
MAX_SEED = 2**63 - 1  # int64 tensors; Philox keys on its two 32-bit halves
MAX_POSITION = INT32_MAX  # absolute token positions: int64 tensors, Philox counter c1 (uint32)
MAX_TOP_K = INT32_MAX  # int32 tensors in the sampler
MAX_STEP = 2**63 - 1  # step numbers: int64 wherever they are stored or compared
MAX_COMMITTED_LENGTH = MAX_POSITION  # a request's committed tokens fill positions 0 .. n - 1
MAX_WIRE_NUM_DRAFT_TOKENS = INT32_MAX  # what a parser takes; a service takes at most the next
MAX_NUM_DRAFT_TOKENS = 64  # the largest max_num_draft_tokens (k) a service or specdec serve holds
DEFAULT_MAX_NUM_DRAFT_TOKENS = 16  # max_num_draft_tokens where none is given
MAX_DRAFT_AHEAD = 16  # draft-ahead's guesses per accepted count
MAX_DRAFT_DEADLINE_S = 3600.0  # the target's deadline for a draft's Propose
MAX_VOCAB = 2**24  # token ids travel through float32 race buffers: exact below 2**24


def check_range(value: int, name: str, low: int, high: int) -> None:
    """ValueError naming `name` unless low <= value <= high."""
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}.")


def check_draft_ahead(draft_ahead: int, saguaro_scale: float, synthetic_hit_rate: float | None,
                      synthetic_hit_rate_spread: float = 0.0,
                      draft_ahead_spread: bool = False) -> None:  # fmt: skip
    """ValueError naming the field unless draft-ahead's settings, which the draft service's
    config and `specdec serve`'s share, are in range and consistent: F in [0, MAX_DRAFT_AHEAD],
    the fan-out spread only with draft-ahead, Saguaro's scale in (0, 1] and below 1 only with
    draft-ahead, a synthetic hit rate in [0, 1] only with draft-ahead, and its spread over
    requests inside [0, 1] around it."""
    if not 0 <= draft_ahead <= MAX_DRAFT_AHEAD:
        raise ValueError(f"draft_ahead must be in [0, {MAX_DRAFT_AHEAD}], got {draft_ahead}.")
    if draft_ahead_spread and not draft_ahead:
        raise ValueError(
            "draft_ahead_spread spreads draft-ahead's fan-out over the accepted counts and "
            "guesses: it needs draft_ahead >= 1, got draft_ahead 0."
        )
    if not 0.0 < saguaro_scale <= 1.0:
        raise ValueError(f"saguaro_scale must be in (0, 1] (1: off), got {saguaro_scale}.")
    if saguaro_scale < 1.0 and not draft_ahead:
        raise ValueError(
            "saguaro_scale below 1 needs draft_ahead: it scales the tokens draft-ahead "
            f"guesses, got saguaro_scale {saguaro_scale} with draft_ahead 0."
        )
    rate = synthetic_hit_rate
    if rate is not None and not (draft_ahead and 0.0 <= rate <= 1.0):
        raise ValueError(f"synthetic_hit_rate must be in [0, 1] and needs draft_ahead, got {rate}.")
    spread = synthetic_hit_rate_spread
    if not spread >= 0.0:
        raise ValueError(f"synthetic_hit_rate_spread must be >= 0, got {spread}.")
    if spread > 0.0 and (rate is None or not spread_fits(rate, spread, 0.0, 1.0)):
        raise ValueError(
            f"synthetic_hit_rate_spread {spread} needs a synthetic_hit_rate it stays around "
            f"inside [0, 1], got synthetic_hit_rate {rate}."
        )
