"""The HTTP API under hostile clients: bodies over --max-request-bytes (declared or chunked),
CPU-heavy bodies, inputs that once reached a 500, lax types, clients that leave mid-upload or
mid-request, and half-sent requests. Each is answered (or dropped) without a 500, without an
INTERNAL count, and without stopping /health or running streams.

The client API runs in this process in front of a local pair (`tests.orchestrator.inprocess`);
the HTTP API is served over its `Frontend` on ports of its own: one with the gRPC port's limit
for this max_seq_len (about 96 KiB), one with a 32 MiB limit for the CPU-heavy bodies.
"""

from __future__ import annotations

import http.client
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip(
    "starlette", reason="needs the HTTP API's dependencies: pip install -e '.[dev]'"
)

from orchestrator.config import ServeConfig, ServiceConfig
from orchestrator.launch.ports import bind
from orchestrator.server import Orchestrator
from orchestrator.web.api import HttpApi
from orchestrator.web.chat import ChatTemplate
from orchestrator.web.server import HttpServer
from specdec.limits import MAX_SEED
from target_service.engine import TargetEngine
from tests.draft_service.models import build_checkpoints, model_draft, services
from tests.orchestrator.inprocess import api_on, slow_steps
from tests.orchestrator.test_serve import eventually

MB = 1 << 20
ERRORS = "specdec:request_errors_total"
BIG_LIMIT = 32 * MB
TIMEOUT_S = 1.0  # the rig's header and body timeouts
# a template that iterates two message fields, as tool-calling templates do
TEMPLATE = (
    "{% for m in messages %}{{ 'w3' if m['role'] == 'user' else 'w4' }} {{ m['content'] }} "
    "{% if m.metadata is defined %}{% for k in m.metadata %}{{ k }}{% endfor %}{% endif %}"
    "{% if m.tool_calls is defined %}{% for t in m.tool_calls %}{{ t['id'] }}{% endfor %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}w5{% endif %}"
)
# as long as the checkpoint's 128 positions allow
LONG: dict[str, Any] = {"prompt": [5, 6, 7, 8], "max_tokens": 124, "ignore_eos": True,
                        "temperature": 0, "speculation": {"proposer": "off"}}  # fmt: skip


@dataclass
class Rig:
    orchestrator: Orchestrator
    target_engine: TargetEngine  # the in-process target's, which the hub steps
    port: int  # the HTTP API with the gRPC port's limit
    big_port: int  # the same API with BIG_LIMIT

    def slow_steps(self, step_s: float) -> AbstractContextManager[None]:
        """Every verification step takes at least step_s while this is open (`slow_steps`)."""
        return slow_steps(self.target_engine, step_s)

    @property
    def limit(self) -> int:
        return self.orchestrator.config.request_bytes

    def counts(self, name: str) -> dict[str, float]:
        """A counter's samples by their `code` label (or "")."""
        return {
            s.labels.get("code", ""): s.value
            for family in self.orchestrator.metrics.registry.collect()
            for s in family.samples
            if s.name == name
        }

    def errors_since(self, before: dict[str, float]) -> dict[str, float]:
        """request_errors_total's increase since `before`, by code."""
        deltas = {code: n - before.get(code, 0.0) for code, n in self.counts(ERRORS).items()}
        return {code: n for code, n in deltas.items() if n}


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    target, draft = build_checkpoints(tmp_path_factory.mktemp("http_hostile"))
    config = ServeConfig(
        ServiceConfig(str(target), str(draft), device="cpu", max_seq_len=256, max_requests=4,
                      sampler_impl="torch"),
        host="127.0.0.1", port=0, metrics_port=None, grace_s=0.5,
    )  # fmt: skip
    with services(target, model_draft(draft), sampler_impl="torch") as pair, \
            api_on(pair, config) as api, ExitStack() as servers:  # fmt: skip
        api.frontend.serving = True  # what `specdec serve` sets with the health service's
        ports = []
        for limit in (config.request_bytes, BIG_LIMIT):
            app = HttpApi(api.frontend, ChatTemplate(TEMPLATE), max_request_bytes=limit,
                          body_timeout_s=TIMEOUT_S)  # fmt: skip
            server = HttpServer(app.app, bind("127.0.0.1", 0, "--http-port"), grace_s=0.5,
                                header_timeout_s=TIMEOUT_S)  # fmt: skip
            server.start()
            servers.callback(server.join, 5.0)
            ports.append(server.port)
        yield Rig(api, pair.target_engine, *ports)


def head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    reply = http.client.HTTPResponse(sock)
    reply.begin()
    return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()


