"""The shared server plumbing: health, reflection, status mapping, limits, TLS, SIGTERM."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from specdec.errors import CacheFullError, CheckpointError
from specdec.serving.client import HANDOFF_WAIT_S, LockstepStream, Outbox, make_channel
from specdec.serving.server import Server, ServerConfig
from tests.certs import issue, load, localhost_names, self_signed_localhost

SERVICE = "test.Echo"
SERVING = health_pb2.HealthCheckResponse.SERVING


def _call(request: bytes, context: grpc.ServicerContext) -> bytes:
    errors: dict[bytes, Exception] = {
        b"value": ValueError("field x must be > 0, got -1."),
        b"full": CacheFullError("the KV cache is full."),
        b"checkpoint": CheckpointError("the checkpoint is gone."),
        b"bug": ZeroDivisionError("oops"),
    }
    if request in errors:
        raise errors[request]
    if request == b"abort":
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "no")
    return request


def _stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    for request in requests:
        yield _call(request, context)


def _register(server: grpc.Server) -> None:
    handlers = {
        "Call": grpc.unary_unary_rpc_method_handler(_call),
        "Stream": grpc.stream_stream_rpc_method_handler(_stream),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server(ServerConfig(max_message_bytes=64 * 1024), [SERVICE], _register)
    srv.start()
    yield srv
    srv.stop(0)


def _health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_not_serving_until_ready_then_serving(server: Server) -> None:
    with make_channel(f"127.0.0.1:{server.port}") as channel:
        not_serving, serving = health_pb2.HealthCheckResponse.NOT_SERVING, SERVING
        assert _health(channel) == _health(channel, SERVICE) == not_serving
        server.set_serving(True)
        assert _health(channel) == _health(channel, SERVICE) == serving


def test_reflection_lists_services(server: Server) -> None:
    with make_channel(f"127.0.0.1:{server.port}") as channel:
        names = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {SERVICE, "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize(
    ("payload", "code", "text"),
    [
        (b"value", grpc.StatusCode.INVALID_ARGUMENT, "field x must be > 0"),
        (b"full", grpc.StatusCode.RESOURCE_EXHAUSTED, "KV cache is full"),
        (b"checkpoint", grpc.StatusCode.FAILED_PRECONDITION, "the checkpoint is gone"),
        (b"bug", grpc.StatusCode.INTERNAL, "ZeroDivisionError"),
        (b"abort", grpc.StatusCode.PERMISSION_DENIED, "no"),
    ],
)
def test_exceptions_map_to_status_and_server_keeps_serving(
    server: Server, payload: bytes, code: grpc.StatusCode, text: str
) -> None:
    with make_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_unary(f"/{SERVICE}/Call")
        with pytest.raises(grpc.RpcError) as info:
            call(payload, timeout=5)
        assert info.value.code() == code and text in info.value.details()
        assert call(b"fine", timeout=5) == b"fine"


def test_stream_error_maps_to_status(server: Server) -> None:
    with make_channel(f"127.0.0.1:{server.port}") as channel:
        stream = LockstepStream(channel.stream_stream(f"/{SERVICE}/Stream"))
        assert stream(b"one") == b"one"
        with pytest.raises(grpc.RpcError) as info:
            stream(b"value")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with LockstepStream(channel.stream_stream(f"/{SERVICE}/Stream")) as again:
            assert again(b"two") == b"two"


def test_oversized_message_is_resource_exhausted(server: Server) -> None:
    with make_channel(f"127.0.0.1:{server.port}", max_message_bytes=1 << 20) as channel:
        call = channel.unary_unary(f"/{SERVICE}/Call")
        with pytest.raises(grpc.RpcError) as info:
            call(b"x" * (65 * 1024), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert call(b"x" * 1000, timeout=5) == b"x" * 1000


def test_tls(tmp_path: Path) -> None:
    cert, key = self_signed_localhost(tmp_path)
    srv = Server(ServerConfig(tls_cert=cert, tls_key=key), [SERVICE], _register)
    port = srv.start()
    try:
        with make_channel(f"localhost:{port}", tls_root_cert=cert.read_bytes()) as channel:
            assert channel.unary_unary(f"/{SERVICE}/Call")(b"secret", timeout=5) == b"secret"
        with make_channel(f"127.0.0.1:{port}") as plain:
            with pytest.raises(grpc.RpcError) as info:
                plain.unary_unary(f"/{SERVICE}/Call")(b"secret", timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(0)


def test_mutual_tls_refuses_a_client_without_a_certificate_from_its_ca(tmp_path: Path) -> None:
    """tls_client_ca (`--tls-client-ca` of the services' mains, set by `specdec serve`):
    the handshake fails without a client certificate, or with one another CA signed; the
    process identity (`set_client_identity`, a target's) is presented when none is given."""
    from specdec.serving.client import set_client_identity

    ca = load(issue(tmp_path, "ca", []))
    cert, key = issue(tmp_path, "server", localhost_names(), ca)
    peer = tuple(p.read_bytes() for p in issue(tmp_path, "peer", localhost_names(), ca))
    other_ca = load(issue(tmp_path, "other-ca", []))
    stranger = tuple(p.read_bytes() for p in issue(tmp_path, "stranger", [], other_ca))
    config = ServerConfig(tls_cert=cert, tls_key=key, tls_client_ca=tmp_path / "ca.crt")
    srv = Server(config, [SERVICE], _register)
    port = srv.start()
    root = (tmp_path / "ca.crt").read_bytes()

    def call(identity: tuple[bytes, ...] | None) -> grpc.StatusCode:
        with make_channel(f"localhost:{port}", tls_root_cert=root,
                          tls_identity=identity) as channel:  # type: ignore[arg-type]  # fmt: skip
            try:
                channel.unary_unary(f"/{SERVICE}/Call")(b"hello", timeout=5)
            except grpc.RpcError as e:
                return e.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    try:
        assert call(peer) == grpc.StatusCode.OK
        assert call(None) == grpc.StatusCode.UNAVAILABLE
        assert call(stranger) == grpc.StatusCode.UNAVAILABLE
        set_client_identity(*peer)
        try:
            assert call(None) == grpc.StatusCode.OK
        finally:
            set_client_identity(None, None)
    finally:
        srv.stop(0)
    with pytest.raises(ValueError, match="tls_client_ca"):
        ServerConfig(tls_client_ca=tmp_path / "ca.crt")


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ServerConfig(tls_cert=Path("c.pem"))
    with pytest.raises(ValueError, match="port must be"):
        ServerConfig(port=70000)


SCRIPT = textwrap.dedent(
    """
    import sys
    from specdec.serving.server import Server, ServerConfig
    srv = Server(ServerConfig(drain_s=1.5, grace_s=5.0), ["test.Echo"], lambda s: None)
    print(srv.start(), flush=True)
    srv.set_serving(True)
    srv.serve_until_signal()
    print("stopped", flush=True)
    """
)


def test_sigterm_flips_health_then_stops(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with make_channel(f"127.0.0.1:{port}") as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 1.0
            status = health_pb2.HealthCheckResponse.SERVING
            while status == health_pb2.HealthCheckResponse.SERVING and time.monotonic() < deadline:
                status = _health(channel)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert proc.wait(timeout=20) == 0
        assert proc.stdout.read().strip() == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_port_in_use_is_refused_naming_it(server: Server) -> None:
    """grpc shares a port with SO_REUSEPORT unless told not to: a second service on the same
    port would have taken half of its connections. Both another server's port and a plain
    listening socket's are refused, naming the address and the flags."""
    second = Server(ServerConfig(port=server.port), [SERVICE], _register)
    with pytest.raises(OSError, match=rf"could not bind 127\.0\.0\.1:{server.port}: the port"):
        second.start()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        third = Server(ServerConfig(port=sock.getsockname()[1]), [SERVICE], _register)
        with pytest.raises(OSError, match=r"\(--host, --port\)"):
            third.start()


def test_a_service_main_that_cannot_bind_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from specdec.serving.cli import serve

    message = "could not bind 127.0.0.1:1: the port is in use (--host, --port)."

    def start() -> tuple[Server, None]:
        raise OSError(message)

    assert serve("draft_service", start) == 2
    assert capsys.readouterr().err == f"draft_service: {message}\n"


def _reflect(
    channel: grpc.Channel, version: str, **ask: str
) -> reflection_pb2.ServerReflectionResponse:
    """One reflection request to `grpc.reflection.{version}`; v1's messages are v1alpha's
    under another package (the same fields, the same bytes on the wire)."""
    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    (answer,) = call(iter([reflection_pb2.ServerReflectionRequest(**ask)]), timeout=10)
    return answer


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_v1_and_v1alpha(server: Server, version: str) -> None:
    """Current clients (grpcurl) ask v1 first; both list the services, and v1 describes
    itself as the package grpc.reflection.v1."""
    from google.protobuf import descriptor_pb2

    with make_channel(f"127.0.0.1:{server.port}") as channel:
        listed = _reflect(channel, version, list_services="").list_services_response
        names = {s.name for s in listed.service}
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"} <= names  # fmt: skip
        symbol = f"grpc.reflection.{version}.ServerReflection"
        found = _reflect(channel, version, file_containing_symbol=symbol)
    (file,) = found.file_descriptor_response.file_descriptor_proto
    proto = descriptor_pb2.FileDescriptorProto.FromString(file)
    assert proto.package == f"grpc.reflection.{version}"
    method = proto.service[0].method[0]
    assert method.input_type == f".grpc.reflection.{version}.ServerReflectionRequest"


def test_a_settled_heap_is_frozen_until_the_server_stops() -> None:
    """`Server.ready` (`settle_heap`, then SERVING) takes every object alive out of the
    collector's reach; stopping the server gives them back, so that what a stopped service
    leaves in a process that goes on (tests) can be collected."""
    srv = Server(ServerConfig(), [SERVICE], _register)
    srv.start()
    try:
        srv.ready()
        assert gc.get_freeze_count() > 1000
        ref = weakref.ref(_Box())  # a cycle made after the freeze: collectable
        gc.collect()
        assert ref() is None
    finally:
        srv.stop(0)
    assert gc.get_freeze_count() == 0


class _Box:
    def __init__(self) -> None:
        self.me = self


STAMP_SCRIPT = textwrap.dedent(
    """
    import time
    import grpc
    from specdec.serving.server import Server, ServerConfig

    def stamp(requests, context):  # each message answered with when it arrived here
        for _ in requests:
            yield repr(time.time()).encode()

    def register(server):
        handler = grpc.stream_stream_rpc_method_handler(stamp)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "test.Stamp", {"Stream": handler}),))

    srv = Server(ServerConfig(), ["test.Stamp"], register)
    print(srv.start(), flush=True)
    srv.set_serving(True)
    srv.serve_until_signal()
    """
)


def _hold_the_gil(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:  # pure Python: no blocking call releases the GIL
        pass


@pytest.mark.parametrize("handoff", [True, False])
def test_send_returns_once_grpc_has_sent_the_message(handoff: bool) -> None:
    """gRPC's request thread needs the GIL to send a message: a caller that goes on running
    Python after putting it (the hub launching a verify) would hold it back until the caller
    next blocks. `Outbox.put` with a wait returns only once gRPC has sent it, so it reaches
    the server (another process) while the caller still holds the GIL; a bare put does not
    (the mutant: the server sees it only after the caller lets go)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", STAMP_SCRIPT], stdout=subprocess.PIPE, text=True, env=env
    )
    interval = sys.getswitchinterval()
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with make_channel(f"127.0.0.1:{port}") as channel:
            outbox = Outbox()
            answers = channel.stream_stream("/test.Stamp/Stream")(iter(outbox))
            outbox.put(b"warm")
            assert next(answers)  # the call is open and the connection up
            sys.setswitchinterval(1.0)  # no other thread takes the GIL from a busy caller
            sent = time.time()
            outbox.put(b"now", HANDOFF_WAIT_S if handoff else 0.0)
            _hold_the_gil(0.5)
            sys.setswitchinterval(interval)
            arrived = float(next(answers))
            outbox.close()
            assert list(answers) == []
        if handoff:
            assert arrived - sent < 0.25, arrived - sent
        else:
            assert arrived - sent >= 0.45, arrived - sent
    finally:
        sys.setswitchinterval(interval)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
