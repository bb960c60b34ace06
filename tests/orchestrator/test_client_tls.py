"""TLS on both client ports (`--tls-cert`, `--tls-key`), the orchestrator in this process: the
HTTP port speaks TLS only (it used to stay plaintext, the API key crossing the network in
clear), and with `--tls-client-ca` both ports refuse, at the handshake, a client without a
certificate that CA signed. The services behind are a local pair (`tests.orchestrator.inprocess`).
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.config import ServeConfig, ServiceConfig
from orchestrator.server import Orchestrator
from specdec.pb.specdec.v1 import generate_pb2, generate_pb2_grpc
from specdec.serving.client import make_channel
from tests.certs import issue, load, localhost_names
from tests.draft_service.models import model_draft, services
from tests.orchestrator.inprocess import api_on

PROMPT = [5, 6, 7, 8]
Pem = tuple[Path, Path]  # (certificate chain, key)


@dataclass(frozen=True)
class Pki:
    ca: Path
    api: Pem  # the client ports' certificate: 127.0.0.1 and localhost
    client: Pem  # a client certificate the CA signed
    stranger: Pem  # a client certificate another CA signed


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    from cryptography import x509

    folder = tmp_path_factory.mktemp("pki")
    ca = load(issue(folder, "ca", []))
    api = issue(folder, "api", localhost_names(), ca)
    client = issue(folder, "client", [x509.DNSName("specdec-client")], ca)
    stranger = issue(
        folder, "stranger", [x509.DNSName("specdec-client")], load(issue(folder, "other-ca", []))
    )
    return Pki(folder / "ca.crt", api, client, stranger)


def config(target: Path, draft: Path, pki: Pki, client_ca: Path | None) -> ServeConfig:
    return ServeConfig(
        ServiceConfig(str(target), str(draft), device="cpu", max_seq_len=128),
        host="127.0.0.1", port=0, metrics_port=None, http_port=0, grace_s=1.0,
        tls_cert=pki.api[0], tls_key=pki.api[1], tls_client_ca=client_ca,
    )  # fmt: skip


def https(
    port: int, pki: Pki, identity: Pem | None, tls12: bool = False
) -> http.client.HTTPSConnection:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if tls12:  # the server's refusal of the client's certificate ends the handshake itself
        context.maximum_version = ssl.TLSVersion.TLSv1_2
    if identity is not None:
        context.load_cert_chain(str(identity[0]), str(identity[1]))
    return http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=60)


def call(
    connection: http.client.HTTPConnection, method: str, path: str, body: Any = None
) -> tuple[int, Any]:
    """(status, JSON body) of one request."""
    data = None if body is None else json.dumps(body)
    connection.request(method, path, data, {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read() or b"null")


def grpc_channel(port: int, pki: Pki, identity: Pem | None) -> grpc.Channel:
    pair = None if identity is None else (identity[0].read_bytes(), identity[1].read_bytes())
    return make_channel(f"127.0.0.1:{port}", tls_root_cert=pki.ca.read_bytes(), tls_identity=pair)


def grpc_complete(channel: grpc.Channel, max_tokens: int = 4) -> generate_pb2.GenerateResponse:
    request = generate_pb2.GenerateRequest(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request.token_ids.ids.extend(PROMPT)
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    return stub.Complete(request, timeout=60)  # type: ignore[no-any-return]


def test_with_tls_cert_the_http_port_speaks_tls_only(
    checkpoints: tuple[Path, Path], pki: Pki
) -> None:
    """No pair is needed: /health answers 503 (services not up) over TLS, which a plaintext
    request never gets."""
    orchestrator = Orchestrator(config(*checkpoints, pki, client_ca=None))
    orchestrator._bind()
    try:
        port = orchestrator.http_port
        assert port is not None and orchestrator.http_url == f"https://127.0.0.1:{port}/v1"
        status, body = call(https(port, pki, identity=None), "GET", "/health")
        assert status == 503 and body["error"]["type"] == "service_unavailable_error"
        with pytest.raises((http.client.HTTPException, OSError)):
            call(http.client.HTTPConnection("127.0.0.1", port, timeout=10), "GET", "/health")
    finally:
        orchestrator.stop(0.0)


@pytest.fixture(scope="module")
def mutual(checkpoints: tuple[Path, Path], pki: Pki) -> Iterator[Orchestrator]:
    """Both client ports requiring a client certificate the test CA signed."""
    target, draft = checkpoints
    with services(target, model_draft(draft), sampler_impl="torch") as pair, \
            api_on(pair, config(target, draft, pki, client_ca=pki.ca)) as orchestrator:  # fmt: skip
        yield orchestrator


def test_with_a_client_ca_both_ports_serve_a_client_with_a_certificate(
    mutual: Orchestrator, pki: Pki
) -> None:
    assert mutual.http_port is not None
    with grpc_channel(mutual.port, pki, pki.client) as channel:
        want = grpc_complete(channel)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, got = call(https(mutual.http_port, pki, pki.client), "POST", "/v1/completions", body)
    assert status == 200 and got["choices"][0]["text"] == want.text and want.text


@pytest.mark.parametrize("who", ["no certificate", "another CA's"])
def test_with_a_client_ca_both_ports_refuse_a_client_without_one_at_the_handshake(
    mutual: Orchestrator, pki: Pki, who: str
) -> None:
    identity = None if who == "no certificate" else pki.stranger
    assert mutual.http_port is not None
    with pytest.raises(ssl.SSLError) as refused:
        https(mutual.http_port, pki, identity, tls12=True).connect()
    print(f"HTTP over TLS 1.2, {who}: {refused.value}")
    # TLS 1.3 ends the client's side of the handshake first: the refusal arrives as the first
    # read's alert, or the connection closes; no HTTP response either way
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        call(https(mutual.http_port, pki, identity), "GET", "/health")
    with grpc_channel(mutual.port, pki, identity) as channel, pytest.raises(grpc.RpcError) as info:
        grpc_complete(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    print(f"gRPC, {who}: {info.value.details()}")  # type: ignore[attr-defined]


def test_the_client_library_presents_a_client_certificate(mutual: Orchestrator, pki: Pki) -> None:
    """`specdec.client.Client` / `AsyncClient` with certificate_chain and private_key are served
    where --tls-client-ca is set; without them the same client is refused."""
    import asyncio

    from specdec.client import AsyncClient, Client, SpecdecClientError

    ca, (chain, key) = pki.ca.read_bytes(), (p.read_bytes() for p in pki.client)
    address = f"127.0.0.1:{mutual.port}"
    with Client(address, root_certificates=ca, certificate_chain=chain, private_key=key,
                timeout=60) as client:  # fmt: skip
        out = client.complete(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(out.token_ids) == 4

    async def complete() -> int:
        async with AsyncClient(address, root_certificates=ca, certificate_chain=chain,
                               private_key=key, timeout=60) as client:  # fmt: skip
            result = await client.complete(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
        return len(result.token_ids)

    assert asyncio.run(complete()) == 4
    plain = Client(address, root_certificates=ca, timeout=60)
    with plain, pytest.raises(SpecdecClientError) as refused:
        plain.complete(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ValueError, match="together"):
        Client(address, root_certificates=ca, certificate_chain=chain)
    with pytest.raises(ValueError, match="needs TLS"):
        Client(address, certificate_chain=chain, private_key=key)
