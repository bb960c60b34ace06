"""The rules both engines apply to a request's entry in a block before serving it.

Each rule returns None when the entry passes it, else the `RequestError` to answer with (its
reason sets the status code). `entry` names the entry in its block, e.g. "entries[3]", and
prefixes the field a message names ("entries[3].step is ..."); empty, the field stands alone.
Torch-free: the engines keep only their own state (what a request has committed, its next step).
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from specdec.serving.messages import ErrorReason, RequestError


def _field(entry: str, name: str) -> str:
    return f"{entry}.{name}" if entry else name


def duplicate_entry(request_id: str, count: int, entry: str = "") -> RequestError | None:
    """A request may appear once in a block; `count` is how often it does."""
    if count <= 1:
        return None
    return RequestError.of(
        ErrorReason.DUPLICATE_ENTRY,
        f"{_field(entry, 'request_id')} {request_id!r} appears {count} times in the block.",
    )


def unknown_request(
    request_id: str, admitted: Container[str], entry: str = ""
) -> RequestError | None:
    if request_id in admitted:
        return None
    return RequestError.of(
        ErrorReason.UNKNOWN_REQUEST,
        f"{_field(entry, 'request_id')} {request_id!r} is not admitted.",
    )


def step_error(
    expected: int,
    got: int,
    request_id: str,
    entry: str = "",
    *,
    retry_ok: bool = False,
    later_ok: bool = False,
) -> RequestError | None:
    """The step must be `expected`, or with `retry_ok` the one before it again (a retry the
    engine serves anew), or with `later_ok` any later one (the caller checks that the entry's
    tokens bring the request to its committed length). Below is STALE_STEP, above
    FUTURE_STEP."""
    if got == expected or (retry_ok and got == expected - 1) or (later_ok and got > expected):
        return None
    reason = ErrorReason.STALE_STEP if got < expected else ErrorReason.FUTURE_STEP
    retry = f" (or {expected - 1} again)" if retry_ok else ""
    return RequestError.of(
        reason,
        f"{_field(entry, 'step')} is {got} but request {request_id!r} expects step "
        f"{expected}{retry}.",
    )


def committed_length_mismatch(
    expected: int, got: int, request_id: str, entry: str = ""
) -> RequestError | None:
    if got == expected:
        return None
    return RequestError.of(
        ErrorReason.COMMITTED_LENGTH_MISMATCH,
        f"{_field(entry, 'committed_length')} is {got} but request {request_id!r} expects "
        f"{expected} committed tokens.",
    )


def too_many_drafts(
    num_draft_tokens: int, limit: int, field: str, entry: str = ""
) -> RequestError | None:
    """At most `limit` draft tokens per step; `field` is the one that carries the count."""
    if num_draft_tokens <= limit:
        return None
    return RequestError.of(
        ErrorReason.INVALID_ARGUMENT,
        f"{_field(entry, field)} has {num_draft_tokens} tokens; at most {limit} per step.",
    )


def token_out_of_vocab(
    token_ids: Sequence[int], vocab_size: int, field: str, entry: str = ""
) -> RequestError | None:
    """Every id in [0, vocab_size); the message names the first one outside."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is None:
        return None
    return RequestError.of(
        ErrorReason.TOKEN_OUT_OF_VOCAB,
        f"{_field(entry, field)} holds {bad}, outside the vocabulary [0, {vocab_size}).",
    )


def over_capacity(
    committed: int, num_draft_tokens: int, max_seq_len: int, entry: str = "", *, bonus: bool = False
) -> RequestError | None:
    """The committed tokens, the drafts and, with `bonus`, the token a verify step adds after
    them must fit max_seq_len."""
    if committed + num_draft_tokens + int(bonus) <= max_seq_len:
        return None
    where = f"{entry}: " if entry else ""
    plus = " + 1" if bonus else ""
    return RequestError.of(
        ErrorReason.CAPACITY,
        f"{where}{committed} committed + {num_draft_tokens} draft tokens{plus} would pass "
        f"max_seq_len={max_seq_len}.",
    )