def post(port: int, path: str, body: dict[str, Any] | bytes) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head("POST", path, {"Content-Length": str(len(data))}) + data)
        status, _, text = response(sock)
    return status, json.loads(text) if text else {}


class Watch:
    """/health polled back to back, and a long streamed completion read, on threads of their
    own: the longest wait for a /health answer and between two stream events."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.health_s: list[float] = []
        self.stream_gaps_s: list[float] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._health),
            threading.Thread(target=self._stream),
        ]

    def _health(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        while not self._stop.is_set():
            start = time.monotonic()
            conn.request("GET", "/health")
            assert conn.getresponse().read() == b""
            self.health_s.append(time.monotonic() - start)
            time.sleep(0.005)
        conn.close()

    def _stream(self) -> None:
        """Streams one completion after another until stopped."""
        body = json.dumps(LONG | {"stream": True}).encode()
        while not self._stop.is_set():
            with socket.create_connection(("127.0.0.1", self.port), timeout=60) as sock:
                sock.sendall(head("POST", "/v1/completions", {"Content-Length": str(len(body))})
                             + body)  # fmt: skip
                reply = http.client.HTTPResponse(sock)
                reply.begin()
                assert reply.status == 200
                reply.readline()  # the first event: the gaps are measured from it
                last = time.monotonic()
                while not self._stop.is_set() and (line := reply.readline()):
                    if line.startswith(b"data: "):
                        now = time.monotonic()
                        self.stream_gaps_s.append(now - last)
                        last = now

    @contextmanager
    def running(self) -> Iterator[Watch]:
        for t in self._threads:
            t.start()
        eventually(lambda: len(self.stream_gaps_s) >= 2 and len(self.health_s) >= 2, 60)
        try:
            yield self
        finally:
            self._stop.set()
            for t in self._threads:
                t.join(60)

    def worst(self) -> tuple[float, float]:
        """The longest /health answer and the longest gap between stream events, seconds."""
        return max(self.health_s), max(self.stream_gaps_s)


ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
          ("POST", "/detokenize"), ("GET", "/health"), ("GET", "/v1/models"),
          ("POST", "/nowhere")]  # fmt: skip


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_a_20_mb_body_is_refused_at_once_on_every_route(rig: Rig, method: str, path: str) -> None:
    with socket.create_connection(("127.0.0.1", rig.port), timeout=5) as sock:
        start = time.monotonic()
        sock.sendall(head(method, path, {"Content-Length": str(20 * MB)}) + b"[" * 65536)
        status, headers, text = response(sock)
        elapsed = time.monotonic() - start
        try:  # the connection closes: the rest is never read
            closed = sock.recv(1) == b""
        except ConnectionResetError:  # closed with the unread body still queued: a reset
            closed = True
        assert closed, "the connection closes: the rest is never read"
    assert status == 413, text
    error = json.loads(text)["error"]
    assert f"at most {rig.limit} bytes" in error["message"] and "--max-request-bytes" in error[
        "message"]  # fmt: skip
    assert error["code"] == "request_too_large" and headers["connection"] == "close"
    assert elapsed < 0.5, f"refused after {elapsed:.3f} s"


def test_a_chunked_body_is_refused_once_it_passes_the_limit(rig: Rig) -> None:
    chunk = b"w5 " * 20000  # 60,000 bytes
    sent = 0
    with socket.create_connection(("127.0.0.1", rig.port), timeout=5) as sock:
        sock.sendall(head("POST", "/v1/completions", {"Transfer-Encoding": "chunked"}))
        while sent < 20 * MB and not select.select([sock], [], [], 0.005)[0]:
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        status, _, text = response(sock)
    assert status == 413, text
    assert "--max-request-bytes" in json.loads(text)["error"]["message"]
    assert sent < rig.limit + 2 * MB, f"{sent} bytes were sent before the refusal"


def _send_whole(port: int, path: str, body: bytes) -> None:
    """Sends `body` whole if the server reads it; a server that refuses early may reset it."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(head("POST", path, {"Content-Length": str(len(body))}) + body)
            response(sock)
    except OSError:
        pass


