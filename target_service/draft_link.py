"""The hub's connection to its draft service: one long-lived Propose stream for the steps, and
unary Admit and Release calls (`target_service.hub` drives it).

A failed Propose (any status: the stream is over either way) or an Admit/Release that finds
the service unreachable raises `DraftDown`; the hub then runs every request at k = 0 until it
is given a new draft service. An Admit the service answers with an error (a full cache, a
prompt past its max_seq_len) only concerns that request.

A call that outlives the deadline the hub gives it raises `DraftStalled`: a Propose stream (it
has no deadline per message) is cancelled once an answer has not come within it, so nothing the
draft answers late is ever read; `probe` then tells when the service answers again.

The Propose stream is read by a thread of its own, so that an answer arrives while the hub's
thread waits on the GPU for a verify (a thread blocked there lets go of the GIL), and reading
it after the verify takes a queue's get: gRPC's synchronous API only starts receiving a message
once a reader asks for it, which read after the verify cost a step at k = 0 about 0.4 ms of
thread hand-offs on an H200 host.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import grpc

from specdec.pb import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.serving.client import HANDOFF_WAIT_S, Outbox, make_channel
from specdec.serving.messages import AdmitRequest, ModelInfo

_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
PROBE_TIMEOUT_S = 120.0  # a stalled draft silent this long is taken as down


class DraftDown(Exception):
    """The draft service failed or cannot be reached."""


class DraftStalled(Exception):
    """The draft service did not answer within the deadline (it may still be alive)."""


def _describe(e: grpc.RpcError) -> str:
    code, details = e.code(), e.details()  # type: ignore[attr-defined]
    return f"{code.name if code else 'UNKNOWN'}: {details}"


class PendingAdmits:
    """Admit calls in flight (they run while the target prefills the same requests)."""

    def __init__(self, futures: list[tuple[AdmitRequest, grpc.Future]], address: str):
        self.admissions = [a for a, _ in futures]
        self.request_ids = {a.request_id for a in self.admissions}
        self._futures = futures
        self._address = address

    def done(self, timeout_s: float) -> bool:
        """Whether every call has ended, waiting up to `timeout_s` for them."""
        end = time.monotonic() + timeout_s
        for _, future in self._futures:
            try:
                future.exception(timeout=max(0.0, end - time.monotonic()))
            except grpc.FutureTimeoutError:
                return False
            except grpc.FutureCancelledError:
                pass
        return True

    def cancel(self) -> None:
        for _, future in self._futures:
            future.cancel()

    def wait(self) -> dict[str, str | None]:
        """Each request's error message (None: admitted); DraftDown if the service is gone,
        DraftStalled if it did not answer within the calls' timeout."""
        out: dict[str, str | None] = {}
        down: grpc.RpcError | None = None
        for adm, future in self._futures:
            try:
                future.result()
                out[adm.request_id] = None
            except grpc.RpcError as e:
                if e.code() in (*_DOWN, grpc.StatusCode.DEADLINE_EXCEEDED):  # type: ignore[attr-defined]
                    down = e
                out[adm.request_id] = _describe(e)
        if down is not None:
            message = f"Admit on the draft service at {self._address}: {_describe(down)}"
            if down.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
                raise DraftStalled(message)
            raise DraftDown(message)
        return out


class _ProposeStream:
    """The Propose stream: a thread of its own reads every message the draft sends into a
    queue, so that an answer is there when the hub looks for it after a verify, a push that
    has arrived can be looked at without waiting (`poll`), and an answer is waited for with a
    deadline (`next`). The read side's failure (an RpcError, or the stream's end) is queued
    as the last item."""

    def __init__(self, method: Callable[[Iterator[Any]], Iterator[Any]]):
        self._requests = Outbox()
        self._call: Any = method(iter(self._requests))  # a grpc Call too
        self._messages: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._read, name="draft-propose-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            for message in self._call:
                self._messages.put(message)
            self._messages.put(StopIteration())
        except grpc.RpcError as e:
            self._messages.put(e)

    def send(self, block: draft_pb2.ProposeBlock, wait_s: float = 0.0) -> None:
        """Sends the block; with `wait_s`, returns once gRPC has sent it (`Outbox.put`)."""
        self._requests.put(block, wait_s)

    def next(self, timeout_s: float) -> draft_pb2.ProposeResponse:
        """The next message; queue.Empty after `timeout_s`; the read side's failure raised."""
        return self._raise(self._messages.get(timeout=max(0.0, timeout_s)))

    def poll(self) -> draft_pb2.ProposeResponse | None:
        """The next message if one has arrived, else None."""
        try:
            return self._raise(self._messages.get_nowait())
        except queue.Empty:
            return None

    def _raise(self, item: Any) -> draft_pb2.ProposeResponse:
        if isinstance(item, BaseException):
            self._messages.put(item)  # stays the last: every later read fails alike
            raise item
        return item  # type: ignore[no-any-return]

    def cancel(self) -> None:
        self._call.cancel()

    def close(self) -> None:
        """The requests end after what was sent; the draft answers them, then ends its side."""
        self._requests.close()

    def ended(self, timeout_s: float) -> bool:
        """Whether the draft ended the stream within `timeout_s`, its messages dropped."""
        end = time.monotonic() + timeout_s
        try:
            while not isinstance(self._messages.get(timeout=max(0.0, end - time.monotonic())),
                                 BaseException):  # fmt: skip
                pass
        except queue.Empty:
            return False
        return True


