"""The API key check (`specdec.serving.auth`): the function an HTTP API reuses, and the gRPC
interceptor on a real in-process server (the client API's servicer before its services are up:
an authorised call gets as far as UNAVAILABLE, an unauthorised one stops at UNAUTHENTICATED)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from orchestrator.core.frontend import Frontend
from orchestrator.core.servicer import SERVICE_NAME, GenerateServicer, add_to_server
from specdec.client import Client, SpecdecClientError
from specdec.serving.auth import ApiKeyInterceptor, authorized, check_api_key, read_api_key_file
from specdec.serving.server import Server, ServerConfig

KEY = "k3y-0123456789-abcdef"


def test_authorized_takes_only_the_exact_bearer_key() -> None:
    assert authorized(f"Bearer {KEY}", KEY)
    assert authorized(f"Bearer {KEY} ", KEY)  # as HTTP servers may leave it
    for value in (None, "", KEY, f"bearer {KEY}", f"Basic {KEY}", f"Bearer {KEY}x",
                  f"Bearer {KEY[:-1]}", "Bearer ", "Bearer \u00e9"):  # fmt: skip
        assert not authorized(value, KEY), value


def test_keys_that_cannot_be_secrets_or_metadata_are_refused(tmp_path: Path) -> None:
    assert check_api_key(KEY) == KEY
    for bad in ("short", "x" * 4097, "has a space 0123456789", "caf\u00e9-0123456789abc"):
        with pytest.raises(ValueError, match=r"api_key must be 16 to 4096 printable ASCII"):
            check_api_key(bad)
    path = tmp_path / "key"
    path.write_text(f"{KEY}\n")
    assert read_api_key_file(path) == KEY
    with pytest.raises(ValueError, match="cannot be read"):
        read_api_key_file(tmp_path / "missing")


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    servicer = GenerateServicer(Frontend(8))  # no backend: an authorised call is UNAVAILABLE
    server = Server(
        ServerConfig(), [SERVICE_NAME], lambda s: add_to_server(servicer, s),
        [ApiKeyInterceptor(KEY)],
    )  # fmt: skip
    server.start()
    server.set_serving(True)
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        server.stop(0)


@pytest.mark.parametrize(
    ("key", "code"),
    [
        (KEY, grpc.StatusCode.UNAVAILABLE),
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("wrong-key-0123456789", grpc.StatusCode.UNAUTHENTICATED),
    ],
)
def test_every_method_but_health_needs_the_key(
    address: str, key: str | None, code: grpc.StatusCode, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    with Client(address, timeout=10, api_key=key) as client:
        assert client.health()
        calls = [
            lambda: client.complete([1, 2], max_tokens=1),
            lambda: list(client.generate([1, 2], max_tokens=1)),
            client.model_info,
            lambda: client.set_speculation("r", proposer="off"),
        ]
        for call in calls:
            with pytest.raises(SpecdecClientError) as info:
                call()
            assert info.value.code == code, info.value


def test_the_async_client_sends_its_key(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from specdec.client import AsyncClient

    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)

    async def codes() -> list[grpc.StatusCode]:
        out = []
        for key in (KEY, None):
            async with AsyncClient(address, timeout=10, api_key=key) as client:
                assert await client.health()
                try:
                    await client.model_info()
                except SpecdecClientError as e:
                    out.append(e.code)
        return out

    assert asyncio.run(codes()) == [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED]
