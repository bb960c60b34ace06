"""`orchestrator.launch.services`, each service's start inside its Ray actor, run in this process: a
service listens on the address it is given (its node's, `placement.ServiceActor`), not on every
interface, so that a service without TLS is out of reach of the node's other networks."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from orchestrator.config import ServiceConfig
from orchestrator.launch.services import start_service
from specdec.serving.server import Server, ServerConfig

OTHER_LOOPBACK = "127.0.0.2"  # on Linux the whole of 127/8 reaches this machine


def reachable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(5.0)
        try:
            sock.connect((host, port))
        except OSError:
            return False
    return True


def test_the_probe_reaches_a_server_on_every_interface_through_another_address() -> None:
    server = Server(ServerConfig(host="0.0.0.0"), [], lambda s: None)
    server.start()
    try:
        assert reachable(OTHER_LOOPBACK, server.port)
    finally:
        server.stop(0)


@pytest.mark.parametrize("role", ["draft", "target"])
def test_a_service_listens_on_the_address_it_is_given_only(
    checkpoints: tuple[Path, Path], role: str
) -> None:
    target, draft = checkpoints
    config = ServiceConfig(str(target), str(draft), device="cpu", max_requests=2, max_seq_len=64)
    server, _ = start_service(role, config, "127.0.0.1")
    try:
        assert reachable("127.0.0.1", server.port)
        assert not reachable(OTHER_LOOPBACK, server.port), "it listens on every interface"
    finally:
        server.stop(0)
