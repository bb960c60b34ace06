"""`specdec serve` with credentials on every hop: TLS and an API key on the client port
(--tls-*, --api-key-file), mutual TLS on the draft and target services' ports and the channels
to them (--service-tls-*). A real local Ray cluster on CPU and tiny checkpoints; one stack,
started from the flags and a --config file, serves the module.

The services' certificate names only SERVICE_NAME (no IP address), so the orchestrator -> target
and target -> draft channels reach them only by checking the overridden server name; they
present the `peer` certificate, which the same CA signed, and a peer without one is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.cli.main import parse_args
from orchestrator.cli.serve import serve_config
from orchestrator.server import Orchestrator
from specdec.client import Client, SpecdecClientError
from specdec.serving.client import make_channel
from tests.certs import issue, load, localhost_names
from tests.draft_service.models import build_checkpoints
from tests.orchestrator.test_serve import oracle

SERVICE_NAME = "specdec-services"  # as a Kubernetes Service's name would be
PROMPT = (5, 6, 7, 8)
N = 8
API_KEY = "test-key-0123456789abcdef"


@dataclass(frozen=True)
class Pki:
    """A test CA and two certificates it signed, each as (cert, key) PEM files."""

    ca: Path
    api: tuple[Path, Path]  # the client port: 127.0.0.1 and localhost
    service: tuple[Path, Path]  # the services: SERVICE_NAME only
    peer: tuple[Path, Path]  # the client certificate of the orchestrator and the targets
    stranger: tuple[Path, Path]  # a client certificate another CA signed


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    from cryptography import x509

    folder = tmp_path_factory.mktemp("pki")
    ca = load(issue(folder, "ca", []))
    api = issue(folder, "api", localhost_names(), ca)
    service = issue(folder, "service", [x509.DNSName(SERVICE_NAME)], ca)
    peer = issue(folder, "peer", [x509.DNSName("specdec-peer")], ca)
    other_ca = load(issue(folder, "other-ca", []))
    stranger = issue(folder, "stranger", [x509.DNSName("specdec-peer")], other_ca)
    return Pki(folder / "ca.crt", api, service, peer, stranger)


@dataclass
class Stack:
    orchestrator: Orchestrator
    address: str
    target_dir: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("tls-serve")
    target, draft = build_checkpoints(folder)
    toml = folder / "serve.toml"  # the services' TLS from the file, the client port's as flags
    toml.write_text(
        f'service-tls-cert = "{pki.service[0]}"\nservice-tls-key = "{pki.service[1]}"\n'
        f'service-tls-root-cert = "{pki.ca}"\nservice-tls-server-name = "{SERVICE_NAME}"\n'
        f'service-tls-client-cert = "{pki.peer[0]}"\nservice-tls-client-key = "{pki.peer[1]}"\n'
    )
    key_file = folder / "api-key"
    key_file.write_text(API_KEY + "\n")
    args = parse_args([
        "serve", "--config", str(toml), "--target", str(target), "--draft", str(draft),
        "--device", "cpu", "--sampler-impl", "torch", "--max-seq-len", "128", "--host",
        "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--grace-s", "2", "--num-cpus", "4",
        "--tls-cert", str(pki.api[0]), "--tls-key", str(pki.api[1]),
        "--api-key-file", str(key_file),
    ])  # fmt: skip
    config = serve_config(args)
    assert config.services.tls_server_name == SERVICE_NAME
    orchestrator = Orchestrator(config)
    port = orchestrator.start()
    try:
        yield Stack(orchestrator, f"127.0.0.1:{port}", target)
    finally:
        orchestrator.stop(1.0)
    assert not ray.is_initialized()


def test_greedy_output_over_tls_is_the_targets(stack: Stack, pki: Pki) -> None:
    """Drafts travel target -> draft over TLS: the pair came up with its draft and used it."""
    ca = pki.ca.read_bytes()
    with Client(stack.address, timeout=120, root_certificates=ca, api_key=API_KEY) as client:
        assert client.health()
        out = client.complete(
            list(PROMPT), max_tokens=N, temperature=0.0, ignore_eos=True, proposer="draft",
            num_draft_tokens=3,
        )  # fmt: skip
    assert list(out.token_ids) == oracle(stack.target_dir, PROMPT, N)
    assert out.usage is not None and out.usage.num_draft_tokens > 0
    assert stack.orchestrator.clients[0].draft_up


def test_a_plaintext_client_is_refused(stack: Stack) -> None:
    with Client(stack.address, timeout=10) as client:
        assert not client.health()
        with pytest.raises(SpecdecClientError) as info:
            client.complete(list(PROMPT), max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("key", [None, "", "wrong-key-0123456789abcdef", API_KEY[:-1]])
def test_the_client_port_refuses_a_missing_or_wrong_api_key_but_health_is_open(
    stack: Stack, pki: Pki, key: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    ca = pki.ca.read_bytes()
    with Client(stack.address, timeout=30, root_certificates=ca, api_key=key) as client:
        assert client.health()  # probes need no key
        for call in (lambda: client.complete(list(PROMPT), max_tokens=2), client.model_info):
            with pytest.raises(SpecdecClientError) as info:
                call()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer KEY" in info.value.details
    monkeypatch.setenv("SPECDEC_API_KEY", API_KEY)  # the variable is the default key
    with Client(stack.address, timeout=30, root_certificates=ca) as client:
        assert client.model_info()[0].vocab_size > 0


def _health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_service_ports_refuse_plaintext_and_answer_health_over_tls(
    stack: Stack, pki: Pki, role: str
) -> None:
    pair = stack.orchestrator.placement.pairs[0]
    address = pair.target_address if role == "target" else pair.draft_address
    assert address is not None
    with make_channel(address) as plain, pytest.raises(grpc.RpcError) as info:
        _health(plain)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    ca = pki.ca.read_bytes()
    peer = (pki.peer[0].read_bytes(), pki.peer[1].read_bytes())
    stranger = (pki.stranger[0].read_bytes(), pki.stranger[1].read_bytes())
    named = partial(make_channel, address, tls_root_cert=ca, tls_server_name=SERVICE_NAME)
    with named(tls_identity=peer) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    # mutual TLS: no client certificate, or one another CA signed, fails the handshake
    for identity in (None, stranger):
        with named(tls_identity=identity) as channel, pytest.raises(grpc.RpcError) as info:
            _health(channel)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    # the certificate names no IP address: without the override the name check fails
    with make_channel(address, tls_root_cert=ca, tls_identity=peer) as unnamed, \
            pytest.raises(grpc.RpcError) as info:  # fmt: skip
        _health(unnamed)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
