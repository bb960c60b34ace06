"""The hub's connection to its draft service: one long-lived Propose stream for the steps, and
unary Admit and Release calls (`target_service.hub` drives it).

A failed Propose (any status: the stream is over either way) or an Admit/Release that finds
the service unreachable raises `DraftDown`; the hub then runs every request at k = 0 until it
is given a new draft service. An Admit the service answers with an error (a full cache, a
prompt past its max_seq_len) only concerns that request.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import grpc

from specdec.pb import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.serving.client import LockstepStream, make_channel
from specdec.serving.messages import AdmitRequest, ModelInfo

_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


class DraftDown(Exception):
    """The draft service failed or cannot be reached."""


def _describe(e: grpc.RpcError) -> str:
    code, details = e.code(), e.details()  # type: ignore[attr-defined]
    return f"{code.name if code else 'UNKNOWN'}: {details}"


class PendingAdmits:
    """Admit calls in flight (they run while the target prefills the same requests)."""

    def __init__(self, futures: list[tuple[AdmitRequest, grpc.Future]], address: str):
        self.admissions = [a for a, _ in futures]
        self._futures = futures
        self._address = address

    def wait(self) -> dict[str, str | None]:
        """Each request's error message (None: admitted); DraftDown if the service is gone."""
        out: dict[str, str | None] = {}
        down: grpc.RpcError | None = None
        for adm, future in self._futures:
            try:
                future.result()
                out[adm.request_id] = None
            except grpc.RpcError as e:
                if e.code() in _DOWN:  # type: ignore[attr-defined]
                    down = e
                out[adm.request_id] = _describe(e)
        if down is not None:
            raise DraftDown(f"Admit on the draft service at {self._address}: {_describe(down)}")
        return out


class DraftLink:
    """A connected draft service; `info` is its ModelInfo. Not thread-safe (the hub's loop
    thread alone uses it)."""

    def __init__(
        self,
        address: str,
        max_message_bytes: int,
        timeout_s: float,
        tls_root_cert: bytes | None = None,
        tls_server_name: str | None = None,
    ):
        self.address, self.timeout_s = address, timeout_s
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
        self._propose = LockstepStream(self._stub.Propose)
        self._broken = False

    def propose(
        self, entries: Sequence[draft_pb2.ProposeEntry]
    ) -> tuple[draft_pb2.ProposeResponse, float]:
        """The drafts for `entries` and the round trip's wall time in seconds."""
        start = time.perf_counter()
        try:
            response = self._propose(draft_pb2.ProposeBlock(entries=entries))
        except grpc.RpcError as e:
            self._broken = True
            raise DraftDown(
                f"Propose on the draft service at {self.address}: {_describe(e)}"
            ) from e
        except StopIteration as e:
            self._broken = True
            raise DraftDown(f"The draft service at {self.address} ended the Propose stream.") from e
        return response, time.perf_counter() - start

    def start_admit(self, admissions: Sequence[AdmitRequest]) -> PendingAdmits:
        futures = [
            (a, self._stub.Admit.future(a.to_pb(), timeout=self.timeout_s)) for a in admissions
        ]
        return PendingAdmits(futures, self.address)

    def release(self, request_ids: Sequence[str]) -> None:
        """Frees the requests' KV on the draft; DraftDown if the service is gone."""
        pb = common_pb2.ReleaseRequest(request_ids=request_ids)
        try:
            self._stub.Release(pb, timeout=self.timeout_s)
        except grpc.RpcError as e:
            if e.code() in _DOWN:  # type: ignore[attr-defined]
                raise DraftDown(
                    f"Release on the draft service at {self.address}: {_describe(e)}"
                ) from e
            raise

    def close(self, graceful: bool = True) -> None:
        """Ends the Propose stream (cleanly if `graceful` and it still works) and the channel."""
        if graceful and not self._broken:
            # it may have failed meanwhile: closing the channel below is then all that is left
            with contextlib.suppress(grpc.RpcError):
                self._propose.close()
        self._channel.close()
