"""uvicorn serving the HTTP API (`orchestrator.web.api`) on a bound socket, on a thread and event
loop of its own: TLS only when given a certificate (a plaintext request then fails its
handshake), client certificates required when given a CA, and a stop in two steps so that the
orchestrator's drain covers the HTTP port as it does the gRPC one (`orchestrator.server`).
"""

from __future__ import annotations

import math
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from orchestrator.web.limits import HEADER_TIMEOUT_S, header_timeout_protocol

MAX_CONNECTIONS = 1024  # open connections held at once (uvicorn's limit_concurrency)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A server's PEM files: its certificate chain and key, and the CA whose client
    certificates it requires (None: none required)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def uvicorn_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"ssl_certfile": str(self.cert), "ssl_keyfile": str(self.key)}
        if self.client_ca is not None:
            options |= {"ssl_ca_certs": str(self.client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return options


class HttpServer:
    """uvicorn serving `app` on `sock`, on a thread of its own; TLS with `tls`.

    `grace_s` bounds how long a stop waits for running requests before uvicorn cancels what is
    left: one second past the orchestrator's grace period, whose end (the scheduler stopping)
    ends every generation first, each with its last event."""

    def __init__(
        self,
        app: Any,
        sock: socket.socket,
        grace_s: float,
        tls: TlsFiles | None = None,
        header_timeout_s: float = HEADER_TIMEOUT_S,  # a request's headers: orchestrator.web.limits
        max_connections: int = MAX_CONNECTIONS,  # past it a request is answered 503 at once
    ) -> None:
        self.port = int(sock.getsockname()[1])
        self.scheme = "http" if tls is None else "https"
        config = uvicorn.Config(
            app, lifespan="off", log_level="warning", access_log=False,
            timeout_graceful_shutdown=math.ceil(grace_s) + 1,
            http=header_timeout_protocol(header_timeout_s), limit_concurrency=max_connections,
            **({} if tls is None else tls.uvicorn_options()),
        )  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="http-api", daemon=True
        )

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("The HTTP API server did not start.")
            time.sleep(0.01)

    def begin_stop(self) -> None:
        """Refuses new connections (the listening socket closes) and closes idle ones; running
        requests go on (a streaming response's connection closes once it ends)."""
        self._server.should_exit = True

    def join(self, timeout_s: float) -> None:
        """Stops (if not begun) and waits up to `timeout_s` for the running requests."""
        self.begin_stop()
        self._thread.join(timeout_s)
