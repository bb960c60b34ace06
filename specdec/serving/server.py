"""A gRPC server with what both services need: the standard health service (NOT_SERVING until
the model is loaded and warmed up), server reflection (v1 and v1alpha), max message sizes,
optional TLS, the exception → status interceptor, request parsing inside the call (undecodable
bytes are INVALID_ARGUMENT, `specdec.serving.decoding`), and a graceful stop on SIGTERM (health
flips first, then `stop(grace)`).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.message_limits import MIN_MESSAGE_BYTES
from specdec.serving.decoding import DecodingInterceptor
from specdec.serving.reflection import enable_server_reflection
from specdec.serving.status import StatusInterceptor

log = logging.getLogger(__name__)
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # dense q at batch 32, k = 4, V = 128,256: 66 MB
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Where and how a service listens."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port; Server.start returns it
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    tls_cert: Path | None = None  # PEM certificate chain; with tls_key enables TLS
    tls_key: Path | None = None
    # a CA (PEM): clients must present a certificate it signed (mutual TLS), else the
    # handshake fails
    tls_client_ca: Path | None = None
    grace_s: float = 10.0  # in-flight calls get this long to finish on stop
    drain_s: float = 0.0  # NOT_SERVING is visible this long before the port closes
    max_workers: int = 16

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}.")
        if self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(
                f"max_message_bytes must be >= {MIN_MESSAGE_BYTES}, got {self.max_message_bytes}."
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together (or neither).")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key.")
        if self.grace_s < 0 or self.drain_s < 0:
            raise ValueError("grace_s and drain_s must be >= 0.")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}.")

    def channel_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # grpc sets SO_REUSEPORT by default: a second server on the same port would bind
            # too and take half of the new connections
            ("grpc.so_reuseport", 0),
        ]


Register = Callable[[grpc.Server], None]
SWITCH_INTERVAL_ENV = "SPECDEC_SWITCH_INTERVAL_S"


def apply_switch_interval() -> None:
    """Sets the interpreter's GIL switch interval from SPECDEC_SWITCH_INTERVAL_S, if set. On a
    GPU host a server thread holding the GIL made an empty round trip take 31 ms instead of
    0.23 (the default interval is 5 ms; bench/results/transport_probe_NVIDIA_H200.json)."""
    value = os.environ.get(SWITCH_INTERVAL_ENV)
    if value:
        try:
            interval = float(value)
        except ValueError:
            raise ValueError(
                f"{SWITCH_INTERVAL_ENV} must be a number of seconds, got {value!r}."
            ) from None
        if not 1e-6 <= interval <= 1.0:
            raise ValueError(f"{SWITCH_INTERVAL_ENV} must be in [1e-6, 1] s, got {interval}.")
        sys.setswitchinterval(interval)


def settle_heap() -> None:
    """Called once a service is loaded and warmed up, before it reports SERVING: collects, then
    freezes every object alive (the interpreter's, torch's, the model's bookkeeping) out of the
    garbage collector's reach, so that a full collection while serving scans only what serving
    made since. Unfrozen, such a collection walks about a million objects (tens of ms, every
    thread of the process held) in the middle of a step. `Server.stop` unfreezes them (a
    process that starts services one after another, as tests do, gets its memory back)."""
    gc.collect()
    gc.freeze()


class Server:
    """Owns a grpc.Server plus its health servicer; `service_names` are full proto names."""

    def __init__(
        self,
        config: ServerConfig,
        service_names: Sequence[str],
        register: Register,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
    ):
        """`interceptors` run first, before the status and decoding ones (e.g. an API key)."""
        self.config = config
        self.service_names = tuple(service_names)
        self.health = health.HealthServicer()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_workers),
            interceptors=[*interceptors, StatusInterceptor(), DecodingInterceptor()],
            options=config.channel_options(),
        )
        register(self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        enable_server_reflection((*self.service_names, health.SERVICE_NAME), self._server)
        self.set_serving(False)
        self.port = 0
        self._stopped = threading.Event()

    def start(self) -> int:
        """Binds and starts; returns the port. Health stays NOT_SERVING until set_serving."""
        apply_switch_interval()
        address = f"{self.config.host}:{self.config.port}"
        creds = None
        if self.config.tls_cert is not None and self.config.tls_key is not None:
            pair = (self.config.tls_key.read_bytes(), self.config.tls_cert.read_bytes())
            ca = self.config.tls_client_ca
            creds = grpc.ssl_server_credentials(
                [pair],
                root_certificates=None if ca is None else ca.read_bytes(),
                require_client_auth=ca is not None,
            )
        try:  # grpcio raises RuntimeError on a failed bind (older versions returned 0)
            if creds is not None:
                self.port = self._server.add_secure_port(address, creds)
            else:
                self.port = self._server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise OSError(
                f"could not bind {address}: the port is in use, or the host is not an address "
                "of this machine (--host, --port)."
            )
        self._server.start()
        return self.port

    def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.service_names):
            self.health.set(name, status)

    def ready(self) -> None:
        """The service is loaded and warmed up: settles the heap (`settle_heap`, undone by
        `stop`), then reports SERVING."""
        settle_heap()
        self.set_serving(True)

    def stop(self, grace_s: float | None = None) -> None:
        """Flips health to NOT_SERVING, waits drain_s, then stops with `grace_s` for calls."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.set_serving(False)
        if self.config.drain_s:
            time.sleep(self.config.drain_s)
        grace = self.config.grace_s if grace_s is None else grace_s
        self._server.stop(grace).wait()
        gc.unfreeze()  # `settle_heap`'s objects: what the service leaves is collectable again

    def wait(self) -> None:
        self._server.wait_for_termination()

    def serve_until_signal(self) -> None:
        """Blocks until SIGTERM or SIGINT, then stops gracefully (main thread only)."""
        stop_on_signal(self.stop, self.config.grace_s)
        self.wait()


def stop_on_signal(stop: Callable[[], None], grace_s: float) -> None:
    """SIGTERM and SIGINT run `stop` on a thread of its own, so that the main thread's wait
    returns once it is done (main thread only)."""

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping (grace %.1f s)", signum, grace_s)
        threading.Thread(target=stop, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