def test_health_and_streams_go_on_while_20_mb_bodies_arrive(rig: Rig) -> None:
    ids = json.dumps({"prompt": [5] * (10 * MB // 3)}).encode()  # 20 MB of JSON
    with Watch(rig.port).running() as watch:
        for _ in range(3):
            _send_whole(rig.port, "/v1/completions", ids)
    health_s, gap_s = watch.worst()
    # a 20 MB body read or parsed on the event loop holds /health for seconds; 0.51 s has been
    # seen without one on 2 loaded cores
    assert health_s < 1.0 and gap_s < 2.0, (health_s, gap_s)


def test_cpu_work_runs_off_the_event_loop(rig: Rig) -> None:
    """A 4 MB prompt to /tokenize and 4 MB of prompt ids, under a limit that takes them."""
    text = {"prompt": "w5 w6 " * (4 * MB // 6)}
    ids = {"prompt": [5] * (2 * MB)}
    with Watch(rig.big_port).running() as watch:
        start = time.monotonic()
        tokenized = post(rig.big_port, "/tokenize", text)
        completed = post(rig.big_port, "/v1/completions", ids)
        took = time.monotonic() - start
    health_s, gap_s = watch.worst()
    print(f"4 MB bodies: {took:.2f} s; longest /health {health_s * 1e3:.0f} ms, stream gap "
          f"{gap_s * 1e3:.0f} ms")  # fmt: skip
    assert tokenized[0] == 400 and tokenized[1]["error"]["param"] == "prompt"
    assert "must be at most 4096 characters" in tokenized[1]["error"]["message"]
    assert completed[0] == 400 and completed[1]["error"]["param"] == "prompt"
    # on the event loop, /health would wait out each body's whole parse (about took / 2);
    # off it, only for the GIL's turns. The stream's tokens come from a model in this same
    # process, so its gaps grow with the parse's share of the GIL on a loaded machine: it
    # must only never stop for the whole of the work
    assert health_s < max(0.5, took / 4), (health_s, took)
    assert gap_s < max(2.0, took), (gap_s, took)


def _nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


CHAT = "/v1/chat/completions"
BAD: list[tuple[str, dict[str, Any] | bytes, str, str, str]] = [
    ("/v1/completions", _nested(40_000), "body", "nests deeper than 64", "invalid_value"),
    ("/v1/completions", _nested(100), "prompt[0]", "nests deeper than 64", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": "w5", "tool_calls": 5}]},
     "messages[0].tool_calls", "Input should be a valid list", "invalid_type"),
    (CHAT, {"messages": [{"role": "user", "content": "w5", "metadata": 5}]},
     "messages", "check the type of each message field", "invalid_value"),
    ("/tokenize", {"prompt": "w5 \ud800"}, "prompt", "lone surrogate", "invalid_value"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]},
     "messages[0].content", "lone surrogate", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": "w5 \ud800"}]},
     "messages[0].content", "lone surrogate", "invalid_value"),
    ("/v1/completions", {"prompt": "w5 \udfff"}, "prompt", "lone surrogate", "invalid_value"),
    ("/v1/completions", {"prompt": [5], "stop": ["w6", "\ud800"]}, "stop[1]", "lone surrogate",
     "invalid_value"),
    ("/v1/completions", {"prompt": [5], "max_tokens": "5"}, "max_tokens", "valid integer",
     "invalid_type"),
    ("/v1/completions", {"prompt": [5], "max_tokens": True}, "max_tokens", "valid integer",
     "invalid_type"),
    ("/v1/completions", {"prompt": [5], "max_tokens": 5.0}, "max_tokens", "valid integer",
     "invalid_type"),
    ("/v1/completions", {"prompt": [5], "temperature": True}, "temperature", "valid number",
     "invalid_type"),
    ("/v1/completions", {"prompt": [5], "stream": "yes"}, "stream", "valid boolean",
     "invalid_type"),
    ("/v1/completions", {"prompt": [5], "stream_options": {"include_usage": True}},
     "stream_options", "only allowed when stream is true", "invalid_value"),
    ("/v1/completions", {"prompt": [5, 2**31]}, "prompt",
     "prompt token_ids[1] must be in [0, 250), got 2147483648", "invalid_value"),
    ("/v1/completions", {"prompt": [5], "speculation": {"num_draft_tokens": -1}},
     "speculation.num_draft_tokens", "greater than or equal to 0", "invalid_value"),
    ("/v1/completions", {"prompt": [5], "seed": 2**64}, "seed",
     f"seed must be in [0, {MAX_SEED}], got {2**64}.", "invalid_value"),
    ("/v1/completions", {"prompt": [5], "seed": 2**63}, "seed",
     f"seed must be in [0, {MAX_SEED}], got {2**63}.", "invalid_value"),
    ("/v1/completions", {"prompt": [5], "best_of": 2}, "best_of", "best_of is not supported",
     "invalid_value"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "fragment", "code"), BAD)
def test_hostile_input_is_a_400_naming_its_field(
    rig: Rig,
    caplog: pytest.LogCaptureFixture,
    path: str,
    body: dict[str, Any] | bytes,
    param: str,
    fragment: str,
    code: str,
) -> None:
    before = rig.counts(ERRORS)
    with caplog.at_level(logging.ERROR):
        status, reply = post(rig.port, path, body)
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert fragment in error["message"] and error["param"] in error["message"], error
    assert error["code"] == code and error["type"] == "invalid_request_error"
    assert "INTERNAL" not in rig.errors_since(before)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_nan_is_not_json(rig: Rig) -> None:
    status, reply = post(rig.port, "/v1/completions", b'{"prompt": [5], "temperature": NaN}')
    assert status == 400 and "NaN is not a JSON number" in reply["error"]["message"]


def test_a_client_gone_mid_upload_is_not_internal(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    before = rig.counts(ERRORS)
    with caplog.at_level(logging.WARNING):
        with socket.create_connection(("127.0.0.1", rig.port), timeout=5) as sock:
            sock.sendall(head("POST", "/v1/completions", {"Content-Length": "5000"}) + b'{"p')
            time.sleep(0.2)
        eventually(lambda: rig.errors_since(before) != {}, 10)
    assert rig.errors_since(before) == {"CANCELLED": 1}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_half_sent_requests_are_dropped(rig: Rig) -> None:
    """100 connections stall inside their headers and 100 inside their bodies: each is closed
    within the rig's 1 s timeouts (plus slack), and /health answers meanwhile."""
    whole = json.dumps(LONG).encode()
    partial_head = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-"
    partial_body = head("POST", "/v1/completions", {"Content-Length": str(len(whole))}) + whole[:9]
    socks = [socket.create_connection(("127.0.0.1", rig.port), timeout=10) for _ in range(200)]
    try:
        for i, sock in enumerate(socks):
            sock.sendall(partial_head if i % 2 else partial_body)
        start = time.monotonic()
        health = http.client.HTTPConnection("127.0.0.1", rig.port, timeout=5)
        health.request("GET", "/health")
        assert health.getresponse().status == 200
        health.close()
        # before any stalled connection's timeout: they do not hold the server up (0.51 s was
        # seen once for a bound of 0.5 s on 2 busy cores)
        assert time.monotonic() - start < TIMEOUT_S
        for i, sock in enumerate(socks):
            sock.settimeout(max(0.01, start + 4 * TIMEOUT_S - time.monotonic()))
            data = b"".join(iter(lambda s=sock: s.recv(65536), b""))  # type: ignore[misc]
            if i % 2:
                assert data == b"", "a stalled header gets no answer: its connection closes"
            else:
                assert data.startswith(b"HTTP/1.1 408"), data
                assert b"did not arrive within 1 s" in data
    finally:
        for sock in socks:
            sock.close()


def test_a_non_streamed_request_is_cancelled_when_its_client_goes(rig: Rig) -> None:
    sched = rig.orchestrator.scheduler
    assert sched is not None
    before = rig.counts(ERRORS)
    generated = sum(rig.counts("specdec:generation_tokens_total").values())
    body = json.dumps(LONG).encode()
    # the request (proposer off: one token a step) runs for at least 124 * 20 ms = 2.5 s, so
    # its client is gone long before it could end at max_tokens, however fast the machine
    with rig.slow_steps(0.02):
        with socket.create_connection(("127.0.0.1", rig.port), timeout=10) as sock:
            sock.sendall(head("POST", "/v1/completions", {"Content-Length": str(len(body))})
                         + body)  # fmt: skip
            eventually(lambda: sched.snapshot()[0] == 1, 30)
        eventually(lambda: sched.snapshot()[:2] == (0, 0), 30)
    assert rig.errors_since(before) == {"CANCELLED": 1}
    tokens = sum(rig.counts("specdec:generation_tokens_total").values()) - generated
    assert tokens < LONG["max_tokens"], "it stopped when its client went, not at max_tokens"


def test_connections_past_the_limit_are_answered_503_at_once(rig: Rig) -> None:
    """The HTTP port holds at most max_connections open connections (idle ones count): a
    request past them is answered 503 at once, and the port serves again once they close."""
    app = HttpApi(rig.orchestrator.frontend, ChatTemplate(TEMPLATE), max_request_bytes=1024)
    server = HttpServer(app.app, bind("127.0.0.1", 0, "--http-port"), grace_s=0.5,
                        max_connections=3)  # fmt: skip
    server.start()
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(3)]
        time.sleep(0.2)  # accepted
        start = time.monotonic()
        extra = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        extra.request("GET", "/health")
        assert extra.getresponse().status == 503
        assert time.monotonic() - start < 2.0
        extra.close()
        for sock in idle:
            sock.close()

        def healthy() -> bool:
            again = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            again.request("GET", "/health")
            status = again.getresponse().status
            again.close()
            return status == 200

        eventually(healthy, 10)
    finally:
        server.join(5.0)
