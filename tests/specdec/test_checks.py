"""Each shared entry rule passes the valid case and names the field and the range otherwise."""

from __future__ import annotations

import grpc

from specdec.serving.checks import (
    committed_length_mismatch,
    duplicate_entry,
    over_capacity,
    step_error,
    token_out_of_vocab,
    too_many_drafts,
    unknown_request,
)
from specdec.serving.messages import ErrorReason


def test_duplicate_entry() -> None:
    assert duplicate_entry("a", 1, "entries[3]") is None
    error = duplicate_entry("a", 2, "entries[3]")
    assert error is not None and error.reason == ErrorReason.DUPLICATE_ENTRY
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == "entries[3].request_id 'a' appears 2 times in the block."
    assert duplicate_entry("a", 3) is not None


def test_unknown_request() -> None:
    assert unknown_request("a", {"a": 1}) is None
    error = unknown_request("b", {"a": 1}, "entries[0]")
    assert error is not None and error.reason == ErrorReason.UNKNOWN_REQUEST
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert error.message == "entries[0].request_id 'b' is not admitted."


def test_step_error() -> None:
    assert step_error(5, 5, "a") is None
    assert step_error(5, 4, "a", retry_ok=True) is None
    stale = step_error(5, 4, "a", "entries[1]")
    assert stale is not None and stale.reason == ErrorReason.STALE_STEP
    assert stale.message == "entries[1].step is 4 but request 'a' expects step 5."
    future = step_error(5, 6, "a", retry_ok=True)
    assert future is not None and future.reason == ErrorReason.FUTURE_STEP
    assert future.message == "step is 6 but request 'a' expects step 5 (or 4 again)."
    old = step_error(5, 3, "a", retry_ok=True)
    assert old is not None and old.reason == ErrorReason.STALE_STEP


def test_committed_length_mismatch() -> None:
    assert committed_length_mismatch(7, 7, "a") is None
    error = committed_length_mismatch(7, 6, "a", "entries[2]")
    assert error is not None and error.reason == ErrorReason.COMMITTED_LENGTH_MISMATCH
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert (
        error.message
        == "entries[2].committed_length is 6 but request 'a' expects 7 committed tokens."
    )


def test_too_many_drafts() -> None:
    assert too_many_drafts(16, 16, "draft_token_ids") is None
    error = too_many_drafts(17, 16, "draft_token_ids", "entries[0]")
    assert error is not None and error.reason == ErrorReason.INVALID_ARGUMENT
    assert error.message == "entries[0].draft_token_ids has 17 tokens; at most 16 per step."
    error = too_many_drafts(5, 4, "num_draft_tokens")
    assert error is not None and error.message.startswith("num_draft_tokens has 5 tokens")


def test_token_out_of_vocab() -> None:
    assert token_out_of_vocab([0, 49], 50, "new_token_ids") is None
    assert token_out_of_vocab((), 50, "new_token_ids") is None
    for bad in (50, -1):
        error = token_out_of_vocab([3, bad, 99], 50, "draft_token_ids", "entries[4]")
        assert error is not None and error.reason == ErrorReason.TOKEN_OUT_OF_VOCAB
        assert error.message == (
            f"entries[4].draft_token_ids holds {bad}, outside the vocabulary [0, 50)."
        )


def test_over_capacity() -> None:
    assert over_capacity(60, 4, 64) is None
    assert over_capacity(59, 4, 64, "entries[0]", bonus=True) is None
    error = over_capacity(61, 4, 64)
    assert error is not None and error.reason == ErrorReason.CAPACITY
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.message == "61 committed + 4 draft tokens would pass max_seq_len=64."
    error = over_capacity(60, 4, 64, "entries[1]", bonus=True)
    assert error is not None
    assert error.message == (
        "entries[1]: 60 committed + 4 draft tokens + 1 would pass max_seq_len=64."
    )
