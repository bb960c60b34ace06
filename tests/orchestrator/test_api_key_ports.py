"""With an API key set, every port of `specdec serve` keeps its probes open: gRPC health, the
HTTP API's /health and the Prometheus /metrics answer without the key, while the client API's
methods and the HTTP API's routes refuse a caller without it. The ports are bound as `serve`
binds them (`Orchestrator._bind`); no pair is started."""

from __future__ import annotations

from pathlib import Path
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest

from orchestrator.cli.main import parse_args
from orchestrator.cli.serve import serve_config
from orchestrator.server import Orchestrator
from specdec.client import Client, SpecdecClientError

KEY = "probe-test-key-0123456789"


def _get(url: str, key: str | None = None) -> tuple[int, str]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    try:
        with urlopen(Request(url, headers=headers), timeout=30) as r:
            return r.status, r.read().decode()
    except HTTPError as e:
        return e.code, e.read().decode()


def test_health_and_metrics_stay_open_when_a_key_is_set(
    checkpoints: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    target, draft = checkpoints
    args = ["serve", "--target", str(target), "--draft", str(draft), "--host", "127.0.0.1",
            "--port", "0", "--metrics-port", "0", "--http-port", "0", "--api-key", KEY]  # fmt: skip
    orchestrator = Orchestrator(serve_config(parse_args(args)))
    try:
        port = orchestrator._bind()
        status, text = _get(f"http://127.0.0.1:{orchestrator.metrics_port}/metrics")
        assert status == 200 and "specdec:pairs" in text
        http = f"http://127.0.0.1:{orchestrator.http_port}"
        assert _get(f"{http}/health")[0] == 503  # answered without a key: no pair is ready
        assert _get(f"{http}/v1/models")[0] == 401
        assert _get(f"{http}/v1/models", "wrong-key-0123456789")[0] == 401
        assert _get(f"{http}/v1/models", KEY)[0] != 401  # past the key (no pair is running)
        with Client(f"127.0.0.1:{port}", timeout=10) as client:
            assert client.health() is False  # answered, without a key: NOT_SERVING, no pair
            with pytest.raises(SpecdecClientError) as info:
                client.model_info()
        assert info.value.code.name == "UNAUTHENTICATED"
    finally:
        orchestrator.stop(0)
