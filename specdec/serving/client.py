"""Client channels to the services, and a lock-step wrapper for their bidirectional streams."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from specdec.serving.server import DEFAULT_MAX_MESSAGE_BYTES

# This process's client certificate chain and key (PEM) for mutual TLS with the services: a
# target sets it at start-up, and every TLS channel it opens to its draft presents it.
_identity: tuple[bytes, bytes] | None = None


def set_client_identity(cert_chain: bytes | None, private_key: bytes | None) -> None:
    """Sets (or with None, clears) the certificate this process's TLS channels present."""
    global _identity
    _identity = None if cert_chain is None or private_key is None else (cert_chain, private_key)


def make_channel(
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls_root_cert: bytes | None = None,
    tls_server_name: str | None = None,
    tls_identity: tuple[bytes, bytes] | None = None,
) -> grpc.Channel:
    """A channel with matching message limits; TLS when a root certificate is given,
    presenting `tls_identity` (cert chain, key), else this process's (`set_client_identity`)."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if tls_root_cert is None:
        return grpc.insecure_channel(address, options=options)
    if tls_server_name is not None:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    chain, key = tls_identity or _identity or (None, None)
    creds = grpc.ssl_channel_credentials(
        root_certificates=tls_root_cert, private_key=key, certificate_chain=chain
    )
    return grpc.secure_channel(address, creds, options=options)


_CLOSE = object()
HANDOFF_WAIT_S = 0.05  # the longest `Outbox.put` waits for gRPC to send a message


class Outbox:
    """The request side of a bidirectional stream: what is put here, gRPC sends, in order.

    gRPC's synchronous API reads a call's request iterator on a thread of its own, which
    needs the GIL to take a message, serialise it and start its send. A caller that goes on
    running Python after putting one (the hub launching a verify) can hold the GIL until it
    next blocks, so the message leaves milliseconds late: on a GPU host, at the verify's
    end. `put(..., wait_s)` blocks until gRPC has sent the message (it asks for the next one
    only once a send is done), up to `wait_s`: the message leaves now, for a few thread
    hand-offs."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sent = threading.Condition()
        self._puts = 0  # messages put (the caller's count)
        self._done = 0  # messages gRPC has sent (the iterator's)

    def __iter__(self) -> Iterator[Any]:
        while True:
            message = self._queue.get()
            if message is _CLOSE:
                return
            yield message
            with self._sent:  # gRPC asks for the next message: this one is sent
                self._done += 1
                self._sent.notify_all()

    def put(self, message: Any, wait_s: float = 0.0) -> bool:
        """Queues `message`; with `wait_s` > 0, waits until gRPC has sent it, up to that
        long. Whether it is known to be sent (False after the wait ran out, or without one)."""
        self._puts += 1
        n = self._puts
        self._queue.put(message)
        if wait_s <= 0.0:
            return False
        with self._sent:
            return self._sent.wait_for(lambda: self._done >= n, timeout=wait_s)

    def close(self) -> None:
        """The stream's requests end after what was put."""
        self._queue.put(_CLOSE)


class LockstepStream:
    """Sends one message and waits for its answer over one bidirectional stream.

    Keeps the stream's HTTP/2 connection and call open across steps, which costs less per
    step than a unary call. Not thread-safe: one caller at a time.
    """

    def __init__(self, method: Callable[[Iterator[Any]], Iterator[Any]]):
        self._outbox = Outbox()
        self._responses: Any = method(iter(self._outbox))  # a grpc Call too

    def __call__(self, message: Any) -> Any:
        self._outbox.put(message)  # the caller waits for the answer next: no hand-off wait
        return next(self._responses)

    def cancel(self) -> None:
        """Ends the call at once from any thread: a caller waiting for an answer gets an
        RpcError (CANCELLED)."""
        self._responses.cancel()

    def close(self) -> None:
        self._outbox.close()
        for _ in self._responses:
            pass

    def __enter__(self) -> LockstepStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