class DraftLink:
    """A connected draft service; `info` is its ModelInfo. Not thread-safe (the hub's loop
    thread alone uses it).

    `propose` sends a block and waits for its answer; `send` sends one whose answer `collect`
    reads later (the hub verifies meanwhile: pushed chains, or a block that asks for no drafts),
    by then read off the stream by its reader thread.
    With `push` the hub takes chains the draft pushes ahead of its asks: every ProposeBlock asks
    for them and `take_push` gives the latest one that has arrived. A push read while an answer
    is awaited is for a step already asked for: it is dropped."""

    def __init__(
        self,
        address: str,
        max_message_bytes: int,
        timeout_s: float,
        tls_root_cert: bytes | None = None,
        tls_server_name: str | None = None,
        push: bool = False,
    ):
        self.address, self.timeout_s, self.push = address, timeout_s, push
        self._channel = make_channel(address, max_message_bytes, tls_root_cert, tls_server_name)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
            self._stub = draft_pb2_grpc.DraftServiceStub(self._channel)
            pb = self._stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=timeout_s)
        except grpc.FutureTimeoutError as e:
            self._channel.close()
            raise DraftDown(
                f"The draft service at {address} did not answer within {timeout_s} s."
            ) from e
        except grpc.RpcError as e:
            self._channel.close()
            raise DraftDown(
                f"GetModelInfo on the draft service at {address}: {_describe(e)}"
            ) from e
        self.info = ModelInfo.from_pb(pb)
        # pushes only from a draft that drafts ahead: a lock-step one would push nothing
        self.push = push and self.info.drafts_ahead
        self._stream = _ProposeStream(self._stub.Propose)
        # send times of blocks whose answer is not read yet, and whether each asked for a push
        self._sent: list[tuple[float, bool]] = []
        self._push: draft_pb2.ProposeResponse | None = None  # the latest push read
        self._pushes_due = 0  # answers read whose push (one follows each) is not read yet
        self._broken = False

    def propose(
        self,
        entries: Sequence[draft_pb2.ProposeEntry],
        deadline_s: float,
        target_step_s: float = 0.0,
        push: bool = True,
    ) -> tuple[draft_pb2.ProposeResponse, float]:
        """The drafts for `entries` and the round trip's wall time in seconds; DraftStalled
        after `deadline_s` without an answer (the stream is then cancelled: `reopen` starts
        another). `target_step_s`: ProposeBlock.target_step_s; `push` (push mode): the draft
        pushes its chains after the answer."""
        if self._sent:
            raise RuntimeError("propose() with an answer not collected")
        self.send(entries, target_step_s, push, handoff=False)  # the wait below lets it go
        answer = self.collect(deadline_s)
        assert answer is not None
        return answer

    def send(
        self,
        entries: Sequence[draft_pb2.ProposeEntry],
        target_step_s: float = 0.0,
        push: bool = True,
        handoff: bool = True,
    ) -> None:
        """Sends a block whose answer `collect` reads; with `push` (push mode) the draft
        pushes its chains after it (ProposeBlock.push_chains). With `handoff` it returns once
        gRPC has sent the block (`specdec.serving.client.Outbox`): the hub goes on to verify
        while holding the GIL, and a draft that drafts from the block must get it now, not
        when the hub next lets go of the GIL (a few thread hand-offs: about 0.4 ms on an H200
        host)."""
        push = push and self.push
        block = draft_pb2.ProposeBlock(
            entries=entries, target_step_s=target_step_s, push_chains=push
        )
        self._push = None  # whatever came before is for an earlier step
        self._stream.send(block, HANDOFF_WAIT_S if handoff else 0.0)
        self._sent.append((time.perf_counter(), push))

    @property
    def awaiting(self) -> bool:
        """Whether a block sent (`send`) waits for its answer to be collected."""
        return bool(self._sent)

    def collect(self, deadline_s: float) -> tuple[draft_pb2.ProposeResponse, float] | None:
        """The answer to the oldest block sent and its round trip (None if none waits), the
        pushes before it dropped (they are for steps already asked for); DraftStalled if it
        has not come within `deadline_s` (the stream is then cancelled: `reopen`), DraftDown if
        the stream failed."""
        if not self._sent:
            return None
        sent, push = self._sent.pop(0)  # a failure below breaks the stream: `reopen` clears
        end = time.monotonic() + deadline_s
        while True:
            message = self._next(end - time.monotonic(), deadline_s)
            if not message.pushed:
                break
            if not self.push:
                self._broken = True
                raise DraftDown(f"The draft service at {self.address} pushed chains on a "
                                "lock-step Propose stream.")  # fmt: skip
            self._pushes_due -= 1
        self._pushes_due += push  # the draft pushes after each answer to a block that asked
        return message, time.perf_counter() - sent

    @property
    def push_due(self) -> bool:
        """Whether a push follows an answer read (or has come): the last block asked for one."""
        return self._pushes_due > 0 or self._push is not None

    def take_push(self, deadline_s: float) -> draft_pb2.ProposeResponse | None:
        """The latest push (none waits for an answer: `collect` first), taken: a later call
        gives a newer one or None. The draft pushes once after each answer, at the end of its
        pass ahead, and reads no ask before it: so where one is due this waits for it, up to
        `deadline_s` (DraftStalled past it), as an ask would have waited. DraftDown if the
        stream failed, or sent an answer no block asked for."""
        assert self.push and not self._sent
        end = time.monotonic() + deadline_s
        while True:
            if self._pushes_due > 0:
                message = self._next(end - time.monotonic(), deadline_s)
            else:
                polled = self._next(None, deadline_s)
                if polled is None:
                    break
                message = polled
            if not message.pushed:
                self._broken = True
                raise DraftDown(f"The draft service at {self.address} sent an answer to "
                                "no block on its Propose stream.")  # fmt: skip
            self._pushes_due = max(0, self._pushes_due - 1)
            self._push = message
        push, self._push = self._push, None
        return push

    @overload
    def _next(self, timeout_s: float, deadline_s: float) -> draft_pb2.ProposeResponse: ...
    @overload
    def _next(self, timeout_s: None, deadline_s: float) -> draft_pb2.ProposeResponse | None: ...

    def _next(self, timeout_s: float | None, deadline_s: float) -> draft_pb2.ProposeResponse | None:
        """The next message of the Propose stream (`timeout_s` None: one that has arrived,
        else None), its failures raised as DraftDown, and its silence past `timeout_s` as
        DraftStalled (the stream cancelled)."""
        try:
            if timeout_s is None:
                return self._stream.poll()
            return self._stream.next(timeout_s)
        except queue.Empty as e:
            self._stream.cancel()
            self._broken = True
            raise DraftStalled(
                f"The draft service at {self.address} did not answer a Propose within "
                f"{deadline_s * 1e3:.0f} ms."
            ) from e
        except grpc.RpcError as e:
            self._broken = True
            raise DraftDown(
                f"Propose on the draft service at {self.address}: {_describe(e)}"
            ) from e
        except StopIteration as e:
            self._broken = True
            raise DraftDown(f"The draft service at {self.address} ended the Propose stream.") from e

    def reopen(self) -> None:
        """A new Propose stream in place of one that was cancelled."""
        self._stream.cancel()  # its reader thread ends; the draft's side of it too
        self._stream = _ProposeStream(self._stub.Propose)
        self._push = None
        self._pushes_due = 0
        self._sent.clear()  # their answers are gone with the stream
        self._broken = False

    def probe(self, timeout_s: float = PROBE_TIMEOUT_S) -> grpc.Future:
        """A call that completes once the service serves again, or fails if it is gone or has
        not answered within `timeout_s` (a host that vanished without resetting the connection
        would otherwise hold it for as long as TCP retries): a Release of nothing, which waits
        for the engine as a Propose would (GetModelInfo is answered by a process whose engine
        is stuck)."""
        return self._stub.Release.future(  # type: ignore[no-any-return]
            common_pb2.ReleaseRequest(), timeout=timeout_s
        )

    def start_admit(
        self, admissions: Sequence[AdmitRequest], timeout_s: float | None = None
    ) -> PendingAdmits:
        """Admit calls, each with `timeout_s` (default: the link's)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        futures = [(a, self._stub.Admit.future(a.to_pb(), timeout=timeout)) for a in admissions]
        return PendingAdmits(futures, self.address)

    def release(self, request_ids: Sequence[str], timeout_s: float | None = None) -> None:
        """Frees the requests' KV on the draft; DraftDown if the service is gone, DraftStalled
        if it did not answer within `timeout_s` (default: the link's)."""
        pb = common_pb2.ReleaseRequest(request_ids=request_ids)
        try:
            self._stub.Release(pb, timeout=self.timeout_s if timeout_s is None else timeout_s)
        except grpc.RpcError as e:
            message = f"Release on the draft service at {self.address}: {_describe(e)}"
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
                raise DraftStalled(message) from e
            if e.code() in _DOWN:  # type: ignore[attr-defined]
                raise DraftDown(message) from e
            raise

    def close(self, graceful: bool = True) -> None:
        """Ends the Propose stream (cleanly if `graceful` and it still works) and the channel."""
        if graceful and not self._broken:
            # it may have failed meanwhile: closing the channel below is then all that is left
            with contextlib.suppress(grpc.RpcError):
                self._stream.close()
                # the draft answers blocks still unread, then ends the stream
                with contextlib.suppress(DraftDown, DraftStalled):
                    while self._sent:
                        self.collect(self.timeout_s)
                    self._stream.ended(self.timeout_s)
        self._channel.close()
