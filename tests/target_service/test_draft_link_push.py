"""`DraftLink` over a real gRPC stream on loopback, against a scripted draft service. In push
mode: the reader thread, `collect`, `take_push` and the count of pushes due (one follows each
answer), a push that does not come (a stall, then `reopen`), and an answer where a push was due.
In lock-step mode: a block sent without waiting (`send`) and its answer read later (`collect`),
within its deadline or as a stall, and a push no block asked for. In both: `reopen` and a
graceful `close`.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from specdec.pb import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.serving.messages import ModelInfo
from specdec.serving.server import Server, ServerConfig
from target_service.draft_link import DraftDown, DraftLink, DraftStalled

INFO = ModelInfo("fake", 97, 97, "fake-tokenizer", 256, 8, 8, 1 << 20, "float32", True)


class ScriptedDraft(draft_pb2_grpc.DraftServiceServicer):
    """Answers each block with one draft token per entry (its step number), then pushes (if
    asked) after `push_delay_s`; `script[n]` changes the n-th block's push: "none" (never
    sent) or "answer" (a second answer instead)."""

    def __init__(self) -> None:
        self.script: dict[int, str] = {}
        self.push_delay_s = 0.0
        self.answer_delay_s = 0.0  # before each answer: the draft's own work
        self.push_unasked = False  # a misbehaving draft: it pushes after every answer
        self.blocks = 0

    def GetModelInfo(self, request, context):  # type: ignore[no-untyped-def]
        return INFO.to_pb()

    def Propose(self, request_iterator, context) -> Iterator[draft_pb2.ProposeResponse]:  # type: ignore[no-untyped-def]
        for block in request_iterator:
            self.blocks += 1
            time.sleep(self.answer_delay_s)
            yield _response(block, pushed=False)
            if not (block.push_chains or self.push_unasked):
                continue
            action = self.script.get(self.blocks, "push")
            if action == "none":
                continue
            time.sleep(self.push_delay_s)
            yield _response(block, pushed=action == "push")


def _response(block: draft_pb2.ProposeBlock, pushed: bool) -> draft_pb2.ProposeResponse:
    out = common_pb2.DraftBlock()
    for e in block.entries:
        out.request_ids.append(e.request_id)
        out.steps.append(e.step + pushed)
        out.committed_lengths.append(e.committed_length)
        out.num_draft_tokens.append(1)
        out.q_forms.append(common_pb2.Q_FORM_NONE)
    out.draft_token_ids = struct.pack(f"<{len(block.entries)}i", *[e.step for e in block.entries])
    return draft_pb2.ProposeResponse(block=out, pushed=pushed)


@pytest.fixture
def draft() -> Iterator[tuple[ScriptedDraft, int]]:
    servicer = ScriptedDraft()
    add = draft_pb2_grpc.add_DraftServiceServicer_to_server
    server = Server(ServerConfig(host="127.0.0.1", port=0), ["specdec.v1.DraftService"],
                    lambda s: add(servicer, s))  # fmt: skip
    server.start()
    server.set_serving(True)
    yield servicer, server.port
    server.stop(0)


def _entries(step: int) -> list[draft_pb2.ProposeEntry]:
    return [draft_pb2.ProposeEntry(request_id="a", step=step, committed_length=5 + step,
                                   num_draft_tokens=1)]  # fmt: skip


def test_each_answer_is_followed_by_its_push(draft: tuple[ScriptedDraft, int]) -> None:
    servicer, port = draft
    servicer.push_delay_s = 0.2  # the pass ahead: take_push waits for the push that is due
    link = DraftLink(f"127.0.0.1:{port}", 1 << 24, 5.0, push=True)
    try:
        assert link.push and link.take_push(1.0) is None  # nothing answered yet: none due
        answer, _ = link.propose(_entries(0), 1.0)
        assert not answer.pushed and answer.block.steps == [0]
        started = time.monotonic()
        push = link.take_push(2.0)
        assert push is not None and push.pushed and push.block.steps == [1]
        assert time.monotonic() - started > 0.1, "it waited for the push that was due"
        assert link.take_push(1.0) is None  # taken
        link.send(_entries(1))  # a step verified from the push: its answer read later
        assert link.awaiting
        answer, _ = link.collect(2.0) or (None, 0.0)
        assert answer is not None and not answer.pushed and answer.block.steps == [1]
        push = link.take_push(2.0)
        assert push is not None and push.block.steps == [2]
    finally:
        link.close()


def test_a_push_that_does_not_come_is_a_stall_and_reopen_recovers(
    draft: tuple[ScriptedDraft, int],
) -> None:
    servicer, port = draft
    servicer.script[1] = "none"
    link = DraftLink(f"127.0.0.1:{port}", 1 << 24, 5.0, push=True)
    try:
        link.propose(_entries(0), 1.0)
        with pytest.raises(DraftStalled):
            link.take_push(0.3)
        link.reopen()
        answer, _ = link.propose(_entries(1), 2.0)
        assert answer.block.steps == [1]
        push = link.take_push(2.0)
        assert push is not None and push.block.steps == [2]
    finally:
        link.close(graceful=False)


def test_an_answer_where_a_push_was_due_takes_the_draft_as_down(
    draft: tuple[ScriptedDraft, int],
) -> None:
    servicer, port = draft
    servicer.script[1] = "answer"
    link = DraftLink(f"127.0.0.1:{port}", 1 << 24, 5.0, push=True)
    try:
        link.propose(_entries(0), 1.0)
        with pytest.raises(DraftDown, match="answer to no block"):
            link.take_push(2.0)
    finally:
        link.close(graceful=False)


def _readers() -> set[int | None]:
    return {t.ident for t in threading.enumerate() if t.name == "draft-propose-reader"}


def _settles(check: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + 5.0
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("push", [True, False])
def test_a_reopened_stream_leaves_no_reader_behind(
    draft: tuple[ScriptedDraft, int], push: bool
) -> None:
    """`reopen` (after a stall) cancels the stream it replaces: its reader thread ends, and so
    does the draft's side of it, rather than both waiting until the channel closes; in both
    modes, since a lock-step stream has a reader too."""
    _, port = draft
    before = _readers()
    link = DraftLink(f"127.0.0.1:{port}", 1 << 24, 5.0, push=push)
    try:
        link.propose(_entries(0), 1.0)
        for _ in range(3):
            link.reopen()
        assert _settles(lambda: len(_readers() - before) == 1), len(_readers() - before)
    finally:
        link.close()
    assert _settles(lambda: _readers() <= before), "a reader thread outlived its stream"


def test_a_lockstep_link_sends_a_block_and_collects_its_answer_later(
    draft: tuple[ScriptedDraft, int],
) -> None:
    """Without pushes (a draft that does not draft ahead) the hub sends a block of asks for no
    drafts without waiting: `send` returns at once, `collect` reads the answer, and the
    stream goes on in lock-step after it."""
    servicer, port = draft
    servicer.answer_delay_s = 0.2
    link = DraftLink(f"127.0.0.1:{port}", 1 << 24, 5.0, push=False)
    try:
        assert not link.push
        started = time.monotonic()
        link.send(_entries(0))
        assert time.monotonic() - started < 0.15, "send waited for the answer"
        assert link.awaiting
        answer, round_trip = link.collect(2.0) or (None, 0.0)
        assert answer is not None and answer.block.steps == [0] and not link.awaiting
        assert round_trip >= 0.2
        assert link.collect(2.0) is None  # nothing sent: nothing to read
        servicer.answer_delay_s = 0.0
        answer, _ = link.propose(_entries(1), 2.0)
        assert answer.block.steps == [1]
    finally:
        link.close()


def test_a_lockstep_answer_past_its_deadline_is_a_stall_and_reopen_recovers(
    draft: tuple[ScriptedDraft, int],
) -> None:
    servicer, port = draft
    servicer.answer_delay_s = 1.0
    link = DraftLink(f"127.0.0.1:{port}", 1 << 24, 5.0, push=False)
    try:
        link.send(_entries(0))
        with pytest.raises(DraftStalled):
            link.collect(0.2)  # the read times out after 0.2 s and cancels the stream
        link.reopen()
        assert not link.awaiting, "the stalled block's answer is gone with its stream"
        servicer.answer_delay_s = 0.0
        answer, _ = link.propose(_entries(1), 2.0)
        assert answer.block.steps == [1]
    finally:
        link.close(graceful=False)


@pytest.mark.parametrize("push", [True, False])
@pytest.mark.parametrize("pending", [False, True])
def test_a_graceful_close_reads_what_is_due_and_ends_at_once(
    draft: tuple[ScriptedDraft, int], push: bool, pending: bool
) -> None:
    """`close` ends the requests, reads the answers still due (a block sent without waiting)
    and waits for the draft to end the stream, which a healthy draft does at once: no
    deadline is waited out, and no reader thread is left."""
    servicer, port = draft
    before = _readers()
    link = DraftLink(f"127.0.0.1:{port}", 1 << 24, 5.0, push=push)
    link.propose(_entries(0), 2.0)
    if pending:
        link.send(_entries(1))
    started = time.monotonic()
    link.close()
    assert time.monotonic() - started < 2.0, "close waited out a timeout"
    assert servicer.blocks == 1 + pending, "the block sent was not delivered before the end"
    assert _settles(lambda: _readers() <= before), "a reader thread outlived its stream"


def test_a_push_on_a_lockstep_stream_takes_the_draft_as_down(
    draft: tuple[ScriptedDraft, int],
) -> None:
    """A lock-step stream asks for no pushes: a draft that pushes anyway is broken, and the
    next answer's read says so (DraftDown) rather than taking the push for an answer."""
    servicer, port = draft
    servicer.push_unasked = True
    link = DraftLink(f"127.0.0.1:{port}", 1 << 24, 5.0, push=False)
    try:
        answer, _ = link.propose(_entries(0), 2.0)  # its push follows, unasked
        assert not answer.pushed
        with pytest.raises(DraftDown, match="pushed chains on a lock-step"):
            link.propose(_entries(1), 2.0)
    finally:
        link.close(graceful=False)
